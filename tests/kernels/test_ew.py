"""LSTM-gate kernels against float64 references."""
from __future__ import annotations

import pytest
import torch

from bstrain.kernels import ew as kernels
from bstrain.ops.ew import fused_lstm_gates_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes

DT = pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])


def lstm_reference(c, gates, bias, fb, dc_new, dh_new):
    """float64 (new_c, new_h, dc, dgates (N, 4K), dbias) by autograd."""
    c64 = c.double().cpu().requires_grad_()
    h64 = torch.cat([g.double().cpu() for g in gates], 1).requires_grad_()
    b64 = bias.double().cpu().requires_grad_() if bias is not None else None
    hh = h64 + b64 if b64 is not None else h64
    cn, hn = fused_lstm_gates_ref(c64, *hh.chunk(4, 1), forget_bias=fb)
    (cn * dc_new.double().cpu() + hn * dh_new.double().cpu()).sum().backward()
    return cn, hn, c64.grad, h64.grad


@DT
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "four"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_lstm_gates(dtype, fused, bias):
    dev = kernel_device()
    n, k = 7, 33                                                     # ragged: not a multiple of BLOCK
    c = torch.randn(n, k, device=dev).to(dtype)
    h = (2 * torch.randn(n, 4 * k, device=dev)).to(dtype)
    gates = h.chunk(4, 1) if fused else tuple(g.contiguous() for g in h.chunk(4, 1))
    b = torch.randn(4 * k, device=dev).to(dtype) if bias else None
    dc_new, dh_new = torch.randn(n, k, device=dev).to(dtype), torch.randn(n, k, device=dev).to(dtype)
    cn, hn = kernels.lstm_gates_forward(c, *gates, bias=b, forget_bias=0.5)
    dc, dg = kernels.lstm_gates_backward(c, *gates, dc_new, dh_new, bias=b, forget_bias=0.5)
    rc, rh, rdc, rdg = lstm_reference(c, gates, b, 0.5, dc_new, dh_new)
    hh = torch.cat(gates, 1) + (b if b is not None else 0)
    base_c, base_h = fused_lstm_gates_ref(c, *hh.chunk(4, 1), forget_bias=0.5)
    assert_close(cn, rc, base_c, dtype, "new_c")
    assert_close(hn, rh, base_h, dtype, "new_h")
    assert_close(dc, rdc, None, dtype, "dc")
    assert_close(dg, rdg, None, dtype, "dgates")


def test_lstm_gates_without_dc():
    dev = kernel_device()
    c, h = torch.randn(3, 8, device=dev), torch.randn(3, 32, device=dev)
    dh = torch.randn(3, 8, device=dev)
    dc, dg = kernels.lstm_gates_backward(c, *h.chunk(4, 1), None, dh)
    _, _, rdc, rdg = lstm_reference(c, h.chunk(4, 1), None, 1.0, torch.zeros_like(dh), dh)
    assert_close(dc, rdc, None, torch.float32, "dc")
    assert_close(dg, rdg, None, torch.float32, "dgates")
