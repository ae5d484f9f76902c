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
    dev = kernel_device() if backend == "triton" else "cpu"
    c, n = 4 * 19, 13
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) + 0.5).to(dtype).requires_grad_()
    g = (torch.rand(c, device=dev) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(c, device=dev).to(dtype).requires_grad_()
    y = norms.layer_norm(x, g, b, axis=axis, segments=segments, relu=relu, backend=backend)
    assert y.shape == x.shape and y.dtype == dtype
    x64, g64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, g, b))
    ref = seed_layer_norm(x64, g64, b64, axis, 1e-6, relu, segments)
    assert_close(y, ref, None, dtype, "y")
    if relu:    # the gradient follows the op's own ReLU decision (outputs near zero: either side)
        ref = seed_layer_norm(x64, g64, b64, axis, 1e-6, False, segments) * (y.detach().cpu() > 0)
    dy = torch.randn(ref.shape, dtype=torch.float64)
    (y.cpu().double() * dy).sum().backward()
    (ref * dy).sum().backward()
    for name, got, want in (("dx", x, x64), ("dg", g, g64), ("db", b, b64)):
        assert_close(got.grad, want.grad, None, dtype, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape, axis", [((3, 5, 8), -1), ((3, 5, 8), 2), ((8, 3, 5), 0), ((3, 8, 5), 1), ((3, 8, 5), -2)],
                         ids=["BTC-last", "BTC-2", "CBT-first", "middle", "middle-neg"])
@pytest.mark.parametrize("segments, relu", [(1, False), (2, True)])
def test_layer_norm_any_rank_and_axis(backend, shape, axis, segments, relu, monkeypatch):
    """The seed's transformer calls layer_norm(x, g, b, axis=-1) on (B, T, C): any rank, any axis."""
    dev = kernel_device() if backend == "triton" else "cpu"
    x = torch.randn(shape, device=dev, requires_grad=True)
    C = shape[axis]
    g, b = torch.randn(C, device=dev, requires_grad=True), torch.randn(C, device=dev, requires_grad=True)
    y = norms.layer_norm(x, g, b, axis=axis, segments=segments, relu=relu, backend=backend)
    assert y.shape == x.shape
    x64, g64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, g, b))
    moved = x64.movedim(axis, -1)
    ref = seed_layer_norm(moved.reshape(-1, C), g64, b64, 1, 1e-6, False, segments).reshape(moved.shape).movedim(-1, axis)
    keep = y.detach().cpu() > 0 if relu else torch.ones(shape, dtype=torch.bool)
    assert_close(y, ref.clamp_min(0) if relu else ref, None, torch.float32, "y")
    dy = torch.randn(shape, dtype=torch.float64)
    (y.cpu().double() * dy).sum().backward()
    (ref * keep * dy).sum().backward()
    for name, got, want in (("dx", x, x64), ("dg", g, g64), ("db", b, b64)):
        assert_close(got.grad, want.grad, None, torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("shape, axis, segments", [((13, 20), 1, 1), ((20, 13), 0, 4), ((3, 20, 5), 1, 2)],
                         ids=["NC", "CN-seg4", "middle-seg2"])
def test_layer_norm_mul(backend, dtype, shape, axis, segments):
    """y = LN(x)·mul, fused: outputs and dx, dg, db, dmul against float64 (mul fp32 with 16-bit x
    on the 2-D cases, fp32 gain and bias with 16-bit x)."""
    dev = kernel_device() if backend == "triton" else "cpu"
    C = shape[axis]
    x = (torch.randn(shape, device=dev) + 0.5).to(dtype).requires_grad_()
    m = torch.randn(shape, device=dev).to(torch.float32 if len(shape) == 2 else dtype).requires_grad_()
    g, b = (torch.rand(C, device=dev) + 0.5).requires_grad_(), torch.randn(C, device=dev).requires_grad_()
    y = norms.layer_norm(x, g, b, axis=axis, segments=segments, mul=m, backend=backend)
    assert y.shape == x.shape and y.dtype == dtype
    x64, g64, b64, m64 = (t.detach().cpu().double().requires_grad_() for t in (x, g, b, m))
    moved = x64.movedim(axis, -1)
    ref = seed_layer_norm(moved.reshape(-1, C), g64, b64, 1, 1e-6, False, segments).reshape(moved.shape)
    ref = ref.movedim(-1, axis) * m64
    assert_close(y, ref, None, dtype, "y")
    dy = torch.randn(shape, dtype=torch.float64)
    got = torch.autograd.grad((y.cpu().double() * dy).sum(), (x, g, b, m))
    want = torch.autograd.grad((ref * dy).sum(), (x64, g64, b64, m64))
    for name, a, r, t in zip(("dx", "dg", "db", "dmul"), got, want, (x, g, b, m)):
        assert a.dtype == t.dtype, name
        assert_close(a, r, None, dtype, name)


def test_layer_norm_seed_positional_order():
    """layer_norm(x, g, b, axis, segments, epsilon, relu): the seed's fifth argument is segments."""
    x, g, b = torch.randn(6, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(norms.layer_norm(x, g, b, 1, 2, 1e-3, True),
                               norms.layer_norm(x, g, b, axis=1, segments=2, epsilon=1e-3, relu=True))
    torch.testing.assert_close(norms.layer_norm(x, g, b, 1, 2), seed_layer_norm(x, g, b, 1, 1e-6, False, 2))


# 16-bit cases: PyTorch path in fp16 and bf16; kernels in the dtypes kernel_dtypes() allows
HALF_CASES = [("torch", torch.float16), ("torch", torch.bfloat16)] + \
    [("triton", d) for d in kernel_dtypes() if d != torch.float32]


@pytest.mark.parametrize("backend, dtype", HALF_CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("axis, relu", [(1, False), (1, True), (0, False)], ids=["axis1", "axis1-relu", "axis0"])
def test_layer_norm_fp32_params_with_16_bit_x(backend, dtype, axis, relu, monkeypatch):
    """The seed's mixed precision: fp32 gain and bias, shaped (1, C) and (C, 1), with fp16/bf16 x."""
    dev = kernel_device() if backend == "triton" else "cpu"
    x = torch.randn((7, 24) if axis == 1 else (24, 7), device=dev).to(dtype).requires_grad_()
    g = (torch.rand(1, 24, device=dev) + 0.5).requires_grad_()
    b = torch.randn(24, 1, device=dev).requires_grad_()
    y = norms.layer_norm(x, g, b, axis=axis, relu=relu, backend=backend)
    assert y.dtype == dtype
    x64, g64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, g, b))
    ref = seed_layer_norm(x64, g64.view(-1), b64.view(-1), axis, 1e-6, False, 1)
    assert_close(y, ref.clamp_min(0) if relu else ref, None, dtype, "y")
    ((ref * (y.detach().cpu() > 0)) if relu else ref).sum().backward()
    y.float().sum().backward()
    assert g.grad.dtype == torch.float32 and g.grad.shape == (1, 24) and b.grad.shape == (24, 1)
    assert_close(g.grad, g64.grad, None, dtype, "dg")
    assert_close(b.grad, b64.grad, None, dtype, "db")


def _group_of_others():
    from bstrain.ops.grouping import param_grad_group
    g, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    return param_grad_group(g, b)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(3), torch.ones(4)), ValueError, r"g: expected 4 elements"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), segments=3), ValueError,
     "segments: expected a positive divisor"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), axis=2), ValueError,
     r"axis: expected an int axis in \[-2, 2\)"),
    (lambda: norms.layer_norm(torch.ones(2, 0), torch.ones(0), torch.ones(0), axis=1), ValueError,
     "x: expected at least one feature"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4).half(), torch.ones(4)), TypeError,
     "g: expected dtype torch.float32"),
    (lambda: norms.layer_norm(torch.ones(2, 4).half(), torch.ones(4).double(), torch.ones(4).half()), TypeError,
     "g: expected dtype torch.float16"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), mul=torch.ones(4, 2)), ValueError,
     r"mul: expected shape \(2, 4\)"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), mul=[1.0]), TypeError,
     "mul: expected a torch.Tensor"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), relu=True, mul=torch.ones(2, 4)),
     ValueError, "mul: expected no relu"),
    (lambda: norms.layer_norm(torch.ones(2, 4), torch.ones(4), torch.ones(4), grad_group=_group_of_others()),
     ValueError, "grad_group: expected a group of these g and b"),
    (lambda: norms.batch_norm(torch.ones(2, 3, 4), torch.ones(2), torch.ones(3)), ValueError, r"g: expected 3 elements"),
    (lambda: norms.batch_norm(torch.ones(3), torch.ones(3), torch.ones(3)), ValueError, "x: expected"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.triton
def test_mul_errors_come_before_any_kernel(monkeypatch):
    from bstrain.kernels import launch
    monkeypatch.setattr(launch.Launch, "__call__", lambda *a: pytest.fail("a kernel was launched"))
    x, g, b = torch.ones(2, 4), torch.ones(4), torch.zeros(4)
    with pytest.raises(ValueError, match="mul: expected shape"):
        norms.layer_norm(x, g, b, mul=torch.ones(2, 5), backend="triton")
    with pytest.raises(ValueError, match="mul: expected no relu"):
        norms.layer_norm(x, g, b, relu=True, mul=torch.ones(2, 4), backend="triton")
    with pytest.raises(TypeError, match="mul: expected a floating tensor"):
        norms.layer_norm(x, g, b, mul=torch.ones(2, 4, dtype=torch.int64), backend="triton")


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
@pytest.mark.parametrize("params", ["same", "fp32"])
def test_batch_norm_statistics_feed_inference_in_16_bit(dtype, params):
    imgs = torch.randn(2, 3, 8, 8).to(dtype)
    pdt = dtype if params == "same" else torch.float32
    g, b = torch.ones(1, 3, dtype=pdt), torch.zeros(3, 1, dtype=pdt)
    y, mean, var = norms.batch_norm(imgs, g, b)
    y_inf = norms.batch_norm_inference(imgs, g, b, mean, var)
    assert y.dtype == y_inf.dtype == dtype and mean.dtype == torch.float32
    torch.testing.assert_close(y_inf.float(), y.float(), rtol=2e-2, atol=2e-2)
