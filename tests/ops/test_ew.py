"""bstrain.ops.ew: seed names, broadcasting, both backends of the fused ops, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from bstrain.ops import ew
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Runs a test on the PyTorch path and on the Triton path (interpreter on CPU)."""
    monkeypatch.setenv("BSTRAIN_FORCE_TRITON", "1" if request.param == "triton" else "0")
    return kernel_device() if request.param == "triton" else "cpu"


@pytest.mark.parametrize("name, ref", [
    ("add", torch.add), ("multiply", torch.mul), ("subtract", torch.sub), ("divide", torch.div),
    ("maximum", torch.maximum), ("minimum", torch.minimum)])
def test_binary_ops_broadcast(name, ref):
    x, y = torch.randn(4, 1, 5, dtype=torch.float64), torch.rand(3, 1, dtype=torch.float64) + 0.5
    torch.testing.assert_close(getattr(ew, name)(x, y), ref(x, y))


@pytest.mark.parametrize("name, ref", [
    ("negative", lambda x: -x), ("reciprocal", lambda x: 1 / x), ("square", lambda x: x * x),
    ("sqrt", torch.sqrt), ("exp", torch.exp), ("log", torch.log), ("sigmoid", lambda x: 1 / (1 + torch.exp(-x))),
    ("tanh", torch.tanh), ("relu", lambda x: x.clamp_min(0)),
    ("elu", lambda x: torch.where(x > 0, x, torch.exp(x) - 1)),
    ("gelu", lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
    ("fast_gelu", lambda x: x / (1 + torch.exp(-1.702 * x)))])
def test_unary_ops(name, ref):
    x = torch.rand(3, 7, dtype=torch.float64) + 0.1
    x[0] -= 2.0                                                         # negatives too (sqrt/log aside)
    if name in ("sqrt", "log"):
        x = x.abs() + 0.1
    torch.testing.assert_close(getattr(ew, name)(x), ref(x))
    torch.testing.assert_close(ew.elu(-x.abs(), alpha=0.5), 0.5 * (torch.exp(-x.abs()) - 1))


@pytest.mark.parametrize("axis", (-1, 0))
def test_bias_relu(axis):
    x = torch.randn(6, 6, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    bb = b if axis == -1 else b[:, None]
    torch.testing.assert_close(ew.bias_relu(x, b, axis=axis), (x + bb).clamp_min(0))
    torch.testing.assert_close(ew.bias_relu(x, b, relu=False, axis=axis), x + bb)
    torch.testing.assert_close(ew.bias_relu(x, b, relu=False, fast_gelu=True, axis=axis), ew.fast_gelu(x + bb))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: ew.add(torch.ones(2), torch.ones(2, dtype=torch.float16)), TypeError, "y: expected dtype torch.float32"),
    (lambda: ew.add(torch.ones(2), [1.0]), TypeError, "y: expected a torch.Tensor"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(2)), ValueError, r"b: expected shape \(3,\)"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(3), fast_gelu=True), ValueError, "at most one"),
    (lambda: ew.split4(torch.ones(2, 6)), ValueError, r"x: expected \(N, 4K\)"),
    (lambda: ew.concat4(*[torch.ones(2, 3)] * 3, torch.ones(2, 4)), ValueError, "x3: expected shape"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3)), ValueError,
     "args: expected one"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 10)), ValueError, r"h: expected shape \(N, 4K\)"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), *[torch.ones(2, 3)] * 4, bias=torch.ones(12)), ValueError,
     "bias: only supported"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 12), bias=torch.ones(3)), ValueError,
     r"bias: expected shape \(12,\)"),
    (lambda: ew.add_n8([torch.ones(2)] * 9), ValueError, "xs: expected 1 to 8 tensors, got 9"),
    (lambda: ew.add_n8([torch.ones(2), torch.ones(3)]), ValueError, r"xs\[1\]: expected shape"),
    (lambda: ew.dropout(torch.ones(4), keep_prob=0.0), ValueError, "keep_prob"),
    (lambda: ew.dropout(torch.ones(20), mask=torch.zeros(2, dtype=torch.uint8)), ValueError, "mask: expected"),
    (lambda: ew.float_cast(torch.ones(2), torch.int32), TypeError, "dtype: expected a floating"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.ones(2)), TypeError, "labels: expected an int"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.tensor([0, 5])), ValueError, r"labels: expected values in \[0, 5\)"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.tensor([0, 1, 2])), ValueError, "logits, labels"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_split4_concat4_round_trip():
    x = torch.randn(3, 8)
    parts = ew.split4(x)
    assert [p.shape for p in parts] == [(3, 2)] * 4
    torch.testing.assert_close(ew.concat4(*parts), x)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("form", ["fused_bias", "fused", "four"])
def test_fused_lstm_gates(backend, dtype, form):
    n, k = 5, 24
    c = torch.randn(n, k, device=backend).to(dtype).requires_grad_()
    h = torch.randn(n, 4 * k, device=backend).to(dtype).requires_grad_()
    b = torch.randn(4 * k, device=backend).to(dtype).requires_grad_() if form == "fused_bias" else None
    args = (h,) if form != "four" else ew.split4(h)
    cn, hn = ew.fused_lstm_gates(c, *args, bias=b, forget_bias=1.0)
    c64, h64 = c.detach().cpu().double().requires_grad_(), h.detach().cpu().double().requires_grad_()
    b64 = b.detach().cpu().double().requires_grad_() if b is not None else None
    i, u, f, o = (h64 + b64 if b64 is not None else h64).chunk(4, 1)
    rc = c64 * torch.sigmoid(f + 1.0) + torch.sigmoid(i) * torch.tanh(u)      # gate order i, u, f, o
    rh = torch.tanh(rc) * torch.sigmoid(o)
    assert_close(cn, rc, None, dtype, "new_c")
    assert_close(hn, rh, None, dtype, "new_h")
    w1, w2 = torch.randn(n, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    ((cn.cpu().double() * w1) + (hn.cpu().double() * w2)).sum().backward()
    ((rc * w1) + (rh * w2)).sum().backward()
    assert_close(c.grad, c64.grad, None, dtype, "dc")
    assert_close(h.grad, h64.grad, None, dtype, "dh")
    if b is not None:
        assert_close(b.grad, b64.grad, None, dtype, "dbias")


def test_float_cast_gradient_dtype():
    w = torch.randn(4, 4, requires_grad=True)
    y = ew.float_cast(w, torch.float16, dx_dtype=torch.float16)
    assert y.dtype == torch.float16
    (y.float() * 2).sum().backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, torch.full((4, 4), 2.0))
    x = torch.randn(3, dtype=torch.float16, requires_grad=True)
    ew.float_cast(x, torch.float32).sum().backward()
    assert x.grad.dtype == torch.float16                         # default: back in x's dtype
    # the backward itself casts to dx_dtype (autograd then hands x its grad in x's dtype)
    assert ew._FloatCast.backward(type("Ctx", (), {"dx_dtype": torch.bfloat16})(),
                                  torch.ones(2))[0].dtype == torch.bfloat16


def test_dropout_keep_rate_and_mask_reuse():
    x = torch.randn(1000, 101)                                      # 101,000 elements, not a multiple of 8
    y, mask = ew.dropout(x, keep_prob=0.8)
    assert mask.dtype == torch.uint8 and mask.numel() == (x.numel() + 7) // 8
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.8) < 5 * math.sqrt(0.8 * 0.2 / x.numel()), f"keep rate {kept}"
    torch.testing.assert_close(y[y != 0], (x / 0.8)[y != 0])
    y2, mask2 = ew.dropout(x, keep_prob=0.8, mask=mask)
    assert torch.equal(y, y2) and mask2 is mask
    xg = x.clone().requires_grad_()
    ew.dropout(xg, 0.8, mask=mask)[0].sum().backward()
    torch.testing.assert_close(xg.grad, (y != 0).float() / 0.8)


def test_add_n8_and_add_n():
    xs = [torch.randn(3, 2, dtype=torch.float64) for _ in range(19)]
    for n in (1, 2, 8):
        torch.testing.assert_close(ew.add_n8(xs[:n]), torch.stack(xs[:n]).sum(0))
    torch.testing.assert_close(ew.add_n(xs), torch.stack(xs).sum(0))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
def test_softmax_cross_entropy(backend, dtype):
    logits = (3 * torch.randn(5, 700, device=backend)).to(dtype).requires_grad_()
    labels = torch.randint(0, 700, (5,), device=backend)
    loss = ew.softmax_cross_entropy(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == (5,)
    x64 = logits.detach().cpu().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64, labels.cpu(), reduction="none")
    assert_close(loss, ref, None, torch.float32 if dtype == torch.float32 else dtype, "loss")
    w = torch.rand(5)
    (loss * w.to(backend)).sum().backward()
    (ref * w.double()).sum().backward()
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, x64.grad, None, dtype, "dlogits")


def test_softmax_cross_entropy_fp16_vocab_65536(backend):
    logits = (torch.rand(2, 65536, device=backend) * 60000).half()
    labels = torch.tensor([3, 65535], device=backend)
    loss = ew.softmax_cross_entropy(logits, labels)
    ref = torch.nn.functional.cross_entropy(logits.cpu().double(), labels.cpu(), reduction="none")
    assert torch.isfinite(loss).all()
    assert_close(loss, ref, None, torch.float32, "loss")


def test_fused_lstm_gates_non_contiguous_inputs(backend):
    c = torch.randn(16, 8, device=backend).t()                       # (8, 16), feature stride 8
    h4 = torch.randn(64, 8, device=backend).t()                      # (8, 64), feature stride 8
    cn, hn = ew.fused_lstm_gates(c, h4)
    rc, rh = ew.fused_lstm_gates_ref(c.contiguous(), *h4.contiguous().chunk(4, 1))
    torch.testing.assert_close(cn, rc)
    torch.testing.assert_close(hn, rh)
