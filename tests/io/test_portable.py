"""Issue 33 (20): what every load of a converted folder prints (its `not_preserved` entries) is plain text: a
section whose names or reasons hold newlines or terminal escapes is invalid."""
from __future__ import annotations

import json

import pytest

import normswap
from normswap.io import portable

from helpers.export_models import converted as naive_conversion


@pytest.mark.parametrize("entry", [{"logits\x1b[2J": "why"}, {"logits": "why\nwarning: fake"}])
def test_not_preserved_entries_must_be_printable(tmp_path, entry):
    normswap.save_pretrained(naive_conversion("gpt2"), tmp_path / "m")
    section = json.loads((tmp_path / "m" / "config.json").read_text())["normswap"]
    portable.validate(section, "m")
    with pytest.raises(portable.InvalidConversion, match="not_preserved must map output names to reasons"):
        portable.validate({**section, "not_preserved": entry}, "m")
