"""A converted or exported folder keeps every file of its source that the model's loaders read (issue 33.2, 33.5):
sentence-transformers' modules, pooling and normalisation, the slow tokenizer's vocab.txt, the model card; and
takes no file linked from outside the source (33.19)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import safetensors.torch
import torch

from normswap.errors import NormswapError
from normswap.export.folder import export_folder
from normswap.io import kept
from normswap.models.load import LoadOptions, load_model
from normswap.pipeline import ConvertOptions, convert_checkpoint

from helpers.cli import one_error_line, run, snapshot
from helpers.tiny import tiny_model

STREAMED = ConvertOptions(method="naive", device="cpu")
IN_MEMORY = dataclasses.replace(STREAMED, load=LoadOptions(allow_missing_weights=True))
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "the", "cat", "sat"]
# What a sentence-transformers folder holds beside the model (MiniLM's layout), and what it must not pass on.
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
           {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]
KEPT = {"modules.json": json.dumps(MODULES), "sentence_bert_config.json": '{"max_seq_length": 256}',
        "config_sentence_transformers.json": '{"similarity_fn_name": "cosine"}', "README.md": "# a model card\n",
        "vocab.txt": "\n".join(WORDS) + "\n", "1_Pooling/config.json": '{"pooling_mode_mean_tokens": true}',
        "2_Dense/config.json": '{"in_features": 32, "out_features": 8}'}
NOT_KEPT = {"pytorch_model.bin": "the original's weights", "onnx/model.onnx": "the original, exported",
            ".gitattributes": "*.bin filter=lfs", "tf_model.h5": "the original, for TensorFlow"}


@pytest.fixture
def st_src(tmp_path):
    """A tiny BERT laid out as a sentence-transformers folder, with files a conversion must not pass on."""
    src = tmp_path / "src"
    tiny_model("bert").save_pretrained(src)
    for name, text in {**KEPT, **NOT_KEPT}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    safetensors.torch.save_file({"linear.weight": torch.ones(8, 32)}, src / "2_Dense" / "model.safetensors")
    (src / "3_Normalize").mkdir()
    return src


@pytest.mark.parametrize("options", [STREAMED, IN_MEMORY], ids=["streamed", "in-memory"])
def test_a_converted_folder_keeps_the_sources_files(st_src, tmp_path, options):
    """The source's files against the output's: each kept one byte for byte (Dense's weights in its folder
    too), Normalize's empty folder made, the original's other forms left out. Before: modules.json, pooling,
    Normalize, sentence_bert_config.json and vocab.txt were gone."""
    convert_checkpoint(str(st_src), tmp_path / "out", options)
    src, out = snapshot(st_src), snapshot(tmp_path / "out")
    kept_files = {*KEPT, "2_Dense/model.safetensors"}
    assert {name: out.get(name) for name in kept_files} == {name: src[name] for name in kept_files}
    assert not set(out) & set(NOT_KEPT)
    assert (tmp_path / "out" / "3_Normalize").is_dir()
    # what else OUT holds, normswap wrote: config, weights, its modeling file, the tokenizer it saved
    assert set(out) - kept_files <= {"config.json", "model.normswap.safetensors", "modeling_normswap.py",
                                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    listed = json.loads((tmp_path / "out" / "config.json").read_text())[kept.KEY]
    assert set(listed) == kept_files | {"1_Pooling", "2_Dense", "3_Normalize"}


def test_overwrite_replaces_kept_files_but_never_a_users(st_src, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(str(st_src), out, STREAMED)
    convert_checkpoint(str(st_src), out, dataclasses.replace(STREAMED, overwrite=True))   # all normswap's
    (out / "notes.txt").write_text("mine")
    with pytest.raises(NormswapError, match=r"holds files normswap does not write \(notes.txt\)"):
        convert_checkpoint(str(st_src), out, dataclasses.replace(STREAMED, overwrite=True))


def test_an_export_folder_keeps_them_too(st_src, tmp_path):
    pytest.importorskip("onnxruntime")
    model, _ = load_model(str(st_src))
    export_folder(model, tmp_path / "exp", source=st_src, validate=False)
    src, out = snapshot(st_src), snapshot(tmp_path / "exp")
    assert all(out.get(name) == src[name] for name in [*KEPT, "2_Dense/model.safetensors"])
    assert (tmp_path / "exp" / "3_Normalize").is_dir() and not set(out) & set(NOT_KEPT)


@pytest.mark.parametrize("name", ["chat_template.jinja", "vocab.txt", "1_Pooling"])
def test_a_file_linked_from_outside_src_is_refused(st_src, tmp_path, name):
    """A tokenizer file, or a module folder, that links outside SRC: one error line, nothing written (before,
    its content was copied into OUT as the model's)."""
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (st_src / name).rename(outside) if (st_src / name).exists() else outside.write_text("{{ secret }}")
    (st_src / name).symlink_to(outside)
    line = one_error_line(run("convert", st_src, "--to", "rmsnorm", "--method", "naive", "-o", tmp_path / "out"))
    assert f"src/{name}" in line and f"is a link to {outside}" in line and "refusing to copy" in line
    assert not (tmp_path / "out").exists()


def test_links_inside_src_and_into_a_hub_snapshots_blobs_are_kept(tmp_path):
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_text("vocab")
    (snap / "vocab.txt").symlink_to(os.path.relpath(blobs / "f00d", snap))
    (snap / "README.md").write_text("card")
    (snap / "card.md").symlink_to("README.md")
    dest = tmp_path / "dest"
    dest.mkdir()
    assert kept.copy_kept(snap, dest) == ["README.md", "card.md", "vocab.txt"]
    assert (dest / "vocab.txt").read_text() == "vocab" and not (dest / "vocab.txt").is_symlink()
