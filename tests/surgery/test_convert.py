"""`normswap.convert` (method naive): what is replaced, what is kept, what the report says."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap import PartialRMSNorm, RMSNorm
from normswap.errors import FellBackToNaive, NormswapError
from normswap.models.inputs import sample_inputs
from normswap.parity import compare
from normswap.surgery.walk import Skip

from helpers.restore_models import Encoder, built
from helpers.tiny import count_layernorms, tiny_model
from helpers.user_models import gpt


def layernorms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def test_replaces_every_layernorm_and_copies_gain_and_eps(family):
    model = tiny_model(family)
    before = {n: (m.weight.detach().clone(), m.eps, m.bias.detach().norm().item())
              for n, m in layernorms(model).items()}
    assert len(before) >= 3
    report = normswap.convert(model, method="naive", to="rmsnorm")
    assert count_layernorms(model) == 0
    assert report.num_converted == len(before)
    assert {r.name for r in report.converted} == set(before)
    for rec in report.converted:
        new = model.get_submodule(rec.name)
        weight, eps, bias_norm = before[rec.name]
        assert type(new) is RMSNorm
        assert torch.equal(new.weight, weight) and new.eps == eps == rec.eps
        assert rec.bias == "dropped" and rec.bias_norm == pytest.approx(bias_norm, rel=1e-6)
        assert rec.method == "naive" and rec.width == weight.numel()


def test_naive_swap_changes_outputs_measurably(family):
    model = tiny_model(family)
    original = copy.deepcopy(model)
    normswap.convert(model, method="naive", to="rmsnorm")
    assert compare(original, model).max_rel > 0.05


def test_converted_forward_equals_rmsnorm_math():
    # End to end: the converted GPT-2 equals the original with each LayerNorm's forward replaced by
    # x / sqrt(mean(x^2) + eps) * g (computed independently, in float64).
    model = tiny_model("gpt2")
    manual = copy.deepcopy(model)
    for m in layernorms(manual).values():
        def fwd(x, m=m):
            x64 = x.double()
            return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + m.eps) * m.weight.double()).float()
        m.forward = fwd
    normswap.convert(model, method="naive", to="rmsnorm")
    p = compare(manual, model)
    assert p.max_rel < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keeps_dtype(dtype):
    model = tiny_model("gpt2", dtype=dtype)
    normswap.convert(model, method="naive", to="rmsnorm")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.weight.dtype == dtype and m.weight.device.type == "cpu" for m in norms)
    batch = sample_inputs(model)[0]
    assert model(**batch).logits.dtype == dtype


def test_second_convert_is_noop():
    model = tiny_model("opt")
    normswap.convert(model, method="naive", to="rmsnorm")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config_section = copy.deepcopy(model.config.normswap)
    again = normswap.convert(model, method="naive", to="rmsnorm")
    assert again.num_converted == 0 and len(again.already_rms) == 5
    assert model.config.normswap == config_section
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_existing_rmsnorm_left_alone():
    model = tiny_model("llama")
    report = normswap.convert(model, method="naive", to="rmsnorm")
    assert report.num_converted == 0
    assert len(report.already_rms) == 2 * 2 + 1
    assert all(type(model.get_submodule(n)).__name__ == "LlamaRMSNorm" for n in report.already_rms)


def test_prmsnorm_conversion():
    model = tiny_model("gpt_neox")
    report = normswap.convert(model, method="naive", to="prmsnorm", p=0.25)
    norms = [m for m in model.modules() if isinstance(m, PartialRMSNorm)]
    assert len(norms) == report.num_converted == 5 and all(m.p == 0.25 for m in norms)
    assert report.p == 0.25 and model.config.normswap["norms"][report.converted[0].name]["p"] == 0.25


def test_prmsnorm_default_p():
    model = tiny_model("gpt2")
    assert normswap.convert(model, method="naive", to="prmsnorm").p == 0.0625


def test_filter_fn_limits_conversion():
    model = tiny_model("gpt2")
    report = normswap.convert(model, method="naive", to="rmsnorm", filter_fn=lambda m, name: name.endswith("ln_1"))
    assert [r.name for r in report.converted] == ["transformer.h.0.ln_1", "transformer.h.1.ln_1"]
    assert {s.name for s in report.skipped} == {"transformer.h.0.ln_2", "transformer.h.1.ln_2", "transformer.ln_f"}
    assert all(s.cause is Skip.FILTERED for s in report.skipped)
    assert count_layernorms(model) == 3


def test_multidim_layernorm_is_skipped_with_reason():
    model = nn.Sequential(nn.Linear(4, 12), nn.Unflatten(1, (3, 4)), nn.LayerNorm((3, 4)), nn.LayerNorm(4))
    report = normswap.convert(model, method="naive", to="rmsnorm")
    assert [r.name for r in report.converted] == ["3"]
    first = report.skipped[0]
    assert first.name == "2" and first.cause is Skip.SHAPE and "(3, 4)" in first.reason
    assert isinstance(model[2], nn.LayerNorm)


def test_layernorm_without_affine_becomes_rmsnorm_without_weight():
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False))
    report = normswap.convert(model, method="naive", to="rmsnorm")
    assert report.converted[0].bias == "none"
    assert isinstance(model[0], RMSNorm) and model[0].weight is None


def test_subclass_of_layernorm_is_converted():
    class MyLN(nn.LayerNorm):
        pass
    model = nn.Sequential(MyLN(8))
    report = normswap.convert(model, method="naive", to="rmsnorm")
    assert report.converted[0].replaced == "MyLN" and isinstance(model[0], RMSNorm)


def test_report_table_and_json():
    model = tiny_model("gpt2")
    report = normswap.convert(model, method="naive", to="rmsnorm")
    table = report.to_table()
    assert "transformer.h.1.ln_2" in table and "converted 5 LayerNorm -> rmsnorm" in table
    assert "biases dropped: 5" in table
    data = json.loads(report.to_json())
    assert data["to"] == "rmsnorm" and len(data["converted"]) == 5
    row = data["converted"][0]
    assert set(row) >= {"name", "width", "eps", "bias", "bias_norm", "method"}
    assert row["width"] == 32


@pytest.mark.parametrize("kwargs,message", [
    (dict(to="layernorm"), "unknown target"),
    (dict(to="prmsnorm", p=0.0), "p must be in (0, 1]"),
    (dict(to="rmsnorm", p=0.5), "p applies only"),
    (dict(to="rmsnorm", method="magic"), "unknown method 'magic'"),
])
def test_bad_arguments(kwargs, message):
    model = tiny_model("gpt2")
    with pytest.raises(NormswapError, match=message.replace("(", r"\(").replace("]", r"\]")):
        normswap.convert(model, **kwargs)
    assert count_layernorms(model) == 5


def test_default_method_is_auto():
    exact = tiny_model("gpt2")
    original = copy.deepcopy(exact)
    assert normswap.convert(exact).method == "exact"
    assert compare(original, exact).max_rel < 1e-5
    bert = tiny_model("bert")
    with pytest.warns(FellBackToNaive):
        report = normswap.convert(bert)
    assert report.method == "naive" and {r.bias for r in report.converted} == {"dropped"}
    assert any("post-LN" in w or "naive" in w for w in report.warnings)


def _fell_back(model, **kw):
    """The FellBackToNaive warnings `normswap.convert(model, **kw)` raised (every warning recorded), its report."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = normswap.convert(model, **kw)
    return [w for w in seen if issubclass(w.category, FellBackToNaive)], report


@pytest.mark.parametrize("case", ["no_examples", "bad_batch", "post_ln"])
def test_auto_falling_back_to_naive_warns_where_the_caller_sees_it(case):
    """Issue 46 #5: the reason was only in report.warnings; now a Python warning of its own class, from the
    caller's line, says the same."""
    model, examples = {"no_examples": (gpt(), None), "post_ln": (tiny_model("bert"), None),
                       "bad_batch": (gpt(), [torch.randint(0, 61, (2, 8)), torch.randint(0, 61, (2, 99))])}[case]
    seen, report = _fell_back(model, example_inputs=examples)
    assert report.method == "naive" and len(seen) == 1
    assert str(seen[0].message) == report.warnings[-1] and "fell back to naive" in report.warnings[-1]
    assert seen[0].filename == __file__   # attributed to the caller's line, not to normswap's


def test_an_exact_conversion_and_method_naive_raise_no_fallback_warning():
    for method, model in (("auto", tiny_model("gpt2")), ("naive", tiny_model("bert"))):
        assert _fell_back(model, method=method)[0] == []


def _wrapped(kind: str, model: nn.Module) -> nn.Module:
    if kind == "dataparallel":
        return nn.DataParallel(model)   # without GPUs it runs its module
    return torch.compile(model, backend="eager")   # dynamo's guards and recompiles, without a compiler


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", ["dataparallel", "compiled", "compiled_dataparallel"])
def test_a_wrapped_model_is_converted_inside_its_wrapper_which_then_runs_it(kind):
    """Issue 46 #5: DataParallel (rel 0.16) and torch.compile (0.41) fell back to naive in silence. Now auto is
    exact inside the wrapper; and the wrapper runs the converted module (a naive swap, which changes the outputs,
    shows it: a compiled graph of the original would give the original's)."""
    x = torch.randint(0, 97, (2, 9))
    for method in ("auto", "naive"):
        inner = tiny_model("gpt2")
        original = copy.deepcopy(inner)
        wrapper = _wrapped("compiled", nn.DataParallel(inner)) if kind == "compiled_dataparallel" else \
            _wrapped(kind, inner)
        with torch.no_grad():
            wrapper(input_ids=x)   # compiled before the conversion: it must compile again after
            seen, report = _fell_back(wrapper, method=method)
            got, own, want = (m(input_ids=x).logits for m in (wrapper, inner, original))
        assert seen == [] and report.method == ("exact" if method == "auto" else "naive")
        assert count_layernorms(inner) == 0 and _rel(got, own) < 1e-6
        assert _rel(got, want) < 1e-5 if method == "auto" else _rel(got, want) > 0.05


def test_a_distributed_data_parallel_model_is_refused_saying_to_convert_first(tmp_path):
    """DDP registered its parameters when it was built: the conversion's new ones would not be synchronised."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model("gpt2")
        with pytest.raises(NormswapError, match="convert the model first, then wrap it"):
            normswap.convert(nn.parallel.DistributedDataParallel(model))
        assert count_layernorms(model) == 5
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["exact", "naive"])
def test_a_frozen_model_stays_frozen(method):
    """Issue 46 #5: the new norm gains and added biases came back trainable."""
    model = tiny_model("gpt2").requires_grad_(False)
    report = normswap.convert(model, method=method)
    assert report.method == method and report.num_converted == 5
    assert method == "naive" or report.added_biases   # the exact one adds a bias too
    assert [n for n, p in model.named_parameters() if p.requires_grad] == []


def test_new_parameters_follow_what_they_replace_or_are_added_to():
    """A frozen block's new norm gains stay frozen, a trainable one's train; an added bias follows its layer,
    an output fix's bias (a returned final norm keeps its bias after it) its norm's."""
    model = tiny_model("gpt2")
    model.transformer.h[0].requires_grad_(False)
    normswap.convert(model, method="exact")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.weight"}.isdisjoint(trainable)
    assert {"transformer.h.1.ln_1.weight", "transformer.h.1.ln_2.weight", "lm_head.bias"} <= trainable
    encoder = built(Encoder)
    encoder.norm.requires_grad_(False)
    normswap.convert(encoder, method="exact", example_inputs=torch.randn(2, 5, 12))
    assert encoder.norm.normswap_bias.requires_grad is False and encoder.proj.bias.requires_grad
