"""bstrain.ops.bias_act.bias_gelu: gelu(x + bias) and its gradients (dx and the bias's column sum)
against float64 on both backends, ragged widths and rows, and its argument checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bstrain.ops.bias_act import bias_gelu
from tests.conftest import DTYPE_IDS, assert_close, kernel_device

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
CASES = [("torch", torch.float32), ("torch", torch.bfloat16)] + [("triton", d) for d in DTYPES]


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("shape", [(2, 7, 300), (1, 5), (40, 64)], ids=lambda s: "x".join(map(str, s)))
def test_bias_gelu(backend, dtype, shape):
    dev = kernel_device() if backend == "triton" else "cpu"
    x = (2 * torch.randn(*shape, device=dev)).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=dev).requires_grad_()
    y = bias_gelu(x, bias, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    x64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, bias))
    y64 = F.gelu(x64 + b64)
    assert_close(y, y64, None, dtype, "y")
    dy = torch.randn_like(y64)
    got = torch.autograd.grad(y, (x, bias), dy.to(dev, dtype))
    want = torch.autograd.grad(y64, (x64, b64), dy.to(dtype).double())
    for name, g, w, t in zip(("dx", "dbias"), got, want, (x, bias)):
        assert g.dtype == t.dtype, name
        assert_close(g, w, None, dtype, name)


@pytest.mark.triton
@pytest.mark.parametrize("kw, exc, match", [
    (dict(x=torch.ones(2, 4, dtype=torch.int32)), TypeError, "x: expected a floating tensor"),
    (dict(x=torch.ones(2, 0)), ValueError, r"x: expected \(\.\.\., C\) with C >= 1"),
    (dict(bias=torch.ones(5)), ValueError, "bias: expected 4 elements"),
    (dict(bias=torch.ones(4, dtype=torch.float64)), TypeError, "bias: expected dtype torch.float32"),
])
def test_bad_arguments(kw, exc, match):
    args = dict(x=torch.ones(2, 4), bias=torch.zeros(4))
    args.update(kw)
    with pytest.raises(exc, match=match):
        bias_gelu(args["x"], args["bias"], backend="triton")
