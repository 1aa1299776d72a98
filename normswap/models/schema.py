"""config.json's `normswap` section as normswap checks it: `portable`'s checks (the ones every converted
folder ships and runs in plain transformers), raising NormswapError.

The section: `format` (2; 3 where an output fix multiplies by a matrix, which format 2 readers refuse:
`section_format`), `base` (the original architecture and model_type), `norms` (name -> type, width, eps, affine,
p), `added_biases`, `output_fixes` (name -> centre, bias width, input, matrix width), `conversions` and a
`checksum` of itself and of the weights files' headers (a hand-edited section or swapped weights are refused).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from normswap.errors import reraised
from normswap.io import portable

FORMAT = portable.FORMAT


def section_format(section: dict) -> int:
    """The format to save `section` as: 3 where a fix has a matrix (a format 2 reader, which ignored keys it did
    not know, would load another model: it refuses format 3), else 2 (which older readers load too)."""
    fixes = section.get("output_fixes", {}).values()
    return portable.MATRIX_FORMAT if any(s.get(k) for s in fixes for k in portable.MATRICES) else FORMAT


def validate(section, where: str, model: nn.Module | None = None) -> dict:
    """Check `section` (types, ranges, format; with `model`, that every named module exists)."""
    with reraised(portable.InvalidConversion):
        return portable.validate(section, where, model)


def checksum(section: dict, folder: Path) -> dict:
    """Hashes of the section (without its checksum) and of the weights' headers (names, shapes, offsets)."""
    with reraised(portable.InvalidConversion):
        return portable.checksum(section, folder)


def verify_checksum(section: dict, folder: Path | None, where: str) -> None:
    """Refuse a section edited after save; given `folder`, also weights other than the ones saved."""
    with reraised(portable.InvalidConversion):
        portable.verify_checksum(section, folder, where)
