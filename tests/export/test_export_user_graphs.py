"""export_onnx of user modules whose graphs the exporter or the fusions handle unlike ours (issue 48, items 9-12):
an input returned unchanged, a user's own RMSNorm class, norms in nested blocks, a dynamic dimension that does not
hold in onnxruntime. Each model is built here, small; each export is checked against PyTorch in onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

import normswap  # noqa: E402
from normswap.export import fuse  # noqa: E402

D = 16


def run(path, feed: dict) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)


def rel(got: np.ndarray, ref: torch.Tensor) -> float:
    ref = ref.detach().double().numpy()
    return float(np.abs(got - ref).max() / np.abs(ref).max())


class Block(nn.Module):
    """x + fc(ln(x)): one pre-LN block."""

    def __init__(self, norm: nn.Module | None = None):
        super().__init__()
        self.ln, self.fc = norm or nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class WithLengths(nn.Module):
    """Returns its `lengths` input unchanged beside the features (torchaudio's Conformer does)."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.ln_f, self.head = nn.Linear(8, D), Block(), nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x, lengths):
        return self.head(self.ln_f(self.block(self.emb(x)))), lengths


def test_an_input_returned_unchanged_keeps_its_name(tmp_path):
    torch.manual_seed(0)
    model = WithLengths().eval()
    batch = (torch.randn(2, 5, 8), torch.tensor([5, 3]))
    assert normswap.convert(model, method="exact", example_inputs=[batch]).num_converted == 2
    report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[batch])
    assert report.validated
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert [i.name for i in graph.input] == ["x", "lengths"]
    x, lengths = torch.randn(3, 7, 8), torch.tensor([7, 2, 4])
    logits, back = run(tmp_path / "m.onnx", {"x": x.numpy(), "lengths": lengths.numpy()})
    assert np.array_equal(back, lengths.numpy())
    assert rel(logits, model(x, lengths)[0]) < 1e-5


class UnitScale(nn.Module):
    """A user's RMSNorm, under a name that says nothing: x * rsqrt(mean(x^2) + eps) * w."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class RMSNorm(nn.Module):
    """lucidrains' RMSNorm: F.normalize(x) * sqrt(d) * g, a form no fusion rule matches (left op by op)."""

    def __init__(self, d: int):
        super().__init__()
        self.scale, self.g = d ** 0.5, nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return nn.functional.normalize(x, dim=-1) * self.scale * self.g


def test_an_rmsnorm_no_fusion_matches_is_left_op_by_op(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, D), Block(), nn.LayerNorm(D), nn.Linear(D, D), RMSNorm(D)).eval()
    assert normswap.convert(model, method="exact", example_inputs=[torch.randn(2, 6, 8)]).num_converted == 2
    report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[torch.randn(2, 6, 8)])
    assert report.validated and sum(report.fused.get(k, 0) for k in fuse.RMS_OPS) == 2
    other = torch.randn(3, 9, 8)
    assert rel(run(tmp_path / "m.onnx", {"input": other.numpy()})[0], model(other)) < 1e-5


def user_rms_model(converted: bool) -> nn.Module:
    """Not converted: an RMSNorm model of the user's own norm class (two blocks, a final norm) with a LayerNorm
    block between. Converted: a LayerNorm model whose user RMSNorm reads a projection of the normalised stream (a
    qk-norm: no residual stream), so its LayerNorms convert."""
    if converted:
        return nn.Sequential(nn.Linear(8, D), Block(), nn.LayerNorm(D), nn.Linear(D, D), UnitScale(D))
    return nn.Sequential(nn.Embedding(50, D), Block(UnitScale(D)), Block(), Block(UnitScale(D)), UnitScale(D),
                         nn.Linear(D, 4))


@pytest.mark.parametrize("converted", [False, True])
def test_a_users_rmsnorm_is_a_norm_not_a_mismatch(tmp_path, converted):
    torch.manual_seed(0)
    model = user_rms_model(converted).eval()
    batch = (lambda n, t: torch.randn(n, t, 8)) if converted else (lambda n, t: torch.randint(0, 50, (n, t)))
    if converted:
        assert normswap.convert(model, method="exact", example_inputs=[batch(2, 6)]).num_converted == 2
    report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[batch(2, 6)])
    assert report.validated
    rms = sum(report.fused.get(k, 0) for k in fuse.RMS_OPS)
    assert rms >= 2 * converted   # normswap's own norms fused; the user's fused or left op by op
    other = batch(3, 9)
    got = run(tmp_path / "m.onnx", {"input": other.numpy()})[0]
    assert rel(got, model(other)) < 1e-5


class Side(nn.Module):
    """A pre-LN block whose residual sum is also read, before the next norm, by a side branch (as TNT's inner
    stream feeds its outer one): a Skip fusion's sum output then feeds a node the fused node follows."""

    def __init__(self):
        super().__init__()
        self.emb, self.b1, self.side, self.b2 = nn.Linear(8, D), Block(), nn.Linear(D, D), Block()
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        x = self.b1(self.emb(x))
        side = self.side(torch.relu(x))
        return self.head(self.ln_f(self.b2(x))) + side.mean(-1, keepdim=True)


@pytest.mark.parametrize("target", ["ort", "onnx23"])
def test_fusions_keep_the_nodes_sorted(tmp_path, target):
    torch.manual_seed(0)
    model = Side().eval()
    report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[torch.randn(2, 5, 8)], target=target)
    assert report.validated
    if target == "ort":   # the residual adds fused into the norms after them
        assert report.fused.get("SkipLayerNormalization") == 2
    onnx.checker.check_model(onnx.load(str(tmp_path / "m.onnx")))
    other = torch.randn(3, 7, 8)
    assert rel(run(tmp_path / "m.onnx", {"x": other.numpy()})[0], model(other)) < 1e-5


@pytest.mark.slow
def test_timm_tnt_exports_for_ort(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("tnt_s_patch16_224", img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2,
                              num_heads_outer=2, num_heads_inner=1, num_classes=10).eval()
    images = torch.randn(2, 3, 32, 32)
    assert normswap.convert(model, method="exact", example_inputs=[images]).num_converted == 8
    assert normswap.export_onnx(model, tmp_path / "tnt.onnx", example_inputs=[images]).validated


class Cached(nn.Module):
    """Positions from a table the forward grows on demand and keeps (PaLM's rotary cache): torch.export sees the
    table of the calls before as a constant, so a longer sequence fails in onnxruntime though PyTorch runs it."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.ln_f, self.head = nn.Linear(8, D), Block(), nn.LayerNorm(D), nn.Linear(D, 4)
        self.table = None

    def positions(self, n: int) -> torch.Tensor:
        if self.table is None or self.table.shape[0] < n:
            self.table = torch.sin(torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(1, D + 1) / D)
        return self.table[:n]

    def forward(self, x):
        return self.head(self.ln_f(self.block(self.emb(x) + self.positions(x.shape[1]))))


def test_a_dynamic_dim_that_does_not_hold_falls_back_to_the_examples_shapes(tmp_path):
    torch.manual_seed(0)
    model = Cached().eval()
    batch = torch.randn(2, 6, 8)
    assert normswap.convert(model, method="exact", example_inputs=[batch]).num_converted == 2
    with pytest.warns(UserWarning, match="example's input shapes only"):
        report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[batch])
    assert report.validated and "does not hold in onnxruntime" in report.fixed_shapes
    assert "fixed shapes only" in str(report)
    (graph_input,) = onnx.load(str(tmp_path / "m.onnx")).graph.input
    shape = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    assert shape == [2, 6, 8]
    x = torch.randn(2, 6, 8)
    assert rel(run(tmp_path / "m.onnx", {"x": x.numpy()})[0], model(x)) < 1e-5


class Latents(nn.Module):
    """Learnt queries normalised before they read the input (Perceiver's latents): a norm of a constant, which
    onnxruntime folds away."""

    def __init__(self):
        super().__init__()
        self.latents, self.ln_latents = nn.Parameter(torch.randn(4, D)), nn.LayerNorm(D)
        self.emb, self.block, self.ln_f = nn.Linear(8, D), Block(), nn.LayerNorm(D)

    def forward(self, x):
        keys = self.ln_f(self.block(self.emb(x)))
        return torch.softmax(self.ln_latents(self.latents) @ keys.transpose(1, 2), -1) @ keys


@pytest.mark.parametrize("converted", [False, True])
def test_a_norm_of_a_constant_may_be_folded(tmp_path, converted):
    torch.manual_seed(0)
    model, batch = Latents().eval(), torch.randn(2, 5, 8)
    if converted:
        assert normswap.convert(model, method="exact", example_inputs=[batch]).num_converted == 3
    report = normswap.export_onnx(model, tmp_path / "m.onnx", example_inputs=[batch])
    assert report.validated
    other = torch.randn(3, 7, 8)
    assert rel(run(tmp_path / "m.onnx", {"x": other.numpy()})[0], model(other)) < 1e-5
