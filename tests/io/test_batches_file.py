"""`--inputs FILE`: example inputs read from a safetensors file or a torch.save (weights_only) file."""
import pytest
import torch
from safetensors.torch import save_file

from normswap.errors import NormswapError
from normswap.io.batches import read_batches


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_safetensors_layouts(tmp_path):
    ids, mask = torch.randint(0, 9, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    cases = {
        "kw": ({"input_ids": ids, "attention_mask": mask}, {"input_ids": ids, "attention_mask": mask}),
        "pos": ({"1": mask, "0": ids}, (ids, mask)),
        "many": ({"0.input_ids": ids, "1.input_ids": ids[:1].clone(), "1.attention_mask": mask[:1].clone()},
                 [{"input_ids": ids}, {"input_ids": ids[:1], "attention_mask": mask[:1]}]),
        "many_pos": ({"0.0": ids, "1.0": mask}, [(ids,), (mask,)]),
    }
    for name, (stored, expected) in cases.items():
        save_file(stored, tmp_path / f"{name}.safetensors")
        assert _same(read_batches(tmp_path / f"{name}.safetensors"), expected), name


def test_torch_save_any_batches(tmp_path):
    x = torch.randn(2, 3)
    for i, value in enumerate([x, (x, x[:1]), {"x": x}, [x, {"x": x}, (x,)]]):
        torch.save(value, tmp_path / f"{i}.pt")
        assert _same(read_batches(tmp_path / f"{i}.pt"), value)


class Evil:
    def __reduce__(self):
        return (print, ("ran",))


@pytest.mark.parametrize("make, match", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "is not a file"),
    (lambda p: p.write_text("hello world, not tensors"), "neither a safetensors file nor a torch.save"),
    (lambda p: torch.save(Evil(), p), "neither a safetensors file nor a torch.save"),   # weights_only
    (lambda p: save_file({"0.x": torch.ones(1), "y": torch.ones(1)}, p), "either every name is <batch>.<name>"),
    (lambda p: save_file({"0": torch.ones(1), "2": torch.ones(1)}, p), r"positional arguments \[0, 2\]"),
    (lambda p: save_file({"0": torch.ones(1), "x": torch.ones(1)}, p), "mix positional"),
])
def test_bad_files_are_one_line_errors(tmp_path, capsys, make, match):
    path = tmp_path / "inputs.bin"
    make(path)
    with pytest.raises(NormswapError, match=match) as e:
        read_batches(path)
    assert "\n" not in str(e.value) and "ran" not in capsys.readouterr().out
