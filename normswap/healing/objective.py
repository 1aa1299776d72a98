"""What `heal` minimises, and measures on held-out text: one loss per window of tokens.

"kd" distils: KL(teacher || student) over next-token distributions, averaged over positions, for models with
logits; for encoders without a head, the MSE between their hidden states, averaged over layers. "lm" is the
plain next-token loss on the text (no teacher). The training loss is the mean over a batch's windows; the
held-out metric is the same quantity on windows the training never draws.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.folder.shipped import original_class


def check_teacher(student, teacher) -> None:
    """Distillation feeds the teacher the student's token windows: one that reads other inputs (an image model)
    or is another kind of model (an encoder-decoder for a decoder) is refused in one line, before training."""
    if teacher is None:
        return
    reads = [getattr(m, "main_input_name", "input_ids") for m in (student, teacher)]
    if reads[0] != reads[1]:
        raise NormswapError(f"the teacher ({original_class(teacher).__name__}) reads `{reads[1]}`, the student "
                            f"({original_class(student).__name__}) `{reads[0]}`: distil from the model the student was "
                            "converted from")
    kinds = [bool(getattr(getattr(m, "config", None), "is_encoder_decoder", False)) for m in (student, teacher)]
    if kinds[0] != kinds[1]:
        raise NormswapError(f"the teacher ({original_class(teacher).__name__}) is {'an' if kinds[1] else 'not an'} "
                            f"encoder-decoder and the student ({original_class(student).__name__}) "
                            f"{'is' if kinds[0] else 'is not'}: distil from the model the student was converted from")


def _same_heads(s, t) -> None:
    """Student and teacher outputs compare like with like: logits with logits, hidden states with hidden states."""
    has = [getattr(o, "logits", None) is not None for o in (s, t)]
    if has[0] != has[1]:
        raise NormswapError(f"the {'student' if has[0] else 'teacher'} gives logits and the "
                            f"{'teacher' if has[0] else 'student'} none (a model without its head): distil from "
                            "the model the student was converted from, with the same head")


@torch.no_grad()
def metric(student, objective: str, x: torch.Tensor) -> str:
    """The name of what `window_losses` returns for this model: kl, hidden_mse or nll. Looks at one forward
    on the windows `x` (a collective under FSDP: every process calls it)."""
    if objective == "lm":
        return "nll"
    return "kl" if getattr(student(input_ids=x[:1]), "logits", None) is not None else "hidden_mse"


def window_losses(student, teacher, x: torch.Tensor, objective: str) -> torch.Tensor:
    """The loss of each window (row) of `x`, in fp32: shape (batch,)."""
    if objective == "lm":
        logits = student(input_ids=x).logits.float()
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        return nll.mean(-1)
    with torch.no_grad():
        t = teacher(input_ids=x, output_hidden_states=True)
    s = student(input_ids=x, output_hidden_states=True)
    _same_heads(s, t)
    if getattr(s, "logits", None) is not None:
        if s.logits.shape != t.logits.shape:
            raise NormswapError(f"teacher and student outputs differ: {tuple(t.logits.shape)} vs "
                                f"{tuple(s.logits.shape)} (different vocabularies?)")
        ls, lt = s.logits.float().log_softmax(-1), t.logits.float().log_softmax(-1)
        return F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1).mean(-1)
    if len(s.hidden_states) != len(t.hidden_states) or s.hidden_states[-1].shape != t.hidden_states[-1].shape:
        raise NormswapError("teacher and student hidden states differ in shape: not the same architecture")
    per_layer = [(a.float() - b.float()).pow(2).flatten(1).mean(-1) for a, b in zip(s.hidden_states, t.hidden_states)]
    return torch.stack(per_layer).mean(0)
