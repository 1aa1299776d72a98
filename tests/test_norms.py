"""RMSNorm / pRMSNorm numerics against float64 references."""
import math

import pytest
import torch

from normswap import PartialRMSNorm, RMSNorm
from normswap.errors import NormswapError
from normswap.ops import rms_norm


def reference(x: torch.Tensor, w: torch.Tensor | None, eps: float, k: int | None = None) -> torch.Tensor:
    x64 = x.double()
    k = k or x.shape[-1]
    y = x64 / torch.sqrt(x64[..., :k].pow(2).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_fp32_matches_fp64_reference():
    torch.manual_seed(0)
    norm = RMSNorm(384, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 7, 384) * 3 + 0.5
    assert rel_err(norm(x), reference(x, norm.weight, 1e-5)) <= 1e-6


def test_matches_torch_rms_norm():
    torch.manual_seed(1)
    x, w = torch.randn(5, 96), torch.rand(96) + 0.5
    ours = RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(w)
    torch.testing.assert_close(ours(x), torch.nn.functional.rms_norm(x, (96,), w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_keeps_dtype_and_accuracy(dtype, tol):
    torch.manual_seed(2)
    x = (torch.randn(3, 64) * 4).to(dtype)
    norm = RMSNorm(64).to(dtype)
    y = norm(x)
    assert y.dtype == dtype
    assert rel_err(y, reference(x, None, 1e-6)) <= tol


def test_fp16_large_values_do_not_overflow():
    # 300^2 = 90000 > fp16 max (65504): squares must be taken in fp32.
    x = torch.full((2, 32), 300.0, dtype=torch.float16)
    x[:, ::2] = -300.0
    y = RMSNorm(32).half()(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), torch.sign(x.float()), rtol=1e-3, atol=1e-3)


def test_no_affine_has_no_weight():
    norm = RMSNorm(16, elementwise_affine=False)
    assert norm.weight is None and len(list(norm.parameters())) == 0
    x = torch.randn(2, 16)
    assert rel_err(norm(x), reference(x, None, 1e-6)) <= 1e-6


@pytest.mark.parametrize("d,p", [(64, 0.0625), (100, 0.1), (33, 0.5), (10, 1.0)])
def test_partial_rms_uses_first_ceil_pd_features(d, p):
    torch.manual_seed(3)
    norm = PartialRMSNorm(d, p=p, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(6, d)
    k = math.ceil(p * d)
    assert rel_err(norm(x), reference(x, norm.weight, 1e-6, k)) <= 1e-6
    if k < d:  # changing features beyond k must not change the estimated RMS
        x2 = x.clone()
        x2[:, k:] *= 10
        torch.testing.assert_close(norm(x2)[:, :k], norm(x)[:, :k])


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5])
def test_partial_rejects_bad_p(p):
    with pytest.raises((ValueError, NormswapError)):
        PartialRMSNorm(16, p=p)


def test_residual_returns_normed_sum_and_sum():
    torch.manual_seed(4)
    x, r, w = torch.randn(3, 48), torch.randn(3, 48), torch.rand(48)
    y, h = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, x + r)
    assert rel_err(y, reference(x + r, w, 1e-6)) <= 1e-6


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_output_is_contiguous_like_layernorm(monkeypatch, backend):
    """A norm's output is contiguous whatever its input's strides, as nn.LayerNorm's is: models .view() it
    (Idefics3's pixel shuffle after a stream laid out (batch, channels, tokens) by a conv stem). The
    normswap op, its torch path and the portable module of converted folders alike."""
    from normswap.folder import portable
    monkeypatch.setenv("NORMSWAP_BACKEND", backend)
    x = torch.randn(2, 32, 16).transpose(1, 2)          # (2, 16, 32), strides (512, 1, 16)
    w = torch.rand(32) + 0.5
    assert nn_layernorm_contiguous(x)
    mod = RMSNorm(32, eps=1e-6)
    shipped = portable.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(w)
        shipped.weight.copy_(w)
    for y in (mod(x), shipped(x), rms_norm(x, w, 1e-6)):
        assert y.is_contiguous() and y.view(2, 8, 64).shape == (2, 8, 64)
        assert rel_err(y, reference(x.double(), w.double(), 1e-6)) < 1e-6


def nn_layernorm_contiguous(x: torch.Tensor) -> bool:
    return torch.nn.LayerNorm(x.shape[-1])(x).is_contiguous()
