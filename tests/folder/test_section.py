"""The typed section (`normswap/folder/section.py`): the exact dict a folder stores, read and written back
unchanged; checked as the shipped code checks it; born in its final format; written by one function."""
import json

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.folder.portable import FORMAT
from normswap.folder.section import Base, Checksum, Fix, Norm, Section, new_section
from normswap.io import owned

from helpers.user_models import gpt

SEALED = {
    "format": 4, "base": {"architecture": "GPT2LMHeadModel", "model_type": "gpt2"},
    "norms": {"h.0.ln": {"type": "rmsnorm", "width": 8, "eps": 1e-5, "p": None, "affine": True},
              "h.1.ln": {"type": "prmsnorm", "width": 8, "eps": 1e-6, "p": 0.25, "affine": False}},
    "added_biases": ["h.0.fc"],
    "output_fixes": {"wte": {"centre": True, "bias": 0}, "h.0.out": {"centre": False, "bias": 8, "matrix": 8},
                     "h.1.mlp": {"centre": False, "bias": 0, "input": True, "input_matrix": 8},
                     "h.1.fc": {"centre": False, "bias": 0, "online": 24, "online_factor": 12}},
    "conversions": [{"to": "rmsnorm", "method": "exact", "p": None, "norms": 2}],
    "rotations": [{"method": "hadamard", "seed": 0, "widths": [8], "untied": False, "unrotated": []}],
    "not_preserved": {"hidden_states": "centred"}, "renamed": {"lm_head": "embed_out"},
    "fingerprint": {"probe": {"args": {"list": []}, "kwargs": {"dict": {}}}, "none": "no output"},
    "checksum": {"section": "sha256:00", "weights_header": "sha256:11"},
}


def test_a_sealed_section_reads_and_writes_back_the_same_dict():
    section = Section.from_dict(SEALED)
    assert section.base == Base("GPT2LMHeadModel", "gpt2")
    assert section.norms["h.1.ln"] == Norm("prmsnorm", 8, 1e-6, False, 0.25)
    assert section.output_fixes["h.1.mlp"] == Fix(centre=False, bias=0, input=True, input_matrix=8)
    assert section.output_fixes["h.1.fc"] == Fix(centre=False, bias=0, online=24, online_factor=12)
    assert section.checksum == Checksum("sha256:00", "sha256:11")
    assert section.to_dict() == SEALED
    assert json.dumps(section.to_dict(), sort_keys=True) == json.dumps(SEALED, sort_keys=True)


def test_absent_keys_stay_absent_and_unknown_ones_are_kept():
    d = {k: v for k, v in SEALED.items() if k not in ("output_fixes", "rotations", "renamed", "not_preserved")}
    d["later"] = {"a": 1}   # a newer normswap's key: not this format's to judge
    assert Section.from_dict(d).to_dict() == d


@pytest.mark.parametrize("change", [{"format": 1}, {"format": 5}, {"norms": {"x": {"type": "layernorm"}}},
                                    {"checksum": None}, {"output_fixes": {"x": {"centre": True, "bias": -1}}}])
def test_an_invalid_section_is_one_line_normswap_error(change):
    with pytest.raises(NormswapError) as e:
        Section.from_dict({**SEALED, **change}, "here")
    assert str(e.value).startswith("here") and "\n" not in str(e.value)


def test_a_section_is_born_in_its_final_format():
    model = gpt(0)
    born = new_section(model, {"probe": {}})
    assert born == {"format": FORMAT, "base": {"architecture": f"{type(model).__module__}.GPT",
                                               "model_type": "torch.nn.Module"},
                    "norms": {}, "added_biases": [], "conversions": [], "fingerprint": {"probe": {}}}


def test_the_written_record_reads_back_as_a_section(tmp_path):
    model = gpt(0)
    x = {"idx": torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0)),
         "prefix": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}
    normswap.convert(model, method="exact", example_inputs=[x])
    normswap.save_pretrained(model, tmp_path / "out")
    record = json.loads((tmp_path / "out" / owned.RECORD).read_text())
    section = Section.from_dict(record, model=model)
    assert section.format == FORMAT and section.norms and section.checksum is not None
    assert section.to_dict() == record
