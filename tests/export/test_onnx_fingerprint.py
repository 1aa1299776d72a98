"""The fingerprint an export writes into the ONNX file's metadata (`normswap.fingerprint`): the conversion's probe
by the graph's input names, the digest of PyTorch's outputs by its output names, the folder's recorded digest
where the probe is the folder's; checked in onnxruntime by the export and by `validate.check_fingerprint`."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
from helpers.export_models import talkative  # noqa: E402
from helpers.tiny import tiny_model  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import normswap  # noqa: E402
from normswap.cli import main  # noqa: E402
from normswap.export import onnx_fingerprint, validate  # noqa: E402
from normswap.folder import fingerprint  # noqa: E402
from normswap.folder import schema  # noqa: E402
from normswap.folder.schema import FingerprintFailed  # noqa: E402
from normswap.pipeline.options import ExportOptions  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A converted tiny GPT-2 saved, then exported by `normswap export SRC --onnx`: (root, the JSON report)."""
    root = tmp_path_factory.mktemp("fingerprint")
    normswap.save_pretrained(talkative("gpt2"), root / "src")
    result = CliRunner().invoke(main, ["export", str(root / "src"), "--onnx", str(root / "fp32.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    return root, json.loads(result.output)


def stamp_of(path) -> dict:
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return json.loads(props[onnx_fingerprint.META])


def section_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["normswap"]


def replanted(src, dst, edit) -> None:
    """`src` written to `dst` with its fingerprint metadata edited by `edit(found)`."""
    model = onnx.load(str(src))
    found = stamp_of(src)
    edit(found)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        onnx_fingerprint.META: json.dumps(found)})
    onnx.save(model, str(dst))


def drifted(digests: dict, by: float) -> dict:
    """Each output's digest as if the output were `1 + by` times what it is."""
    return {k: {**d, "norm": d["norm"] * (1 + by), "values": [v * (1 + by) for v in d["values"]],
                "proj": [p * (1 + by) for p in d["proj"]]} for k, d in digests.items()}


def test_the_metadata_holds_the_graphs_fingerprint_on_the_conversions_probe(folder):
    root, report = folder
    found, recorded = stamp_of(root / "fp32.onnx"), section_of(root / "src")["fingerprint"]
    sess = validate.session(root / "fp32.onnx")
    probe = fingerprint.decode(found["probe"], "cpu", torch.float32)
    assert list(probe) == [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "position_ids"]
    # the conversion's probe by the graph's names; what the graph takes besides, filled as the validation fills it
    assert found["probe"]["dict"]["input_ids"] == recorded["probe"]["kwargs"]["dict"]["input_ids"]
    ids = probe["input_ids"]
    assert torch.equal(probe["attention_mask"], torch.ones_like(ids))
    assert torch.equal(probe["position_ids"], torch.arange(ids.shape[1])[None])
    assert found["probe_from"] == "model" and found["dtype"] == "float32" and list(found["outputs"]) == ["logits"]
    # the folder's own recorded digest, kept to check the file against the model that was saved
    assert found["saved"] == {"dtype": recorded["dtype"], "outputs": {"logits": recorded["outputs"]["logits"]}}
    assert report["fingerprint"] == {"probe_from": "model", "outputs": ["logits"], "dtype": "float32",
                                     "tolerance": 1e-3, "saved": ["logits"], "checked": True}
    assert validate.check_fingerprint(root / "fp32.onnx") is True


def test_an_initializer_edited_after_export_is_refused(folder, tmp_path):
    root, _ = folder
    model = onnx.load(str(root / "fp32.onnx"))
    weight = max((t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
                 key=lambda t: np.prod(t.dims))
    values = numpy_helper.to_array(weight)
    weight.CopyFrom(numpy_helper.from_array(values.reshape(-1)[::-1].reshape(values.shape).copy(), weight.name))
    onnx.save(model, str(tmp_path / "edited.onnx"))
    with pytest.raises(FingerprintFailed, match="does not reproduce its fingerprint") as e:
        validate.check_fingerprint(tmp_path / "edited.onnx")
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def fp16(folder):
    root, _ = folder
    report = normswap.export_checkpoint(str(root / "src"), None, ExportOptions(onnx=str(root / "fp16.onnx"),
                                                                               dtype="fp16"))
    return root / "fp16.onnx", report


def test_fp16_graphs_are_held_to_the_half_precision_tolerance(folder, fp16, tmp_path):
    root, _ = folder
    path, report = fp16
    assert stamp_of(path)["dtype"] == "float16" and report.fingerprint["tolerance"] == 5e-2
    assert report.fingerprint["saved"] == ["logits"] and report.fingerprint["checked"]
    for name, src in (("fp32", root / "fp32.onnx"), ("fp16", path)):   # outputs 1% off what PyTorch gave
        replanted(src, tmp_path / f"{name}.onnx", lambda f: f.update(outputs=drifted(f["outputs"], 1e-2)))
    with pytest.raises(FingerprintFailed, match="tolerance 0.001"):
        validate.check_fingerprint(tmp_path / "fp32.onnx")
    assert validate.check_fingerprint(tmp_path / "fp16.onnx") is True   # within 5e-2 of each output's RMS
    replanted(path, tmp_path / "far.onnx", lambda f: f.update(outputs=drifted(f["outputs"], 0.2)))
    with pytest.raises(FingerprintFailed, match="tolerance 0.05"):
        validate.check_fingerprint(tmp_path / "far.onnx")


def swapped_weights(src, dst) -> None:
    """`src` copied to `dst` with the values of its largest tensor reversed in place: the weights' header, and so
    the folder's checksum, unchanged (as when another model's weights of the same layout are copied over)."""
    shutil.copytree(src, dst)
    path = dst / "model.normswap.safetensors"
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = {k: v for k, v in json.loads(raw[8:8 + size]).items() if k != "__metadata__"}
    start, end = (8 + size + o for o in max(header.values(), key=lambda t: np.prod(t["shape"]))["data_offsets"])
    raw[start:end] = np.frombuffer(bytes(raw[start:end]), np.float32)[::-1].tobytes()
    path.write_bytes(bytes(raw))


def test_the_folders_recorded_digest_is_checked_not_only_the_model_loaded(folder, tmp_path, monkeypatch):
    """A loader that built another model from the folder (here: its own check bypassed) exports a graph equal to
    that model: the export is refused on the digest the folder recorded, and nothing is written."""
    root, _ = folder
    swapped_weights(root / "src", tmp_path / "src")
    with pytest.raises(FingerprintFailed):   # normswap's loader refuses it by itself
        normswap.load_model(str(tmp_path / "src"))
    monkeypatch.setattr(schema, "verify_fingerprint", lambda *a, **k: None)
    with pytest.raises(FingerprintFailed, match="the model exported is not the model that was saved") as e:
        normswap.export_checkpoint(str(tmp_path / "src"), None, ExportOptions(onnx=str(tmp_path / "m.onnx")))
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_skipping_the_load_check_skips_the_folders_digest_and_says_so(folder, tmp_path, monkeypatch):
    root, _ = folder
    swapped_weights(root / "src", tmp_path / "src")
    monkeypatch.setenv(fingerprint.SKIP_ENV, "1")
    report = normswap.export_checkpoint(str(tmp_path / "src"), None, ExportOptions(onnx=str(tmp_path / "m.onnx")))
    why = f"not checked when SRC was loaded ({fingerprint.SKIP_ENV}=1)"
    assert stamp_of(tmp_path / "m.onnx")["saved"] == {"none": why} == report.fingerprint["saved"]
    assert validate.check_fingerprint(tmp_path / "m.onnx") is True   # the graph of the model it was exported from


def test_an_export_whose_graph_does_not_reproduce_its_fingerprint_is_refused(tmp_path, monkeypatch):
    real = onnx_fingerprint.reference_digest
    monkeypatch.setattr(onnx_fingerprint, "reference_digest", lambda *a: drifted(real(*a), 1e-2))
    with pytest.raises(FingerprintFailed, match="the exported graph does not reproduce its fingerprint") as e:
        normswap.export_onnx(tiny_model("gpt2"), tmp_path / "m.onnx")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_an_unconverted_model_gets_a_fingerprint_of_its_own_export(tmp_path):
    """No probe recorded: one drawn as the validation draws its inputs; written even unvalidated, checkable later."""
    report = normswap.export_onnx(tiny_model("gpt2"), tmp_path / "m.onnx", validate=False)
    found = stamp_of(tmp_path / "m.onnx")
    assert found["probe_from"] == "export" and "saved" not in found and list(found["outputs"]) == ["logits"]
    assert found["probe"]["dict"]["input_ids"]["shape"] == [1, 16] and "checked" not in report.fingerprint
    assert normswap.export.check_fingerprint(tmp_path / "m.onnx") is True


def test_a_file_without_a_fingerprint_is_not_checked_and_says_why(folder, tmp_path):
    root, _ = folder
    model = onnx.load(str(root / "fp32.onnx"))
    onnx.helper.set_model_props(model, {p.key: p.value for p in model.metadata_props
                                        if p.key != onnx_fingerprint.META})
    onnx.save(model, str(tmp_path / "old.onnx"))
    with pytest.warns(UserWarning, match="no fingerprint to check"):
        assert validate.check_fingerprint(tmp_path / "old.onnx") is False
