"""Sharded safetensors checkpoints: written and read by normswap, and interchangeable with transformers."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers
from helpers.tiny import tiny_model

import normswap
from normswap.io import safetensors as shards
from normswap.errors import NormswapError

# A converted folder's weights: transformers' names for the "normswap" variant (`folder.checksum`).
NS_WEIGHTS, NS_INDEX = "model.normswap.safetensors", "model.safetensors.index.normswap.json"


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_parse_size():
    assert shards.parse_size("5GB") == 5 * 10**9
    assert shards.parse_size("200kB") == 200_000
    assert shards.parse_size("1GiB") == 2**30
    assert shards.parse_size(1234) == 1234
    for bad in ("five", "-1GB", "0", "3XB"):
        with pytest.raises(NormswapError, match="bad shard size"):
            shards.parse_size(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_round_trip_is_bit_exact(tmp_path, dtype):
    model = tiny_model("gpt2", dtype=dtype)
    normswap.convert(model, method="exact", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m", max_shard_size="20kB")
    index = json.loads((tmp_path / "m" / NS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model.normswap-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "m" / NS_WEIGHTS).exists()
    # Every shard is a valid safetensors file of at most the limit (unless one tensor alone is bigger).
    total = 0
    for f in files:
        part = safetensors.torch.load_file(tmp_path / "m" / f)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 20_000 or len(part) == 1
        assert all(index["weight_map"][k] == f for k in part)
        total += size
    assert index["metadata"]["total_size"] == total
    loaded = normswap.from_pretrained(tmp_path / "m")
    _state_equal(loaded, model)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # Sharded input, sharded output again: still the same bits.
    normswap.save_pretrained(loaded, tmp_path / "m2", max_shard_size="30kB")
    _state_equal(normswap.from_pretrained(tmp_path / "m2"), model)


def test_single_file_below_the_limit(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="exact", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m")  # default 50GB: one file, no index
    assert (tmp_path / "m" / NS_WEIGHTS).exists() and not (tmp_path / "m" / NS_INDEX).exists()
    ours = safetensors.torch.load_file(tmp_path / "m" / NS_WEIGHTS)
    ref = model.state_dict()
    assert all(torch.equal(ours[k], ref[k]) for k in ours)


def test_reads_transformers_sharded_checkpoints(tmp_path):
    model = tiny_model("opt")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20kB")
    assert (tmp_path / "hf" / shards.INDEX).exists()
    loaded, _ = normswap.load_model(str(tmp_path / "hf"))
    _state_equal(loaded, model)
    # A converted model saved sharded loads back bit-exact, saved by normswap or by its own save_pretrained
    # (transformers' save path: the converted model's class completes the folder).
    normswap.convert(model, method="exact", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "ns", max_shard_size="20kB")
    assert (tmp_path / "ns" / NS_INDEX).exists()
    _state_equal(normswap.from_pretrained(tmp_path / "ns"), model)
    model.save_pretrained(tmp_path / "hf2", max_shard_size="20kB")
    assert (tmp_path / "hf2" / NS_INDEX).exists()
    _state_equal(normswap.from_pretrained(tmp_path / "hf2"), model)


def test_transformers_reads_our_shards(tmp_path):
    model = tiny_model("gpt_neox")
    normswap.save_pretrained(model, tmp_path / "m", max_shard_size="20kB")
    back = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "m")
    _state_equal(back, model)


def test_broken_index_and_missing_shard_are_one_line_errors(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m", max_shard_size="20kB")
    first = sorted((tmp_path / "m").glob("model.normswap-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(NormswapError, match="is missing"):
        normswap.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / NS_INDEX).write_text("{}")
    with pytest.raises(NormswapError, match="not a safetensors index"):
        normswap.from_pretrained(tmp_path / "m")


def test_cli_max_shard_size(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "src", max_shard_size="20kB")
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "exact",
                                    "-o", str(tmp_path / "out"), "--max-shard-size", "30kB", "--json"])
    assert run.exit_code == 0, run.output
    assert len(set(json.loads((tmp_path / "out" / NS_INDEX).read_text())["weight_map"].values())) >= 2
    ref = tiny_model("gpt2")
    normswap.convert(ref, method="exact", to="rmsnorm")
    _state_equal(normswap.from_pretrained(tmp_path / "out"), ref)
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm",
                                    "-o", str(tmp_path / "bad"), "--max-shard-size", "lots"])
    assert run.exit_code == 1 and "bad shard size" in run.output and not (tmp_path / "bad").exists()


def test_mapped_reads_equal_copies_and_edits_never_reach_the_file(tmp_path):
    tensors = {"a": torch.randn(300, 70), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(5).half()}
    safetensors.torch.save_file(tensors, tmp_path / shards.WEIGHTS)
    before = (tmp_path / shards.WEIGHTS).read_bytes()
    mapped, copied = shards.Reader(tmp_path, mapped=True), shards.Reader(tmp_path)
    for k, t in tensors.items():
        m = mapped.get(k)
        assert m.dtype == t.dtype and torch.equal(m, t) and torch.equal(copied.get(k), t), k
        m.add_(1)   # copy-on-write: private to this tensor
        assert torch.equal(m, t + 1)
    assert (tmp_path / shards.WEIGHTS).read_bytes() == before
    assert torch.equal(mapped.get("a"), tensors["a"])
    with open(tmp_path / shards.WEIGHTS, "r+b") as f:   # cut inside tensor "c", the last one stored
        f.truncate(len(before) - 4)
    with pytest.raises(NormswapError, match="truncated"):
        shards.Reader(tmp_path, mapped=True).get(max(tensors, key=lambda k: shards.Reader(tmp_path).entries[k][4]))


def test_write_runs_the_producer_to_its_end(tmp_path):
    """Code after the last yield (where streaming frees what it read) must run; extras are refused."""
    done = []

    def produce(extra=False):
        yield torch.ones(3)
        done.append(True)
        if extra:
            yield torch.ones(3)

    specs = [("x", torch.float32, [3])]
    shards.write(tmp_path, specs, produce())
    assert done == [True]
    with pytest.raises(NormswapError, match="more tensors than planned"):
        shards.write(tmp_path, specs, produce(extra=True))


def test_too_little_disk_space_is_refused_before_writing(tmp_path, monkeypatch):
    import collections
    import shutil
    model = tiny_model("gpt2")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(NormswapError, match="not enough disk space.*nothing was written"):
        normswap.save_pretrained(model, tmp_path / "out", overwrite="any")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # no temp folder left behind
