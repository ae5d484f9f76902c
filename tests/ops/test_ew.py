"""bstrain.ops.ew: seed names, broadcasting, both backends of the fused ops, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from bstrain.ops import ew
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes


@pytest.fixture(params=["torch", "triton"])
def path(request):
    """(device, backend=): the PyTorch path, and the Triton path (the interpreter on CPU)."""
    return (kernel_device() if request.param == "triton" else "cpu"), request.param


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


@pytest.mark.parametrize("axis", (-1, 0, 1))
def test_bias_relu_seed_signature(axis):
    """bias_relu(x, b, axis=-1, relu=False, fast_gelu=False): a plain bias add by default."""
    x = torch.randn(6, 5, dtype=torch.float64)
    k = x.shape[axis]
    b = torch.randn(k, dtype=torch.float64)
    bb = b if axis in (-1, 1) else b[:, None]
    torch.testing.assert_close(ew.bias_relu(x, b, axis=axis), x + bb)
    torch.testing.assert_close(ew.bias_relu(x, b, axis, True), (x + bb).clamp_min(0))          # positional relu
    torch.testing.assert_close(ew.bias_relu(x, b, axis, False, True), ew.fast_gelu(x + bb))    # positional fast_gelu
    torch.testing.assert_close(ew.bias_relu(x, b, axis=axis, fast_gelu=True), ew.fast_gelu(x + bb))
    for shape in ((1, k), (k, 1)):                   # the seed's test passes (1, K) and (K, 1) biases
        torch.testing.assert_close(ew.bias_relu(x, b.reshape(shape), axis=axis, relu=True), (x + bb).clamp_min(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_bias_relu_fp32_bias_with_16_bit_x(dtype):
    x = torch.randn(4, 3, 8).to(dtype).requires_grad_()
    b = torch.randn(1, 8, requires_grad=True)                                         # fp32 master bias
    y = ew.bias_relu(x, b, relu=True)
    assert y.dtype == dtype and y.shape == x.shape
    ref = (x.detach().float() + b.detach().view(-1)).clamp_min(0)                     # computed in fp32
    torch.testing.assert_close(y, ref.to(dtype), rtol=0, atol=0)
    y.float().sum().backward()
    assert b.grad.dtype == torch.float32 and b.grad.shape == (1, 8)
    torch.testing.assert_close(b.grad.view(-1), (ref > 0).float().sum((0, 1)))


def test_gelu_alpha():
    x = torch.randn(20, dtype=torch.float64)
    torch.testing.assert_close(ew.gelu(x, 0.1), 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.1 * x**3))))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: ew.add(torch.ones(2), torch.ones(2, dtype=torch.float16)), TypeError, "y: expected dtype torch.float32"),
    (lambda: ew.add(torch.ones(2), [1.0]), TypeError, "y: expected a torch.Tensor"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(2)), ValueError, r"b: expected 3 elements"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(3), relu=True, fast_gelu=True), ValueError, "at most one"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(3), axis=2), ValueError, r"axis: expected an int axis in \[-2, 2\)"),
    (lambda: ew.bias_relu(torch.ones(2, 3).half(), torch.ones(3).double()), TypeError, "b: expected dtype torch.float16"),
    (lambda: ew.bias_relu(torch.ones(2, 3), torch.ones(3).half()), TypeError, "b: expected dtype torch.float32"),
    (lambda: ew.split4(torch.ones(2, 6)), ValueError, r"x: expected \(N, 4K\)"),
    (lambda: ew.concat4(*[torch.ones(2, 3)] * 3, torch.ones(2, 4)), ValueError, "x3: expected shape"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3)), ValueError,
     "args: expected one"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 10)), ValueError, r"h: expected shape \(N, 4K\)"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), *[torch.ones(2, 3)] * 4, bias=torch.ones(12)), ValueError,
     "bias: only supported"),
    (lambda: ew.fused_lstm_gates(torch.ones(2, 3), torch.ones(2, 12), bias=torch.ones(3)), ValueError,
     r"bias: expected 12 elements"),
    (lambda: ew.add_n8([torch.ones(2)] * 9), ValueError, "xs: expected 1 to 8 tensors, got 9"),
    (lambda: ew.add_n8([torch.ones(2), torch.ones(3)]), ValueError, r"xs\[1\]: expected shape"),
    (lambda: ew.dropout(torch.ones(4), keep_prob=0.0), ValueError, "keep_prob"),
    (lambda: ew.dropout(torch.ones(20), 0.8, mask=torch.zeros(2, dtype=torch.uint8)), ValueError, "mask: expected"),
    (lambda: ew.dropout(torch.ones(4, 5), 0.8, mask_shape=(4, 2)), ValueError, "mask_shape: expected 2 dims"),
    (lambda: ew.dropout(torch.ones(4, 5), 0.8, mask_shape=(4,)), ValueError, "mask_shape: expected 2 dims"),
    (lambda: ew.dropout(torch.ones(4, 5), 0.8, mask=torch.zeros(3, dtype=torch.uint8), mask_shape=(4, 1)), ValueError,
     "mask: expected a uint8 tensor of 1 bytes"),
    (lambda: ew.float_cast(torch.ones(2), torch.int32), TypeError, "dtype: expected a floating"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.ones(2)), TypeError, "labels: expected an int64"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.tensor([0, 5])), ValueError, r"labels: expected values in \[0, 5\)"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 5), torch.tensor([0, 1, 2])), ValueError, "logits, labels"),
    (lambda: ew.softmax_cross_entropy(torch.ones(2, 3, 5), torch.zeros(5, dtype=torch.uint8)), ValueError,
     r"one id per row of logits \(6 for logits \(2, 3, 5\)\)"),
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
def test_fused_lstm_gates(path, dtype, form):
    backend, name = path
    n, k = 5, 24
    c = torch.randn(n, k, device=backend).to(dtype).requires_grad_()
    h = torch.randn(n, 4 * k, device=backend).to(dtype).requires_grad_()
    b = torch.randn(4 * k, device=backend).to(dtype).requires_grad_() if form == "fused_bias" else None
    args = (h,) if form != "four" else ew.split4(h)
    cn, hn = ew.fused_lstm_gates(c, *args, bias=b, forget_bias=1.0, backend=name)
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
    x[::7, ::3] = 0.0                                               # zeros in x must not fool the checks
    y, mask = ew.dropout(x, keep_prob=0.8)
    assert mask.dtype == torch.uint8 and mask.numel() == (x.numel() + 7) // 8
    keep = ew._unpack_bits(mask, x.numel()).view(x.shape)           # the draw, from the mask itself
    rate = keep.float().mean().item()
    assert abs(rate - 0.8) < 5 * math.sqrt(0.8 * 0.2 / x.numel()), f"keep rate {rate}"
    torch.testing.assert_close(y, torch.where(keep, x / 0.8, 0.0))
    y2, mask2 = ew.dropout(x, 0.8, mask)
    assert torch.equal(y, y2) and mask2 is mask
    xg = x.clone().requires_grad_()
    ew.dropout(xg, 0.8, mask=mask)[0].sum().backward()
    torch.testing.assert_close(xg.grad, keep.float() / 0.8)


@pytest.mark.parametrize("x_shape, mask_shape", [
    ((1023, 127), (1023, 1)), ((1023, 127), (1, 127)), ((63, 63, 63), (63, 1, 63)), ((63, 63, 63), (1, 1, 1)),
    ((16, 16, 16, 16, 16), (16, 16, 16, 16, 1))], ids=str)
def test_dropout_mask_shape_broadcasts(x_shape, mask_shape):
    """The seed's mask_shape: one draw per mask element, broadcast over x, in forward and backward."""
    x = torch.randn(x_shape, requires_grad=True)
    y, mask = ew.dropout(x, 0.5, mask_shape=mask_shape)
    n = math.prod(mask_shape)
    assert mask.numel() == (n + 7) // 8
    keep = ew._unpack_bits(mask, n).view(mask_shape).expand(x_shape)
    torch.testing.assert_close(y, torch.where(keep, x / 0.5, 0.0))
    if n > 1000:                                                    # within 5 sigma of the keep rate
        assert abs(keep.float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / n)
    y.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() / 0.5)
    y2, _ = ew.dropout(x, 0.5, mask, mask_shape)                    # reused with its shape
    torch.testing.assert_close(y2, y)


def test_add_n8_and_add_n():
    xs = [torch.randn(3, 2, dtype=torch.float64) for _ in range(19)]
    for n in (1, 2, 8):
        torch.testing.assert_close(ew.add_n8(xs[:n]), torch.stack(xs[:n]).sum(0))
    torch.testing.assert_close(ew.add_n(xs), torch.stack(xs).sum(0))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
def test_softmax_cross_entropy(path, dtype):
    backend, name = path
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


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.int16, torch.uint16, torch.uint8],
                         ids=lambda d: str(d).split(".")[1])
def test_softmax_cross_entropy_any_rank(label_dtype):
    """logits (..., V) with labels of any shape holding one id per row; the loss has logits' leading shape."""
    logits = torch.randn(2, 3, 4, 50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (24,)).to(label_dtype)
    loss = ew.softmax_cross_entropy(logits, labels)
    assert loss.shape == (2, 3, 4)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.long(), reduction="none").view(2, 3, 4)
    torch.testing.assert_close(loss, ref)                               # float64 kept (gradcheck works)
    torch.testing.assert_close(ew.softmax_cross_entropy(logits, labels.view(2, 12)), loss)


def test_softmax_cross_entropy_fp16_vocab_65536(path):
    backend, name = path
    logits = (torch.rand(2, 65536, device=backend) * 60000).half()
    labels = torch.tensor([3, 65535], device=backend)
    loss = ew.softmax_cross_entropy(logits, labels)
    ref = torch.nn.functional.cross_entropy(logits.cpu().double(), labels.cpu(), reduction="none")
    assert torch.isfinite(loss).all()
    assert_close(loss, ref, None, torch.float32, "loss")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: DTYPE_IDS[d])
def test_fused_lstm_gates_fp32_bias_with_16_bit_gates(path, dtype):
    """The seed's mixed precision: an fp32 (1, 4K) gate bias with 16-bit c and gates."""
    backend, name = path
    c = torch.randn(3, 8, device=backend).to(dtype).requires_grad_()
    h = torch.randn(3, 32, device=backend).to(dtype).requires_grad_()
    b = torch.randn(1, 32, device=backend, requires_grad=True)
    cn, hn = ew.fused_lstm_gates(c, h, bias=b, backend=name)
    assert cn.dtype == hn.dtype == dtype
    rc, rh = ew.fused_lstm_gates_ref(c.detach().double().cpu(),
                                     *(h.detach().double().cpu() + b.detach().double().cpu()).chunk(4, 1))
    assert_close(cn, rc, None, dtype, "new_c")
    assert_close(hn, rh, None, dtype, "new_h")
    (cn.float().sum() + hn.float().sum()).backward()
    assert b.grad.dtype == torch.float32 and b.grad.shape == (1, 32)
    torch.testing.assert_close(b.grad.view(-1), h.grad.float().sum(0).cpu().to(b.device), rtol=1e-2, atol=1e-2)


def test_fused_lstm_gates_non_contiguous_inputs(path):
    backend, name = path
    c = torch.randn(16, 8, device=backend).t()                       # (8, 16), feature stride 8
    h4 = torch.randn(64, 8, device=backend).t()                      # (8, 64), feature stride 8
    cn, hn = ew.fused_lstm_gates(c, h4, backend=name)
    rc, rh = ew.fused_lstm_gates_ref(c.contiguous(), *h4.contiguous().chunk(4, 1))
    torch.testing.assert_close(cn, rc)
    torch.testing.assert_close(hn, rh)
