"""One loader (issue 18.5): streaming and in-memory conversion read a folder the same way. Each awkward folder
below is converted by both paths of `convert_checkpoint` (and by `lazy_convert.convert_folder` alone): the outputs
must be the same bytes, file for file, or all three must refuse with the same message."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers as tf

import normswap
from normswap.pipeline import convert as pipeline
from normswap.pipeline import lazy_convert
from normswap.io.safetensors import INDEX, WEIGHTS
from normswap.errors import NormswapError
from normswap.models.source import auto_class
from normswap.parity import compare
from normswap.surgery import exact

from helpers.exact_models import build, perturb
from helpers.folders import same_files

CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def write_raw(file: Path, tensors: dict, share: dict | None = None, empty: tuple = (), gap_after: str = "") -> None:
    """A safetensors file laid out by hand: `share` gives a tensor another's byte range, `empty` gives a tensor
    no bytes, `gap_after` leaves 8 unused bytes after a tensor."""
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name, t in tensors.items():
        if name in (share or {}):
            continue
        raw = b"" if name in empty else t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw + (b"\0" * 8 if name == gap_after else b"")
    for name, other in (share or {}).items():
        header[name] = dict(header[other])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        config.pop(k, None) if v is None else config.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(config))


def gpt2(folder: Path, seed: int = 0, **save) -> dict:
    build("gpt2", seed).save_pretrained(folder, **save)
    return safetensors.torch.load_file(folder / WEIGHTS) if (folder / WEIGHTS).exists() else {}


def stale_index(folder: Path) -> None:
    """A sharded checkpoint, then model.safetensors with other values beside it: transformers loads the file."""
    gpt2(folder, max_shard_size="20kB")
    gpt2(folder.with_name("single"), seed=1)
    shutil.copy(folder.with_name("single") / WEIGHTS, folder / WEIGHTS)


def mixed_shards(folder: Path, config_dtype: str | None = None) -> None:
    """Shards in fp16 and fp32; config.json without a dtype (first floating tensor by name decides) or with one."""
    gpt2(folder, max_shard_size="20kB")
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    for shard in shards[1::2]:
        state = safetensors.torch.load_file(folder / shard)
        safetensors.torch.save_file({k: v.half() for k, v in state.items()}, folder / shard, metadata={"format": "pt"})
    edit_config(folder, dtype=config_dtype)


def explicit_weights(folder: Path) -> None:
    """config.json's transformers_weights names the file to load; model.safetensors beside it holds others."""
    gpt2(folder)
    state = gpt2(folder.with_name("other"), seed=1)
    safetensors.torch.save_file(state, folder / "chosen.safetensors", metadata={"format": "pt"})
    edit_config(folder, transformers_weights="chosen.safetensors")


def marian(folder: Path) -> None:
    """Its sinusoidal positions are not saved: transformers makes them (`_keys_to_ignore_on_load_missing`)."""
    torch.manual_seed(0)
    perturb(tf.MarianMTModel(tf.MarianConfig(
        vocab_size=101, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=0))).save_pretrained(folder)


def batchnorm(folder: Path) -> None:
    """LayerNorms and BatchNorms: the running statistics are persistent buffers, stored, not the init's."""
    torch.manual_seed(0)
    model = perturb(tf.MobileViTForImageClassification(tf.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
        num_attention_heads=2, num_labels=3)))
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    model.save_pretrained(folder)


def keep_fp32(folder: Path) -> None:
    """float16 RWKV: transformers keeps its `_keep_in_fp32_modules` (time_decay, time_first) in float32."""
    torch.manual_seed(0)
    perturb(tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2,
                                             attention_hidden_size=32, intermediate_size=64, context_length=64))
            ).half().save_pretrained(folder)


def stale_buffer(folder: Path) -> None:
    """A position_ids entry that the model keeps as a non-persistent buffer: transformers ignores it."""
    torch.manual_seed(0)
    perturb(tf.BertModel(tf.BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64))).save_pretrained(folder)
    state = safetensors.torch.load_file(folder / WEIGHTS)
    state["embeddings.position_ids"] = torch.arange(64)[None]
    safetensors.torch.save_file(state, folder / WEIGHTS, metadata={"format": "pt"})


def bad_header(**layout):
    """GPT-2 with its weights file laid out by `write_raw(**layout)`."""
    def make(folder: Path) -> None:
        state = gpt2(folder)
        write_raw(folder / WEIGHTS, state, **layout)
    return make


def truncated(folder: Path) -> None:
    gpt2(folder)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:-4])


def own_code(folder: Path) -> None:
    """auto_map with a model_type transformers knows: the folder means its own classes, not GPT-2's."""
    gpt2(folder)
    (folder / "modeling_x.py").write_text("raise RuntimeError('ran')\n")
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_x.XModel"})


def escaping_shard(folder: Path) -> None:
    gpt2(folder, max_shard_size="20kB")
    index = json.loads((folder / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    (folder / INDEX).write_text(json.dumps(index))


LN = "transformer.h.0.ln_1"
FOLDERS = {
    "stale-index": (stale_index, "converts"), "mixed-shards": (mixed_shards, "converts"),
    "mixed-shards-config-fp32": (lambda f: mixed_shards(f, "float32"), "converts"),
    "config-bf16-weights-fp32": (lambda f: (gpt2(f), edit_config(f, dtype="bfloat16")), "converts"),
    "explicit-weights": (explicit_weights, "converts"), "marian": (marian, "converts"),
    "batchnorm": (batchnorm, "converts"), "stale-buffer": (stale_buffer, "converts"),
    "keep-fp32": (keep_fp32, "converts"),
    "no-bytes": (bad_header(empty=(f"{LN}.bias",)), "is given 0 bytes"),
    "shared-bytes": (bad_header(share={f"{LN}.bias": f"{LN}.weight"}), "it overlaps another"),
    "gap": (bad_header(gap_after=f"{LN}.weight"), "(a gap)"),
    "truncated": (truncated, "is truncated"),
    "own-code": (own_code, "ships its own model code"),
    "escaping-shard": (escaping_shard, "is not a file inside the folder"),
}


def run(src: Path, out: Path, streaming: bool, monkeypatch):
    """`convert_checkpoint` (streaming when it can, or forced in memory): the result, or the refusal."""
    with monkeypatch.context() as m:
        if not streaming:
            m.setattr(pipeline, "lazily_convertible", lambda src: False)
        try:
            return pipeline.convert_checkpoint(str(src), out, normswap.ConvertOptions(method="auto"))
        except NormswapError as e:
            return str(e)


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_streaming_and_in_memory_read_a_folder_the_same_way(name, tmp_path, monkeypatch, capsys):
    make, expected = FOLDERS[name]
    src = tmp_path / "src"
    make(src)
    streamed = run(src, tmp_path / "streamed", True, monkeypatch)
    in_memory = run(src, tmp_path / "in-memory", False, monkeypatch)
    try:
        direct = lazy_convert.convert_folder(src, tmp_path / "direct")
    except NormswapError as e:
        direct = str(e)
    if expected != "converts":
        assert isinstance(streamed, str) and expected in streamed, streamed
        assert in_memory == streamed and direct == streamed
        assert not any((tmp_path / d).exists() for d in ("streamed", "in-memory", "direct"))
        return
    assert not isinstance(streamed, str) and not isinstance(in_memory, str), (streamed, in_memory)
    assert streamed.streamed and not in_memory.streamed, streamed.notices
    same_files(tmp_path / "streamed", tmp_path / "in-memory")   # the fingerprint's digest within its tolerance
    same_files(tmp_path / "direct", tmp_path / "in-memory")
    # What both read is what transformers loads with dtype="auto": the same tensors, in the same dtype ...
    ours = normswap.load(str(src))[0]
    theirs = auto_class(tf.AutoConfig.from_pretrained(src)).from_pretrained(src, dtype="auto")
    mine, want = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys()
    assert all(mine[k].dtype == want[k].dtype and torch.equal(mine[k], want[k]) for k in want)
    # ... and an exact conversion of it is that model.
    if streamed.report.method == "exact":
        tolerance = exact.TOLERANCE[next(theirs.parameters()).dtype]
        parity = compare(theirs.float(), normswap.load(tmp_path / "streamed")[0].float())
        assert parity.max_rel <= tolerance
