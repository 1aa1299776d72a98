"""Any nn.Module converts exactly with the user's `example_inputs`, judged on other inputs than those."""
import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.surgery.labels import Cause, NotExact
from helpers.user_models import gpt


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_without_examples_exact_says_to_pass_them_and_auto_falls_back():
    with pytest.raises(NormswapError, match=r"cannot build sample inputs for GPT .*pass example_inputs") as e:
        normswap.convert(gpt(), method="exact")
    assert "\n" not in str(e.value) and "AttributeError" not in str(e.value)
    m = gpt()
    report = normswap.convert(m, method="auto")
    assert report.method == "naive" and "pass example_inputs" in report.warnings[-1]


def test_examples_make_a_hand_written_gpt_exact_on_other_shapes():
    m = gpt()
    others = [torch.randint(0, 61, (3, 40)), torch.randint(0, 61, (1, 64)), torch.randint(0, 61, (5, 2))]
    with torch.no_grad():
        refs = [m(x) for x in others]
    report = normswap.convert(m, method="exact", example_inputs=[torch.randint(0, 61, (2, 16)),
                                                                 {"idx": torch.randint(0, 61, (1, 5)),
                                                                  "prefix": torch.randn(1, 8)}])
    assert report.method == "exact" and report.num_converted == 5
    assert report.verification["max_rel"] < 1e-5
    assert not any(isinstance(mod, torch.nn.LayerNorm) for mod in m.modules())
    with torch.no_grad():
        assert max(rel(m(x), r) for x, r in zip(others, refs)) < 1e-5
    section = m.normswap_section   # the record of what changed, on the module (it has no config)
    assert set(section["norms"]) == {r.name for r in report.converted}


def test_examples_drive_the_trace_a_path_they_never_take_is_refused_by_name():
    """`prefix` writes the stream only when passed: examples without it cannot show it centred."""
    with pytest.raises(NotExact, match=r"prefix \(Linear\) did not run") as e:   # named
        normswap.convert(gpt(), method="exact", example_inputs=torch.randint(0, 61, (2, 16)))
    assert e.value.cause is Cause.UNRUN
    m = gpt()
    x, pre = torch.randint(0, 61, (3, 11)), torch.randn(3, 8)
    with torch.no_grad():
        ref = m(x, pre)
    normswap.convert(m, method="exact", example_inputs=(torch.randint(0, 61, (2, 7)), torch.randn(2, 8)))
    with torch.no_grad():
        assert rel(m(x, pre), ref) < 1e-5


def test_bad_examples_fail_before_any_edit_whatever_the_method():
    m = gpt()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for method in ("auto", "exact"):
        with pytest.raises(NormswapError, match="does not fit GPT.forward"):
            normswap.convert(m, method=method, example_inputs={"ids": torch.ones(1, 3, dtype=torch.long)})
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
