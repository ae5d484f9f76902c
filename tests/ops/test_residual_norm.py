"""bstrain.ops.residual_norm.add_layer_norm: values and gradients against float64 on both backends,
with and without a residual, mixed dtypes, ragged widths and rows, and its argument checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bstrain.ops.residual_norm import add_layer_norm, add_layer_norm_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
CASES = [("torch", torch.float32), ("torch", torch.bfloat16)] + [("triton", d) for d in DTYPES]


def _inputs(shape, dtype, dev, residual=True, r_dtype=None, param_dtype=torch.float32, rbias=False):
    C = shape[-1]
    x = (3 * torch.randn(*shape, device=dev) + 1).to(dtype).requires_grad_()
    r = torch.randn(*shape, device=dev).to(r_dtype or dtype).requires_grad_() if residual else None
    w = (1 + 0.3 * torch.randn(C, device=dev)).to(param_dtype).requires_grad_()
    b = (0.2 * torch.randn(C, device=dev)).to(param_dtype).requires_grad_()
    c = torch.randn(C, device=dev).to(param_dtype).requires_grad_() if rbias else None
    return x, r, w, b, c


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("shape", [(2, 5, 48), (7, 100), (1, 1, 8), (33, 512)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("residual, rbias", [(True, False), (False, False), (True, True)],
                         ids=["res", "nores", "res+bias"])
def test_add_layer_norm(backend, dtype, shape, residual, rbias):
    """y, h and dx, dr, dw, db (and the residual bias's dc) against float64, with gradients
    arriving at both y and h."""
    dev = kernel_device() if backend == "triton" else "cpu"
    x, r, w, b, c = _inputs(shape, dtype, dev, residual, rbias=rbias)
    y, h = add_layer_norm(x, r, w, b, 1e-5, residual_bias=c, backend=backend)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    names = [n for n, t in zip(("dx", "dr", "dw", "db", "dc"), (x, r, w, b, c)) if t is not None]
    leaves = [t for t in (x, r, w, b, c) if t is not None]
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    x64, r64 = leaves64[0], leaves64[1] if residual else None
    w64, b64 = leaves64[2:4] if residual else leaves64[1:3]
    h64 = x64 if r64 is None else x64 + r64 + (leaves64[4] if rbias else 0)
    y64 = F.layer_norm(h64, (shape[-1],), w64, b64, 1e-5)
    # the kernel normalises h rounded to its dtype: compare y with the norm of that stream
    y_of_h = F.layer_norm(h.detach().double().cpu(), (shape[-1],), w64.detach(), b64.detach(), 1e-5)
    assert_close(h, h64, None, dtype, "h")
    assert_close(y, y_of_h, None, dtype, "y")
    dy, dh = torch.randn_like(y64), torch.randn_like(y64)
    got = torch.autograd.grad((y.double().cpu() * dy).sum() + (h.double().cpu() * dh).sum(), leaves)
    want = torch.autograd.grad((y64 * dy).sum() + (h64 * dh).sum(), leaves64)
    for name, g, ref, t in zip(names, got, want, leaves):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert_close(g, ref, None, dtype, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_only_y_used_and_mixed_dtypes(backend):
    """An fp32 stream with an fp16 residual (its gradient comes back fp16), h unused downstream."""
    dev = kernel_device() if backend == "triton" else "cpu"
    x, r, w, b, _ = _inputs((6, 40), torch.float32, dev, r_dtype=torch.float16)
    y, _ = add_layer_norm(x, r, w, b, backend=backend)
    got = torch.autograd.grad(y.square().sum(), (x, r, w, b))
    args64 = [t.detach().double().cpu().requires_grad_() for t in (x, r, w, b)]
    y64, _ = add_layer_norm_ref(*args64)
    want = torch.autograd.grad(y64.square().sum(), args64)
    assert got[1].dtype == torch.float16
    for name, g, ref in zip(("dx", "dr", "dw", "db"), got, want):
        assert_close(g, ref, None, torch.float16 if name == "dr" else torch.float32, name)


def test_reference_is_a_residual_add_then_layer_norm():
    x, r, w, b, c = (t.detach().double() for t in _inputs((3, 16), torch.float32, "cpu", rbias=True))
    y, h = add_layer_norm(x, r, w, b, 1e-6, residual_bias=c)
    torch.testing.assert_close(h, x + r + c, rtol=0, atol=1e-15)
    torch.testing.assert_close(y, F.layer_norm(x + r + c, (16,), w, b, 1e-6), rtol=1e-12, atol=1e-12)


@pytest.mark.triton
@pytest.mark.parametrize("kw, exc, match", [
    (dict(x=torch.ones(2, 4, dtype=torch.int32)), TypeError, "x: expected a floating tensor"),
    (dict(x=torch.ones(2, 0)), ValueError, r"x: expected \(\.\.\., C\) with C >= 1"),
    (dict(residual=torch.ones(3, 4)), ValueError, r"residual: expected shape \(2, 4\)"),
    (dict(weight=torch.ones(5)), ValueError, "weight: expected 4 elements"),
    (dict(bias=torch.ones(4, dtype=torch.float64)), TypeError, "bias: expected dtype torch.float32"),
    (dict(residual_bias=torch.ones(3)), ValueError, "residual_bias: expected 4 elements"),
    (dict(residual=None, residual_bias=torch.ones(4)), ValueError, "residual_bias: expected None without a residual"),
])
def test_bad_arguments(kw, exc, match):
    args = dict(x=torch.ones(2, 4), residual=torch.ones(2, 4), weight=torch.ones(4), bias=torch.zeros(4),
                residual_bias=None)
    args.update(kw)
    with pytest.raises(exc, match=match):
        add_layer_norm(args["x"], args["residual"], args["weight"], args["bias"], residual_bias=args["residual_bias"],
                       backend="triton")
