"""genai_config.json: lets onnxruntime-genai's generate() loop run an exported decoder with the past.

Our graph already has the I/O genai's generic "decoder" type reads (input_ids, attention_mask over past +
new tokens, position_ids, past_key_values.%d.key/value -> logits, present.%d.key/value, cache in
(batch, kv heads, length, head dim)), so the config only names them and copies the sizes.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from normswap.export import wrap
from normswap.models.introspect import config_int


def _token_id(value):
    """genai wants one int, or for eos a list of them (generation_config may list several)."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


# generation_config.json settings genai's "search" section takes under the same name
SEARCH = ("do_sample", "num_beams", "num_return_sequences", "repetition_penalty", "temperature", "top_k", "top_p",
          "length_penalty", "no_repeat_ngram_size", "early_stopping", "min_length")


def _search(gen, context: int) -> dict:
    """genai's defaults, overridden by what the model's generation_config sets explicitly (not HF's
    defaults, e.g. max_length 20); max_new_tokens has no genai equivalent: max_length stays the context."""
    search = {"do_sample": False, "early_stopping": True, "max_length": context, "min_length": 0,
              "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
              "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    set_here = gen.to_diff_dict() if gen is not None else {}
    search.update({k: set_here[k] for k in SEARCH if set_here.get(k) is not None and (
        k != "early_stopping" or isinstance(set_here[k], bool))})   # HF also allows "never"
    if set_here.get("max_length") is not None:
        search["max_length"] = min(int(set_here["max_length"]), context)
    return search


def config(model: nn.Module, onnx_name: str) -> dict:
    """genai_config.json's content for `model` exported with the past to `onnx_name`."""
    cfg, gen = model.config, getattr(model, "generation_config", None)
    _, heads, _, head_dim = wrap.kv_shape(model, 1, 0)
    layers = wrap.num_layers(cfg)
    attn_heads, hidden = config_int(cfg, "heads"), config_int(cfg, "hidden")
    # genai sizes its buffers from context_length; ALiBi models (BLOOM) have no limit: take 2048
    context = config_int(cfg, "positions") or 2048

    def token(name):
        value = getattr(gen, name, None) if gen is not None else None
        return _token_id(value if value is not None else getattr(cfg, name, None))

    eos = token("eos_token_id")
    pad = token("pad_token_id")
    first_eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return {
        "model": {
            "bos_token_id": token("bos_token_id"),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": onnx_name,
                "head_size": head_dim,
                "hidden_size": hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           **({"position_ids": "position_ids"} if wrap.takes_positions(model) else {}),
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": attn_heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else first_eos,
            "type": "decoder",
            "vocab_size": cfg.vocab_size,
        },
        "search": _search(gen, context),
    }


def write(model: nn.Module, out: Path, onnx_name: str) -> None:
    (out / "genai_config.json").write_text(json.dumps(config(model, onnx_name), indent=2) + "\n")
