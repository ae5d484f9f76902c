"""bstrain.ops.lstm_cell: the fused mLSTM cell on both backends, its argument checks, and its
agreement with the ops it stands for (layer_norm with segments=4, an add, fused_lstm_gates)."""
from __future__ import annotations

import pytest
import torch

from bstrain.ops import ew, norms
from bstrain.ops.lstm_cell import fused_lstm_cell, fused_lstm_cell_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes

NAMES = ("c", "z", "xg", "g", "b", "bias")
CASES = [("torch", torch.float32), ("torch", torch.bfloat16)] + [("triton", d) for d in kernel_dtypes()]


def inputs(n, H, dtype, dev, grad=True):
    c = torch.randn(n, H, device=dev).to(dtype)
    z = (2 * torch.randn(n, 4 * H, device=dev) + 1).to(dtype)
    xg = torch.randn(n, 4 * H, device=dev).to(dtype)
    params = [torch.rand(4 * H, device=dev) + 0.5, torch.randn(4 * H, device=dev), torch.randn(4 * H, device=dev)]
    return [t.requires_grad_(grad) for t in (c, z, xg, *params)]


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("n, H", [(1, 8), (3, 20)], ids=["B1", "B3"])
def test_fused_lstm_cell(backend, dtype, n, H):
    """Outputs and every gradient (dc, dz, dxg, dg, db, dbias) against float64."""
    dev = kernel_device() if backend == "triton" else "cpu"
    args = inputs(n, H, dtype, dev)
    new_c, new_h = fused_lstm_cell(*args, forget_bias=0.7, backend=backend)
    assert new_c.dtype == new_h.dtype == dtype and new_c.shape == new_h.shape == (n, H)
    args64 = [t.detach().double().cpu().requires_grad_() for t in args]
    rc, rh = fused_lstm_cell_ref(*args64, forget_bias=0.7)
    assert_close(new_c, rc, None, dtype, "new_c")
    assert_close(new_h, rh, None, dtype, "new_h")
    dc, dh = torch.randn(n, H, dtype=torch.float64), torch.randn(n, H, dtype=torch.float64)
    got = torch.autograd.grad((new_c.double().cpu() * dc).sum() + (new_h.double().cpu() * dh).sum(), args)
    want = torch.autograd.grad((rc * dc).sum() + (rh * dh).sum(), args64)
    for name, a, r, t in zip(NAMES, got, want, args):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert_close(a, r, None, dtype, "d" + name)


def test_the_ops_it_stands_for():
    """fused_lstm_gates(c, xg + layer_norm(z, g, b, segments=4), bias=bias), in float64."""
    c, z, xg, g, b, bias = (t.detach().double() for t in inputs(4, 12, torch.float32, "cpu"))
    want = ew.fused_lstm_gates(c, xg + norms.layer_norm(z, g, b, segments=4), bias=bias, forget_bias=0.3)
    got = fused_lstm_cell(c, z, xg, g, b, bias, forget_bias=0.3)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_only_new_h_used(backend):
    """new_c unused: its gradient arrives as None (the kernel's HAS_DC=False)."""
    dev = kernel_device() if backend == "triton" else "cpu"
    args = inputs(2, 8, torch.float32, dev)
    got = torch.autograd.grad(fused_lstm_cell(*args, backend=backend)[1].sum(), args)
    args64 = [t.detach().double().cpu().requires_grad_() for t in args]
    want = torch.autograd.grad(fused_lstm_cell_ref(*args64)[1].sum(), args64)
    for name, a, r in zip(NAMES, got, want):
        assert_close(a, r, None, torch.float32, "d" + name)


def _bad(c=None, z=None, xg=None, g=None, b=None, bias=None, **kw):
    """fused_lstm_cell with valid (2, 3) fp32 arguments, some replaced."""
    ok = inputs(2, 3, torch.float32, "cpu", grad=False)
    new = [c, z, xg, g, b, bias]
    kw.setdefault("backend", "triton")
    return lambda: fused_lstm_cell(*[o if n is None else n for o, n in zip(ok, new)], **kw)


@pytest.mark.triton
@pytest.mark.parametrize("call, exc, match", [
    (_bad(c=torch.ones(2, 3, dtype=torch.int32)), TypeError, "c: expected a floating tensor"),
    (_bad(c=torch.ones(2, 3, 1)), ValueError, r"c: expected a 2-D \(N, H\)"),
    (_bad(c=torch.ones(2, 0)), ValueError, r"c: expected a 2-D \(N, H\) tensor with H >= 1"),
    (_bad(z=torch.ones(2, 12).half()), TypeError, "z: expected dtype torch.float32"),
    (_bad(z=torch.ones(2, 3)), ValueError, r"z: expected shape \(N, 4H\) = \(2, 12\)"),
    (_bad(xg=torch.ones(3, 12)), ValueError, r"xg: expected shape \(N, 4H\)"),
    (_bad(xg=[1.0]), TypeError, "xg: expected a torch.Tensor"),
    (_bad(g=torch.ones(3)), ValueError, "g: expected 12 elements"),
    (_bad(b=torch.ones(12).half()), TypeError, "b: expected dtype torch.float32"),
    (_bad(bias=torch.ones(13)), ValueError, "bias: expected 12 elements"),
    (_bad(backend="cuda"), ValueError, "backend: expected one of"),
])
def test_bad_input_is_named_before_any_kernel(call, exc, match, monkeypatch):
    from bstrain.kernels import launch
    monkeypatch.setattr(launch.Launch, "__call__", lambda *a: pytest.fail("a kernel was launched"))
    with pytest.raises(exc, match=match):
        call()


def test_grad_group_of_other_parameters_or_rows_is_named():
    from bstrain.ops.grouping import param_grad_group
    c, z, xg, g, b, bias = inputs(2, 3, torch.float32, "cpu")
    for group in (param_grad_group(g, b, b, rows=(0, 1, 1)), param_grad_group(g, b, bias)):
        with pytest.raises(ValueError, match="grad_group: expected a group of these g, b and bias"):
            fused_lstm_cell(c, z, xg, g, b, bias, grad_group=group)
