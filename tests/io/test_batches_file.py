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


@pytest.mark.parametrize("names", [("0.input_ids", "00.input_ids"), ("0", "00"), ("1.x", "01.x"), ("0.0", "0.00")])
def test_two_spellings_of_one_number_are_refused(tmp_path, names):
    """Issue 46 #5: `0.input_ids` and `00.input_ids` were merged into one batch, one of the user's batches
    silently dropped."""
    save_file({n: torch.full((1, 3), i) for i, n in enumerate(names)}, tmp_path / "in.safetensors")
    with pytest.raises(NormswapError, match="has a leading zero: write batches and positional arguments as 0, 1"):
        read_batches(tmp_path / "in.safetensors")


def test_a_name_of_digits_that_are_not_ascii_is_a_keyword_in_a_valid_file(tmp_path):
    """Issue 46 #5: `²` (a digit to str.isdigit, not to int) made a valid file "not a valid safetensors file"."""
    x = torch.ones(1, 3)
    save_file({"²": x}, tmp_path / "a.safetensors")
    save_file({"0.²": x, "1.input_ids": x.clone()}, tmp_path / "b.safetensors")
    assert _same(read_batches(tmp_path / "a.safetensors"), {"²": x})
    assert _same(read_batches(tmp_path / "b.safetensors"), [{"²": x}, {"input_ids": x}])
