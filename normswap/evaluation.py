"""`evaluate`: sliding-window perplexity, and agreement with a reference model (KL, top-1, embedding cosine).

Stride semantics (as in Hugging Face's perplexity guide): windows of `seq_len` tokens start every
`stride` tokens; each window scores only the tokens no earlier window scored, so every token after the
first is scored exactly once, with at least `seq_len - stride` tokens of context (fewer only inside
the first window). stride must be < seq_len (the guide's stride == seq_len silently skips each window's
first token); a smaller stride means more context per token and more compute.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.demo import HELDOUT_FILE, heldout_text
from normswap.models.introspect import is_causal_lm
from normswap.models.modes import eval_mode
from normswap.parity import compare, json_safe, nonnegative, scope, token_kl
from normswap.progress import bar
from normswap.textdata import joined_ids, max_positions, sentences
from normswap.folder.shipped import original_class


@dataclass
class EvalReport:
    kind: str                              # "causal-lm", "encoder" or "parity" (non-text / seq2seq)
    perplexity: float | None = None        # exp(mean NLL) over the scored tokens
    nll: float | None = None
    tokens: int | None = None              # tokens scored
    seq_len: int | None = None
    stride: int | None = None
    kl: float | None = None                # mean KL(reference || model) per scored token (never < 0)
    top1_agreement: float | None = None    # fraction of positions where both predict the same token
    cosine: float | None = None            # encoders: mean cosine of mean-pooled embeddings
    cosine_min: float | None = None
    sentences: int | None = None
    max_rel: float | None = None           # parity: max |Δ output| / max |reference output|
    max_abs: float | None = None
    output: str | None = None              # parity: the main output
    worst: str | None = None               # parity: the output with the largest relative error
    compared: list[str] | None = None      # parity: every output compared
    excluded: dict | None = None           # parity: outputs not compared -> why

    def error(self) -> str | None:
        """Why the numbers are unusable (NaN/inf: a broken model), else None."""
        bad = [k for k, v in asdict(self).items() if isinstance(v, float) and not math.isfinite(v)]
        return f"non-finite {', '.join(bad)}: the model gives NaN/inf outputs" if bad else None

    def to_dict(self) -> dict:
        """JSON-safe: NaN/inf become null and an "error" field says why (json.dumps would write NaN)."""
        d = json_safe(asdict(self))
        return {**d, "error": self.error()} if self.error() else d

    def __str__(self) -> str:
        if self.error():
            return f"error: {self.error()}"
        if self.kind == "parity":
            kl = f", KL {self.kl:.3e}" if self.kl is not None else ""
            where = scope(self.output, self.worst or "", self.compared or [], self.excluded or {})
            return (f"parity to reference on sample inputs ({where}; no perplexity for this model): "
                    f"max |Δ| {self.max_abs:.3e}, rel {self.max_rel:.3e}{kl}")
        if self.kind == "encoder":
            return (f"embedding cosine to reference: mean {self.cosine:.6f}, min {self.cosine_min:.6f} "
                    f"over {self.sentences} sentences")
        s = (f"perplexity {self.perplexity:.4f} over {self.tokens} tokens "
             f"(window {self.seq_len}, stride {self.stride})")
        if self.kl is not None:
            s += f"; vs reference: KL {self.kl:.4e}, top-1 agreement {self.top1_agreement:.4f}"
        return s


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _vocab_size(model) -> int | None:
    """How many tokens `model` scores: its output head's rows, else config.vocab_size (None: unknown)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    return getattr(getattr(model, "config", None), "vocab_size", None)


def check_vocabulary(model: nn.Module, other: nn.Module, what: str, tokenizers=(None, None)) -> None:
    """Distillation, KL and top-1 agreement compare token by token: `other` (`what`: "the teacher", "the
    reference") must map text to the same ids as `model` (`tokenizers`: theirs, where known) and score as many
    tokens."""
    tok, other_tok = tokenizers
    if tok is not None and other_tok is not None:
        a, b = tok.get_vocab(), other_tok.get_vocab()
        if a != b:
            differ = sum(1 for k, v in a.items() if b.get(k) != v)
            raise NormswapError(f"{what}'s tokenizer does not match the model's ({len(b)} vs {len(a)} tokens, "
                                f"{differ} mapped differently): they must share one vocabulary")
    if other is None:
        return
    n, m = _vocab_size(model), _vocab_size(other)
    if n is not None and m is not None and n != m:
        raise NormswapError(f"{what}'s vocabulary differs from the model's ({m} vs {n} tokens)")


def windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) of every window over n tokens; see the module docstring."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def _causal(model, tokenizer, texts, reference, seq_len, stride, batch_size, show_progress) -> EvalReport:
    ids = joined_ids(tokenizer, texts)
    if len(ids) < 2:
        raise NormswapError("the text has fewer than 2 tokens: nothing to score")
    limit = max_positions(model) or 1024
    seq_len = min(seq_len or limit, limit)
    stride = stride or max(1, seq_len // 2)
    if seq_len < 2 or not 1 <= stride < seq_len:
        raise NormswapError(f"need seq_len >= 2 and 1 <= stride < seq_len, got seq_len {seq_len}, "
                            f"stride {stride}")
    if reference is not None:
        check_vocabulary(model, reference, "the reference")
    nll = kl = 0.0
    agree = count = 0
    spans = windows(len(ids), seq_len, stride)
    # Windows of equal length share a batch (all but the last are seq_len long).
    body = spans[:-1]
    groups = [body[i:i + batch_size] for i in range(0, len(body), batch_size)] + [spans[-1:]]
    for group in bar(groups, desc="eval", enabled=show_progress):
        x = torch.stack([ids[b:e] for b, e, _ in group]).to(_device(model))
        logp = model(input_ids=x).logits.float().log_softmax(-1)
        ref = (reference(input_ids=x.to(_device(reference))).logits.float().log_softmax(-1).to(logp.device)
               if reference is not None else None)
        for row, (b, e, first) in enumerate(group):
            pos = torch.arange(first - b - 1, e - b - 1, device=logp.device)  # positions predicting first..e-1
            target = x[row, pos + 1]
            lp = logp[row, pos]
            nll -= lp.gather(-1, target[:, None]).double().sum().item()
            count += len(pos)
            if ref is not None:
                rp = ref[row, pos]
                kl += token_kl(rp, lp).double().sum().item()
                agree += (rp.argmax(-1) == lp.argmax(-1)).sum().item()
    report = EvalReport("causal-lm", perplexity=math.exp(nll / count), nll=nll / count, tokens=count,
                        seq_len=seq_len, stride=stride)
    if reference is not None:
        report.kl, report.top1_agreement = nonnegative(kl / count), agree / count
    return report


def _embed(model, batch) -> torch.Tensor:
    """Mean-pooled last hidden state over the real (unpadded) tokens."""
    out = model(**batch, output_hidden_states=True)
    h = getattr(out, "last_hidden_state", None)
    h = out.hidden_states[-1] if h is None else h
    mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return ((h * mask).sum(1) / mask.sum(1).clamp(min=1)).float()


@torch.no_grad()
def _encoder(model, tokenizer, texts, reference, seq_len, batch_size, max_sentences, show_progress) -> EvalReport:
    if reference is None:
        raise NormswapError("perplexity needs a causal LM; for an encoder pass a reference model "
                            "(`reference`) to compare embeddings")
    if tokenizer is None:
        raise NormswapError("no tokenizer: the model folder needs its tokenizer files")
    sents = sentences(texts, limit=max_sentences)
    if not sents:
        raise NormswapError("the text has no sentences of 4 words or more")
    limit = max_positions(model) or 512
    sents.sort(key=len)  # similar lengths share a batch: little padding (the mean ignores order)
    cos = []
    for i in bar(range(0, len(sents), batch_size), desc="eval", enabled=show_progress):
        batch = tokenizer(sents[i:i + batch_size], padding=True, truncation=True,
                          max_length=min(seq_len or limit, limit), return_tensors="pt")
        a = _embed(model, {k: v.to(_device(model)) for k, v in batch.items()})
        b = _embed(reference, {k: v.to(_device(reference)) for k, v in batch.items()}).to(a.device)
        cos.append(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1))
    c = torch.cat(cos)
    return EvalReport("encoder", cosine=c.mean().item(), cosine_min=c.min().item(), sentences=len(c))


def text_only(model: nn.Module) -> bool:
    """False for models that read images or audio, and for encoder-decoders: no perplexity on text."""
    main = getattr(model, "main_input_name", "input_ids")
    return main == "input_ids" and not getattr(model.config, "is_encoder_decoder", False)


@torch.no_grad()
def _parity(model, reference) -> EvalReport:
    if reference is None:
        kind = " encoder-decoder" if getattr(model.config, "is_encoder_decoder", False) else ""
        raise NormswapError(f"no perplexity for {original_class(model).__name__}: a{kind} model reading "
                            f"{getattr(model, 'main_input_name', 'input_ids')}; pass the original "
                            "(`reference`) to measure parity to it on sample inputs")
    p = compare(reference, model)
    return EvalReport("parity", kl=p.kl, max_rel=p.max_rel, max_abs=p.max_abs, output=p.output, worst=p.worst,
                      compared=p.compared, excluded=p.excluded)


def evaluate(model: nn.Module, tokenizer, texts: list[str] | str | None = None,
             reference: nn.Module | None = None, seq_len: int | None = None, stride: int | None = None,
             batch_size: int = 8, max_sentences: int = 2000, show_progress: bool = False) -> EvalReport:
    """Perplexity of a causal LM on `texts` (default: the held-out Austen text), sliding window
    (seq_len default: the model's context; stride default: seq_len // 2). With `reference`: mean
    KL(reference || model) and top-1 agreement on the same positions. Encoders (no LM head): mean
    cosine similarity of mean-pooled embeddings to `reference`, over the sentences of `texts`.
    Image, speech and encoder-decoder models: parity to `reference` on sample inputs (no texts read).
    """
    if texts is None:
        if not HELDOUT_FILE.exists():
            raise NormswapError(f"the bundled held-out text is missing ({HELDOUT_FILE}): pass `texts`")
        texts = [heldout_text()]
    with eval_mode(model, reference):
        if not text_only(model):
            return _parity(model, reference)
        if is_causal_lm(model):
            return _causal(model, tokenizer, texts, reference, seq_len, stride, batch_size, show_progress)
        return _encoder(model, tokenizer, texts, reference, seq_len, batch_size, max_sentences, show_progress)
