"""`generate_checkpoint`: what `normswap generate` runs, for Python callers too: a causal LM's continuation of a
prompt, to look at a converted or healed model's text by eye."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from normswap.errors import NormswapError, first_line, warn_caller
from normswap.models.introspect import is_causal_lm
from normswap.models.load import load_model
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import GenerateOptions
from normswap.textdata import max_positions
from normswap.folder.shipped import original_class


@dataclass
class Generation:
    prompt: str
    text: str                     # the new tokens, decoded
    prompt_ids: list[int]
    new_ids: list[int]

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "prompt_ids": self.prompt_ids, "new_ids": self.new_ids}


def _within_window(model, src: str, prompt: int, asked: int) -> int:
    """How many new tokens fit the model's context window after a `prompt` of that many tokens (all `asked` where
    it states none): a prompt that fills it is refused, a continuation that would pass it stops there, saying so."""
    window = max_positions(model)
    if window is None or prompt + asked <= window:
        return asked
    if prompt >= window:
        raise NormswapError(f"the prompt is {prompt} tokens and {src} reads at most {window} (its context window): "
                            "shorten the prompt")
    warn_caller(f"{src} reads at most {window} tokens (its context window): generating {window - prompt} new tokens "
                f"after the prompt's {prompt}, not {asked}")
    return window - prompt


def generate_checkpoint(src: str, prompt: str, options: GenerateOptions | None = None) -> Generation:
    """The continuation of `prompt` by the causal LM at `src` (folder, Hub id or "normswap-demo"), through
    transformers' own `generate`: greedy unless `options.sample` (the folder's generation_config.json gives
    eos and pad ids; its sampling settings apply only with `sample`)."""
    o = options if options is not None else GenerateOptions()
    if int(o.max_new_tokens) < 1 or not o.temperature > 0:
        raise NormswapError(f"max_new_tokens must be >= 1 and temperature > 0, got {o.max_new_tokens} and "
                            f"{o.temperature}")
    if not prompt:   # before the (slow) load
        raise NormswapError("the prompt is empty: give some text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:   # bytes the command line could not decode, kept as lone surrogates
        raise NormswapError(f"the prompt is not valid UTF-8 text (position {e.start}): give it as UTF-8") from None
    device = resolve_device(o.device)
    model, tok = load_model(src, options=o.load)
    if not is_causal_lm(model):
        raise NormswapError(f"generate needs a causal LM; {src} is a {original_class(model).__name__}")
    if tok is None:
        raise NormswapError(f"{src} has no tokenizer files")
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise NormswapError("the prompt is empty: give some text to continue")
    new_tokens = _within_window(model, src, ids.shape[1], int(o.max_new_tokens))
    model.to(device)
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad   # an eos list: its first id pads
    sampling = dict(do_sample=True, temperature=o.temperature) if o.sample else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):   # the caller's RNG untouched
            torch.manual_seed(o.seed)
            out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                 max_new_tokens=new_tokens, pad_token_id=pad, **sampling)
    except (RuntimeError, ValueError, TypeError) as e:
        raise NormswapError(f"cannot generate with {src}: {first_line(e)}") from None
    new = out[0, ids.shape[1]:].tolist()
    return Generation(prompt, tok.decode(new, skip_special_tokens=True), ids[0].tolist(), new)
