"""The general layer-norm kernel (axis 0/1, segments, ReLU) against float64 references."""
from __future__ import annotations

import pytest
import torch

from bstrain.kernels import norms as kernels
from bstrain.ops.norms import layer_norm_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes


def check_kernel(x, g, b, axis, relu, segments, dtype, base=None):
    """Forward and backward kernels against float64 autograd of layer_norm_ref.

    With ReLU, the reference gradient passes where the kernel's stored output is > 0: an output
    within rounding of zero may fall on either side of it in fp32 and in float64, and the
    gradient must follow the forward the kernel actually computed (as torch's ReLU does).
    """
    y, mean, rstd = kernels.layer_norm_forward(x, g, b, axis, 1e-6, relu, segments)
    x64, g64, b64 = (t.double().cpu().requires_grad_() for t in (x, g, b))
    pre = layer_norm_ref(x64, g64, b64, axis, 1e-6, False, segments)
    assert_close(y, pre.clamp_min(0) if relu else pre, base() if base else None, dtype, "y")
    ref = pre * (y.double().cpu() > 0) if relu else pre
    dy = torch.randn_like(x)
    ref.backward(dy.double().cpu())
    dx, dg, db, _ = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, axis, relu, segments)
    assert_close(dx, x64.grad, None, dtype, "dx")
    assert_close(dg, g64.grad, None, dtype, "dg")
    assert_close(db, b64.grad, None, dtype, "db")


def test_relu_gradient_follows_the_stored_output():
    """Outputs that round to zero in fp16 carry no gradient, as the stored output says."""
    dev = kernel_device()
    x = torch.randn(64, 40, device=dev).half()
    g = torch.full((40,), 1e-3, device=dev)               # fp32 params, small outputs
    _, mean, rstd = kernels.layer_norm_forward(x, g, torch.zeros_like(g), 1, 1e-6, False, 1)
    xhat_g = (x[0].float() - mean[0]) * rstd[0] * g                 # row 0 before its bias
    tiny = torch.tensor([1e-8, -1e-8], device=dev).repeat(20)       # in fp32 > 0 or < 0; 0 in fp16
    b = tiny - xhat_g
    y, mean, rstd = kernels.layer_norm_forward(x, g, b, 1, 1e-6, True, 1)
    assert (y[0] == 0).all(), "row 0 should round to zero in fp16"
    dx, dg, db, _ = kernels.layer_norm_backward(torch.ones_like(x), x, g, b, mean, rstd, 1, True, 1)
    torch.testing.assert_close(db, (y > 0).float().sum(0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("segments", (1, 4), ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("relu", (False, True), ids=["norelu", "relu"])
def test_layer_norm_kernel(dtype, axis, segments, relu):
    dev = kernel_device()
    c, n = 4 * 37, 23                                   # ragged segment size and group count
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) * 3 + 1).to(dtype)
    g, b = torch.randn(c, device=dev).to(dtype), torch.randn(c, device=dev).to(dtype)
    check_kernel(x, g, b, axis, relu, segments, dtype,
                 base=lambda: layer_norm_ref(x, g, b, axis, 1e-6, relu, segments))


@pytest.mark.parametrize("axis, n, block_g, sms", [(0, 37, 32, 132), (1, 37, 1, 132), (1, 35, 4, 8)],
                         ids=["axis0", "axis1-row-per-program", "axis1-4-rows"])
def test_layer_norm_loop_kernel(axis, n, block_g, sms, monkeypatch):
    """Segments too large for one tile: the three-pass kernels, with a ragged last slice (and a
    ragged last group of rows: 4 rows per program once the rows fill a GPU of ``sms`` SMs twice)."""
    monkeypatch.setattr(kernels, "TILE", 32)
    monkeypatch.setattr(kernels, "sm_count", lambda device: sms)
    dev, dtype = kernel_device(), torch.float32
    c = 2 * 45
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) * 2 + 3).to(dtype)
    g, b = torch.randn(c, device=dev), torch.randn(c, device=dev)
    geometry = kernels._geometry(x, axis, 2)
    assert geometry[6] and geometry[4] == block_g, f"expected the looped kernels, {block_g} groups per program"
    for relu in (False, True):
        check_kernel(x, g, b, axis, relu, 2, dtype)


def test_segment_limit_is_a_clear_error():
    x = torch.randn(2, kernels.MAX_SEGMENT * 2)
    with pytest.raises(ValueError, match="segments: the kernel handles up to"):
        kernels.layer_norm_forward(x, x[0], x[0], 1, 1e-6, False, 1)


def check_mul_kernel(x, g, b, m, axis, segments, dtype):
    """y = LN(x)·m and (dx, dg, db, dm) against float64 autograd of layer_norm_ref(mul=m)."""
    y, mean, rstd = kernels.layer_norm_forward(x, g, b, axis, 1e-6, False, segments, m)
    x64, g64, b64, m64 = (t.double().cpu().requires_grad_() for t in (x, g, b, m))
    ref = layer_norm_ref(x64, g64, b64, axis, 1e-6, False, segments, m64)
    assert_close(y, ref, layer_norm_ref(x, g, b, axis, 1e-6, False, segments, m), dtype, "y")
    dy = torch.randn_like(x)
    want = torch.autograd.grad(ref, (x64, g64, b64, m64), dy.double().cpu())
    got = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, axis, False, segments, m)
    for name, a, r in zip(("dx", "dg", "db", "dm"), got, want):
        assert_close(a, r, None, dtype, name)
    assert got[3].dtype == m.dtype


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("segments", (1, 4), ids=lambda s: f"seg{s}")
def test_layer_norm_mul_kernel(dtype, axis, segments):
    """The multiplicative operand: in x's dtype, or fp32 with 16-bit x (4 segments)."""
    dev = kernel_device()
    c, n = 4 * 19, 11
    shape = (n, c) if axis == 1 else (c, n)
    x = (torch.randn(shape, device=dev) * 3 + 1).to(dtype)
    m = torch.randn(shape, device=dev).to(torch.float32 if segments == 4 else dtype)
    g, b = torch.randn(c, device=dev).to(dtype), torch.randn(c, device=dev).to(dtype)
    check_mul_kernel(x, g, b, m, axis, segments, dtype)


@pytest.mark.parametrize("looped", (False, True), ids=["one-tile", "looped"])
@pytest.mark.parametrize("op", ("relu", "mul"))
def test_layer_norm_backward_adds_into_a_workspace(looped, op, monkeypatch):
    """ACCUMULATE: dg/db partial sums added into a workspace that holds data, not written."""
    if looped:
        monkeypatch.setattr(kernels, "TILE", 32)
        monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    dev = kernel_device()
    n, c = 5, 2 * 45
    x = torch.randn(n, c, device=dev) * 2 + 3
    g, b, m = torch.randn(c, device=dev), torch.randn(c, device=dev), torch.randn(n, c, device=dev)
    relu, mul = op == "relu", m if op == "mul" else None
    assert kernels._geometry(x, 1, 2)[6] == looped
    if mul is not None:
        check_mul_kernel(x, g, b, m, 1, 2, torch.float32)
    y, mean, rstd = kernels.layer_norm_forward(x, g, b, 1, 1e-6, relu, 2, mul)
    dy = torch.randn_like(x)
    dx, dg, db, dm = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, 1, relu, 2, mul)
    ws = {}

    def workspace(shape):
        ws["t"] = torch.randn(shape, device=dev)
        ws["before"] = ws["t"].clone()
        return ws["t"]
    got = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, 1, relu, 2, mul, workspace)
    assert got[1] is None and got[2] is None
    torch.testing.assert_close(got[0], dx, rtol=0, atol=0)
    sums = (ws["t"] - ws["before"]).sum(1)
    torch.testing.assert_close(sums[0], dg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[1], db, rtol=1e-5, atol=1e-5)
