"""Comparing two converted folders that two paths wrote (streamed and in memory): byte for byte, but for the
fingerprint's digest, a measurement two computations of the same model may round apart (~1e-9), which must agree
within the fingerprint's own tolerance, and the section's checksum, which hashes that digest."""
from __future__ import annotations

import json
from pathlib import Path

from normswap.folder import fingerprint


def split_config(folder: Path) -> tuple[dict, dict]:
    """(config.json without the fingerprint and the section's checksum, the fingerprint)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    section = config["normswap"]
    found = section.pop("fingerprint")
    section.pop("checksum")
    return config, found


def same_fingerprint(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k != "outputs"} == {k: v for k, v in b.items() if k != "outputs"}
    if "outputs" in a:
        assert a["outputs"].keys() == b["outputs"].keys()
        assert fingerprint.differs(a["outputs"], b["outputs"], fingerprint.tolerance(a["dtype"])) is None


def same_files(a: Path, b: Path) -> None:
    """Every file of the two folders byte-equal, config.json but for the fingerprint's digest (see above)."""
    fa = {p.name: p.read_bytes() for p in sorted(Path(a).iterdir()) if p.name != "config.json"}
    fb = {p.name: p.read_bytes() for p in sorted(Path(b).iterdir()) if p.name != "config.json"}
    assert fa == fb
    (ca, pa), (cb, pb) = split_config(a), split_config(b)
    assert ca == cb
    same_fingerprint(pa, pb)
