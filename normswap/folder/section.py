"""config.json's `normswap` section (a module's normswap.json) as a type: `Section`, with its parts `Base`, `Norm`,
`Fix` and `Checksum`, read from and written back to the exact dict a folder stores (`from_dict` / `to_dict`), and
checked by the shipped checks (`portable.validate`: format, types, ranges). A section is born in its final format
(`Section.new`); `write` is the one place a section goes to disk (sealed: fingerprint and checksum).

The dict: `format` (4; 2 and 3 still read), `base` (the original architecture and model_type), `norms` (name ->
type, width, eps, affine, p), `added_biases`, `output_fixes` (name -> centre, bias width, input, matrix widths,
online rotation widths), `conversions`, `rotations`, `not_preserved` (output -> why), `renamed` (module prefix ->
name on disk), `fingerprint` (`folder.fingerprint`) and `checksum` (of itself and of the weights files' headers). An
optional key a section lacks is None here, and stays absent in its dict.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from normswap.errors import reraised
from normswap.folder.attached import MODULE_TYPE, has_config, qualified_name
from normswap.folder.portable import FORMAT, InvalidConversion
from normswap.folder.schema import validate
from normswap.folder.shipped import finish_folder, original_class, sealed
from normswap.io.owned import RECORD

FIX_KEYS = ("input", "matrix", "input_matrix", "online", "online_factor")   # an output fix's optional keys
# Optional keys, in the order `to_dict` writes them (output fixes first, the checksum last: they are typed).
OPTIONAL = ("output_fixes", "conversions", "rotations", "not_preserved", "renamed", "fingerprint", "checksum")


def _present(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _made(cls: type, d: dict):
    """`cls` from the keys of `d` it has fields for (a checked dict: the others are none of this format's)."""
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class Base:
    """The class a folder rebuilds (`architecture`) and its config's `model_type` (torch.nn.Module for a module
    without a transformers config, whose architecture is its qualified class name)."""
    architecture: str
    model_type: str


@dataclass(frozen=True)
class Norm:
    """One norm a section turns into an RMSNorm (`norms.build_norm`): `p` for a pRMSNorm, else None."""
    type: str
    width: int
    eps: float
    affine: bool
    p: float | None = None

    def to_dict(self) -> dict:
        return {"type": self.type, "width": self.width, "eps": self.eps, "p": self.p, "affine": self.affine}


@dataclass(frozen=True)
class Fix:
    """A module's fixes: its output centred (`centre`), plus a bias of width `bias` (0: none), times a
    `matrix` x `matrix` matrix (a rotation's); its first input centred (`input`), times an `input_matrix` one; its
    first input rotated online (width `online`, an `online_factor` x `online_factor` factor: `add_online_rotation`)."""
    centre: bool
    bias: int = 0
    input: bool | None = None
    matrix: int | None = None
    input_matrix: int | None = None
    online: int | None = None
    online_factor: int | None = None

    def to_dict(self) -> dict:
        return {"centre": self.centre, "bias": self.bias, **_present({k: getattr(self, k) for k in FIX_KEYS})}


@dataclass(frozen=True)
class Checksum:
    """Hashes of the section without its checksum and of the weights files' headers (`folder.checksum`)."""
    section: str
    weights_header: str


@dataclass(frozen=True)
class Section:
    """A converted model's `normswap` section; see the module docstring for each field."""
    base: Base
    norms: dict[str, Norm] = dataclasses.field(default_factory=dict)
    added_biases: list[str] = dataclasses.field(default_factory=list)
    format: int = FORMAT
    output_fixes: dict[str, Fix] | None = None
    conversions: list[dict] | None = None
    rotations: list[dict] | None = None
    not_preserved: dict[str, str] | None = None
    renamed: dict[str, str] | None = None
    fingerprint: dict | None = None
    checksum: Checksum | None = None
    extra: dict = dataclasses.field(default_factory=dict)   # keys of a newer normswap's, kept as they are

    @classmethod
    def new(cls, base: Base, fingerprint: dict | None = None, output_fixes: dict[str, Fix] | None = None) -> Section:
        """A section as a conversion starts it, in its final format: nothing converted yet."""
        return cls(base=base, conversions=[], output_fixes=output_fixes, fingerprint=fingerprint)

    @classmethod
    def from_dict(cls, d, where: str = "section", model: nn.Module | None = None) -> Section:
        """The section a sealed dict holds, checked (`portable.validate`; with `model`, that every module it names
        exists); NormswapError (one line) otherwise."""
        validate(d, where, model)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        fixes = d.get("output_fixes")
        return cls(base=_made(Base, d["base"]), norms={k: _made(Norm, v) for k, v in d["norms"].items()},
                   added_biases=list(d["added_biases"]), format=d["format"],
                   output_fixes=None if fixes is None else {k: _made(Fix, v) for k, v in fixes.items()},
                   checksum=_made(Checksum, d["checksum"]),
                   **{k: d.get(k) for k in OPTIONAL[1:-1]},
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        """The dict a folder stores (JSON types; an absent optional key stays absent)."""
        fixes = None if self.output_fixes is None else {k: v.to_dict() for k, v in self.output_fixes.items()}
        checksum = None if self.checksum is None else dataclasses.asdict(self.checksum)
        return {"format": self.format, "base": dataclasses.asdict(self.base),
                "norms": {k: v.to_dict() for k, v in self.norms.items()}, "added_biases": list(self.added_biases),
                **_present({"output_fixes": fixes, **{k: getattr(self, k) for k in OPTIONAL[1:-1]},
                            "checksum": checksum}),
                **self.extra}


def new_section(model: nn.Module, fingerprint: dict) -> dict:
    """A converted model's section as `convert` starts it (`Section.new`): the class it was built as (for a
    transformers model, the one its folder rebuilds), no norm yet, the fingerprint's probe (`folder.fingerprint`;
    the digest is taken when it is saved)."""
    base = Base(original_class(model).__name__, model.config.model_type) if has_config(model) \
        else Base(qualified_name(type(model)), MODULE_TYPE)
    return Section.new(base, fingerprint).to_dict()


def write(model: nn.Module, folder: Path, section: dict, code: tuple[str, dict] | None = None,
          fingerprint: dict | None = None, state_dict: dict | None = None) -> dict:
    """Seal `section` beside `folder`'s weights (its fingerprint, then its checksum: `shipped.sealed`) and write
    it: into config.json with the modeling file (`shipped.finish_folder`, what the model's own save_pretrained
    runs) for a model with a transformers config (`section` is its config's), else as normswap.json. What is
    written must read back as a `Section`; returns the sealed dict."""
    with reraised(InvalidConversion):
        if has_config(model):
            sealed_section = finish_folder(model, folder, code, fingerprint, state_dict)
        else:
            sealed_section = sealed(section, model, folder, fingerprint)
    Section.from_dict(sealed_section, str(folder))
    if not has_config(model):
        (folder / RECORD).write_text(json.dumps(sealed_section, indent=2, sort_keys=True) + "\n")
    return sealed_section
