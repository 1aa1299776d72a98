"""The names transformers gives a model's tensors on disk, which are not always the model's own.

transformers 5 renamed some modules (GPT-NeoX's head `embed_out` is `lm_head`) and writes checkpoints under the
old names, which transformers 4 builds and 5 renames back when loading. normswap writes its folders the same
way (`save_pretrained`), and its `normswap` section maps each renamed module to its name on disk (`renamed`), so
that the shipped modeling_normswap.py finds every module, and reads every tensor, in either major version.
"""
from __future__ import annotations

from normswap.folder.shipped import saved_names

__all__ = ["renamed_modules", "saved_names"]


def renamed_modules(saved: dict[str, str]) -> dict[str, str]:
    """Module name -> its name on disk (and in transformers 4), from `saved_names`: each renamed key's part
    before the dotted tail that both names share ("lm_head.weight" -> "embed_out.weight": lm_head -> embed_out)."""
    out = {}
    for key, new in saved.items():
        a, b = key.split("."), new.split(".")
        n = 0
        while n < min(len(a), len(b)) - 1 and a[-1 - n] == b[-1 - n]:
            n += 1
        out[".".join(a[:len(a) - n])] = ".".join(b[:len(b) - n])
    return dict(sorted(out.items()))
