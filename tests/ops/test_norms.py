"""bstrain.ops.norms: layer norm on both axes, segments and ReLU, both backends; batch norm."""
from __future__ import annotations

import pytest
import torch

from bstrain.ops import norms
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes


def seed_layer_norm(x, g, b, axis, eps, relu, segments):
    """float64 reference written from the seed's definition, independent of layer_norm_ref."""
    xr = x if axis == 1 else x.t()
    k = xr.shape[1] // segments
    outs = []
    for s in range(segments):
        seg = xr[:, s * k:(s + 1) * k]
        mean = seg.mean(1, keepdim=True)
        var = ((seg - mean) ** 2).mean(1, keepdim=True)
        outs.append((seg - mean) / torch.sqrt(var + eps) * g[s * k:(s + 1) * k] + b[s * k:(s + 1) * k])
    y = torch.cat(outs, 1)
    y = y.clamp_min(0) if relu else y
    return y if axis == 1 else y.t()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("segments, relu", [(1, False), (1, True), (4, False), (4, True)])
def test_layer_norm(backend, dtype, axis, segments, relu, monkeypatch):
    monkeypatch.setenv("BSTRAIN_FORCE_TRITON", "1" if backend == "triton" else "0")
    dev = kernel_device() if backend == "triton" else "cpu"
    c, n = 4 * 19, 13
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) + 0.5).to(dtype).requires_grad_()
    g = (torch.rand(c, device=dev) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(c, device=dev).to(dtype).requires_grad_()
    y = norms.layer_norm(x, g, b, axis=axis, segments=segments, relu=relu)
    assert y.shape == x.shape and y.dtype == dtype
    x64, g64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, g, b))
    ref = seed_layer_norm(x64, g64, b64, axis, 1e-6, relu, segments)
    assert_close(y, ref, None, dtype, "y")
    dy = torch.randn(ref.shape, dtype=torch.float64)
    (y.cpu().double() * dy).sum().backward()
    (ref * dy).sum().backward()
    for name, got, want in (("dx", x, x64), ("dg", g, g64), ("db", b, b64)):
        assert_close(got.grad, want.grad, None, dtype, name)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(3), torch.ones(4)), ValueError, r"g: expected shape \(4,\)"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), segments=3), ValueError,
     "segments: expected a positive divisor"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), axis=2), ValueError, "axis"),
    (lambda: norms.layer_norm(torch.ones(2, 4, 1), torch.ones(4), torch.ones(4)), ValueError, "x: expected a 2-D"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4).half(), torch.ones(4)), TypeError,
     "g: expected dtype torch.float32"),
    (lambda: norms.batch_norm(torch.ones(2, 3, 4), torch.ones(2), torch.ones(3)), ValueError, r"g: expected shape \(3,\)"),
    (lambda: norms.batch_norm(torch.ones(3), torch.ones(3), torch.ones(3)), ValueError, "x: expected"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (2, 3, 2, 3, 4)], ids=["NCHW", "NCDHW"])
def test_batch_norm(shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.rand(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y, mean, var = norms.batch_norm(x, g, b, epsilon=1e-5)
    dims = [0] + list(range(2, len(shape)))
    torch.testing.assert_close(mean, x.mean(dims))
    torch.testing.assert_close(var, x.var(dims, unbiased=False))
    view = (1, 3) + (1,) * (len(shape) - 2)
    ref = (x - mean.view(view)) / torch.sqrt(var.view(view) + 1e-5) * g.view(view) + b.view(view)
    torch.testing.assert_close(y, ref)
    assert torch.autograd.gradcheck(lambda *a: norms.batch_norm(*a)[0], (x, g, b))
    y_inf = norms.batch_norm_inference(x, g, b, mean, var, epsilon=1e-5)
    torch.testing.assert_close(y_inf, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_norm_statistics_feed_inference_in_16_bit(dtype):
    imgs = torch.randn(2, 3, 8, 8).to(dtype)
    g, b = torch.ones(3, dtype=dtype), torch.zeros(3, dtype=dtype)
    y, mean, var = norms.batch_norm(imgs, g, b)
    y_inf = norms.batch_norm_inference(imgs, g, b, mean, var)
    torch.testing.assert_close(y_inf.float(), y.float(), rtol=2e-2, atol=2e-2)
