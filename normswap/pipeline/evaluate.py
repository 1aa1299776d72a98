"""`evaluate_checkpoint`: what `normswap eval` runs, for Python callers too; and `load_pair`, the loading that
it and `heal_checkpoint` share (a model and the original it is compared with)."""
from __future__ import annotations

import torch

from normswap.errors import NormswapError
from normswap.evaluation import EvalReport, check_vocabulary, evaluate, text_only
from normswap.models.load import LoadOptions, load_model
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import EvaluateOptions
from normswap.textdata import read_texts


def load_pair(src: str, other: str | None, what: str, load: LoadOptions, device: torch.device | None = None):
    """(model, `other` model or None, tokenizer): both loaded alike (on `device`, when given), `other` (`what`:
    "the teacher", "the reference") checked to share the model's vocabulary."""
    model, tok = load_model(src, options=load)
    ref, ref_tok = load_model(other, options=load) if other else (None, None)
    if device is not None:
        model.to(device)
        if ref is not None:
            ref.to(device)
    check_vocabulary(model, ref, what, (tok, ref_tok))
    tok = tok if tok is not None else ref_tok
    if tok is None and text_only(model):  # image/speech/seq2seq eval needs none (parity on sample inputs)
        raise NormswapError(f"{src} has no tokenizer files")
    return model, ref, tok


def evaluate_checkpoint(src: str, options: EvaluateOptions | None = None) -> EvalReport:
    """Perplexity of the model at `src` (folder, Hub id or "normswap-demo") on `options.data` (default: the
    bundled held-out text), and its agreement with `options.reference`: see `normswap.evaluate`. A NaN model
    gives a report whose `error()` says so."""
    o = options if options is not None else EvaluateOptions()
    device = resolve_device(o.device)
    texts = read_texts(o.data) if o.data else None
    model, ref, tok = load_pair(src, o.reference, "the reference", o.load, device)
    return evaluate(model, tok, texts, reference=ref, seq_len=o.seq_len, stride=o.stride, batch_size=o.batch_size,
                    show_progress=o.show_progress)
