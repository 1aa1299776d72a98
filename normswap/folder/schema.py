"""config.json's `normswap` section as normswap checks it: the shipped modules' checks (the ones every converted
folder ships and runs in plain transformers), raising NormswapError.

The section: `format` (4; 2 and 3 still read), `base` (the original architecture and model_type), `norms` (name ->
type, width, eps, affine, p), `added_biases`, `output_fixes` (name -> centre, bias width, input, matrix width),
`conversions`, `fingerprint` (a probe input and the digest of the model's output on it: `folder.fingerprint`) and a
`checksum` of itself and of the weights files' headers (a hand-edited section or swapped weights are refused).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from normswap.errors import NormswapError, reraised
from normswap.folder import checksum as sums
from normswap.folder import fingerprint, portable

FORMAT = portable.FORMAT


class FingerprintFailed(NormswapError):
    """A loaded model does not reproduce its folder's fingerprint (`folder.fingerprint`)."""


def validate(section, where: str, model: nn.Module | None = None) -> dict:
    """Check `section` (types, ranges, format; with `model`, that every named module exists)."""
    with reraised(portable.InvalidConversion):
        return portable.validate(section, where, model)


def checksum(section: dict, folder: Path) -> dict:
    """Hashes of the section (without its checksum) and of the weights' headers (names, shapes, offsets)."""
    with reraised(portable.InvalidConversion):
        return sums.checksum(section, folder)


def verify_checksum(section: dict, folder: Path | None, where: str) -> None:
    """Refuse a section edited after save; given `folder`, also weights other than the ones saved."""
    with reraised(portable.InvalidConversion):
        sums.verify_checksum(section, folder, where)


def verify_fingerprint(model: nn.Module, section: dict, where: str, check: bool = True) -> None:
    """Refuse a loaded model that does not reproduce the section's fingerprint (`check=False` skips it)."""
    if not check:
        return
    try:
        fingerprint.verify(model, section, where)
    except fingerprint.FingerprintMismatch as e:
        raise FingerprintFailed(str(e)) from None
    except portable.InvalidConversion as e:
        raise NormswapError(str(e)) from None
