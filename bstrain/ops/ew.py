"""The seed's elementwise ops, LSTM gates, casts, dropout, add_n8 and softmax cross-entropy.

Plain elementwise ops are torch calls with torch's broadcasting: a hand-written kernel would not
beat torch (or torch.compile) on them. Fused ops whose Triton kernel measurably beats
``torch.compile`` of the same math (scripts/bench_ops.py, benchmarks/ops.md) run that kernel on CUDA
tensors: of the ops here, that is fused_lstm_gates. Everything else, and every CPU tensor, runs
PyTorch.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

__all__ = [
    "add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square",
    "sqrt", "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "fast_gelu", "swish", "bias_relu",
    "split4", "concat4", "fused_lstm_gates", "fused_lstm_gates_ref", "float_cast", "dropout",
    "add_n8", "add_n", "softmax_cross_entropy", "softmax_cross_entropy_ref",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _use_kernel(*tensors: torch.Tensor) -> bool:
    """Triton path: CUDA tensors, or CPU tensors under the interpreter when BSTRAIN_FORCE_TRITON=1."""
    t = tensors[0]
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if t.is_cuda:
        return True
    return os.environ.get("BSTRAIN_FORCE_TRITON") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def check_index_range(name: str, idx: torch.Tensor, n: int) -> None:
    """ValueError unless every value of ``idx`` lies in [0, n). One host sync; skipped while a CUDA
    graph is being captured (the values are not known then)."""
    if idx.numel() and not (idx.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack(torch.aminmax(idx)).tolist()
        if lo < 0 or hi >= n:
            raise ValueError(f"{name}: expected values in [0, {n}), got [{lo}, {hi}]")


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")


def _check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    for name, x in zip(names, xs):
        _check_tensor(name, x)
    for name, x in zip(names[1:], xs[1:]):
        if x.dtype != xs[0].dtype:
            raise TypeError(f"{name}: expected dtype {xs[0].dtype} (as {names[0]}), got {x.dtype}")
        if x.device != xs[0].device:
            raise ValueError(f"{name}: expected device {xs[0].device} (as {names[0]}), got {x.device}")


# --- binary and unary ops: torch, with torch's broadcasting ---------------------------------------
def add(x, y):
    _check_same(("x", "y"), x, y)
    return torch.add(x, y)


def multiply(x, y):
    _check_same(("x", "y"), x, y)
    return torch.mul(x, y)


def subtract(x, y):
    _check_same(("x", "y"), x, y)
    return torch.sub(x, y)


def divide(x, y):
    _check_same(("x", "y"), x, y)
    return torch.div(x, y)


def maximum(x, y):
    _check_same(("x", "y"), x, y)
    return torch.maximum(x, y)


def minimum(x, y):
    _check_same(("x", "y"), x, y)
    return torch.minimum(x, y)


def negative(x):
    return torch.neg(x)


def reciprocal(x):
    return torch.reciprocal(x)


def square(x):
    return torch.square(x)


def sqrt(x):
    return torch.sqrt(x)


def exp(x):
    return torch.exp(x)


def log(x):
    return torch.log(x)


def sigmoid(x):
    return torch.sigmoid(x)


def tanh(x):
    return torch.tanh(x)


def relu(x):
    return torch.relu(x)


def elu(x, alpha: float = 1.0):
    return F.elu(x, alpha=alpha)


def gelu(x):
    """The tanh approximation of GELU, as in the seed."""
    return F.gelu(x, approximate="tanh")


def swish(x, alpha: float = 1.0):
    """x·σ(alpha·x)."""
    return x * torch.sigmoid(alpha * x)


def fast_gelu(x):
    """x·σ(1.702·x): the seed's fast GELU."""
    return swish(x, alpha=1.702)


def bias_relu(x: torch.Tensor, b: torch.Tensor, relu: bool = True, fast_gelu: bool = False,
              axis: int = -1) -> torch.Tensor:
    """y = act(x + b) with b broadcast along ``axis`` of x (the feature axis).

    Args: x (..., K) for axis=-1, or (K, N) with axis=0; b (K,). act is ReLU (relu=True),
    x·σ(1.702x) (fast_gelu=True) or the identity.
    """
    _check_same(("x", "b"), x, b)
    if relu and fast_gelu:
        raise ValueError("relu, fast_gelu: expected at most one of them, got both")
    if b.dim() != 1 or b.shape[0] != x.shape[axis]:
        raise ValueError(f"b: expected shape ({x.shape[axis]},) for x {tuple(x.shape)} on axis {axis}, "
                         f"got {tuple(b.shape)}")
    shape = [1] * x.dim()
    shape[axis] = -1
    y = x + b.view(shape)
    if relu:
        return torch.relu(y)
    return y * torch.sigmoid(1.702 * y) if fast_gelu else y


# --- LSTM gates ------------------------------------------------------------------------------------
def split4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, 4K) -> four (N, K) views, in gate order i, u, f, o."""
    if x.dim() != 2 or x.shape[1] % 4:
        raise ValueError(f"x: expected (N, 4K), got {tuple(x.shape)}")
    return tuple(x.chunk(4, dim=1))


def concat4(x0, x1, x2, x3) -> torch.Tensor:
    """Four (N, K) tensors -> (N, 4K)."""
    xs = (x0, x1, x2, x3)
    _check_same(("x0", "x1", "x2", "x3"), *xs)
    for i, x in enumerate(xs):
        if x.shape != x0.shape or x.dim() != 2:
            raise ValueError(f"x{i}: expected shape {tuple(x0.shape)} (2-D, as x0), got {tuple(x.shape)}")
    return torch.cat(xs, dim=1)


def fused_lstm_gates_ref(c, i, u, f, o, forget_bias: float = 1.0):
    """PyTorch LSTM cell update on pre-activations: returns (new_c, new_h)."""
    new_c = c * torch.sigmoid(f + forget_bias) + torch.sigmoid(i) * torch.tanh(u)
    return new_c, torch.tanh(new_c) * torch.sigmoid(o)


def fused_lstm_gates(c: torch.Tensor, *args: torch.Tensor, bias: torch.Tensor | None = None,
                     forget_bias: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's fused LSTM cell update.

    Gate order (as in the seed): **i, u, f, o** — input gate, update (candidate), forget gate,
    output gate. ``new_c = σ(f + forget_bias)·c + σ(i)·tanh(u)``, ``new_h = σ(o)·tanh(new_c)``.

    Args:
        c: (N, K) cell state.
        *args: one (N, 4K) tensor holding the four gate pre-activations side by side, or four
            (N, K) tensors i, u, f, o.
        bias: (4K,) added to the fused gates (one-tensor form only).
    Returns (new_c, new_h), each (N, K).
    """
    _check_tensor("c", c)
    if len(args) == 1:
        h = args[0]
        _check_same(("c", "h"), c, h)
        if c.dim() != 2 or h.dim() != 2 or h.shape != (c.shape[0], 4 * c.shape[1]):
            raise ValueError(f"h: expected shape (N, 4K) = {(c.shape[0], 4 * c.shape[1])} for c "
                             f"{tuple(c.shape)}, got {tuple(h.shape)}")
        if bias is not None:
            _check_same(("h", "bias"), h, bias)
            if tuple(bias.shape) != (h.shape[1],):
                raise ValueError(f"bias: expected shape ({h.shape[1]},), got {tuple(bias.shape)}")
        gates = h.chunk(4, dim=1)
    elif len(args) == 4:
        _check_same(("c", "i", "u", "f", "o"), c, *args)
        for name, g in zip("iufo", args):
            if g.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(g.shape)}")
        if bias is not None:
            raise ValueError("bias: only supported with the fused (N, 4K) gate tensor")
        gates = args
    else:
        raise ValueError(f"args: expected one (N, 4K) gate tensor or four (N, K) tensors i, u, f, o, "
                         f"got {len(args)} tensors")
    if _use_kernel(c):
        return _LstmGates.apply(c, bias, float(forget_bias), *gates)           # the kernel adds the bias
    if bias is not None:
        gates = (args[0] + bias).chunk(4, dim=1)
    return fused_lstm_gates_ref(c, *gates, forget_bias=forget_bias)


class _LstmGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, bias, forget_bias, i, u, f, o):
        from bstrain.kernels.ew import lstm_gates_forward
        c, i, u, f, o = (t if t.stride(1) == 1 else t.contiguous() for t in (c, i, u, f, o))
        ctx.save_for_backward(c, bias, i, u, f, o)
        ctx.forget_bias = forget_bias
        return lstm_gates_forward(c, i, u, f, o, bias, forget_bias)

    @staticmethod
    def backward(ctx, dc_new, dh_new):
        from bstrain.kernels.ew import lstm_gates_backward
        c, bias, i, u, f, o = ctx.saved_tensors
        if dh_new is None:
            dh_new = torch.zeros_like(c)
        dc, dg = lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias, ctx.forget_bias)
        dbias = dg.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None and ctx.needs_input_grad[1] else None
        return (dc, dbias, None) + tuple(dg.chunk(4, dim=1))


# --- casts, dropout, sums --------------------------------------------------------------------------
class _FloatCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, dx_dtype):
        ctx.dx_dtype = dx_dtype
        return x.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        return dy.to(ctx.dx_dtype), None, None


def float_cast(x: torch.Tensor, dtype: torch.dtype, dx_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Casts x to ``dtype``; the backward casts the gradient to ``dx_dtype`` (default: x's dtype).

    Unlike TensorFlow, PyTorch's autograd always hands x its gradient in x's own dtype, so a
    dx_dtype other than x's only changes the rounding the gradient passes through on the way.
    """
    _check_tensor("x", x)
    for name, dt in (("dtype", dtype), ("dx_dtype", dx_dtype)):
        if dt is not None and dt not in _FLOATS:
            raise TypeError(f"{name}: expected a floating torch.dtype, got {dt!r}")
    return _FloatCast.apply(x, dtype, dx_dtype or x.dtype)


@functools.lru_cache(maxsize=None)
def _bit_weights(device: torch.device) -> torch.Tensor:
    """1, 2, 4, ..., 128 as uint8 on ``device``, copied there once."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """bool (n,) -> uint8 (ceil(n/8),), bit j of byte b is element 8b+j."""
    flat = keep.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    w = _bit_weights(flat.device)
    return (flat.view(-1, 8).to(torch.uint8) * w).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(mask: torch.Tensor, n: int) -> torch.Tensor:
    w = _bit_weights(mask.device)
    return ((mask.view(-1, 1) & w) != 0).view(-1)[:n]


def dropout(x: torch.Tensor, keep_prob: float = 0.8, mask: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverted dropout: y = x·m/keep_prob. Returns (y, mask).

    The mask is bit-packed (uint8, one bit per element of x, 8x smaller than a bool mask); pass it
    back to reproduce exactly the same drop, e.g. when a layer is recomputed.
    """
    _check_tensor("x", x)
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob: expected a value in (0, 1], got {keep_prob}")
    n = x.numel()
    if mask is None:
        keep = torch.rand(x.shape, device=x.device, generator=generator) < keep_prob
        mask = _pack_bits(keep)
    else:
        if mask.dtype != torch.uint8 or mask.numel() != (n + 7) // 8 or mask.device != x.device:
            raise ValueError(f"mask: expected a uint8 tensor of {(n + 7) // 8} bytes on {x.device} "
                             f"(bit-packed, for x of {n} elements), got {mask.dtype} of {mask.numel()} "
                             f"on {mask.device}")
        keep = _unpack_bits(mask, n).view(x.shape)
    return x * keep.to(x.dtype) * (1.0 / keep_prob), mask


def add_n8(xs) -> torch.Tensor:
    """Sums 1 to 8 tensors of one shape, dtype and device."""
    xs = list(xs)
    if not 1 <= len(xs) <= 8:
        raise ValueError(f"xs: expected 1 to 8 tensors, got {len(xs)}")
    _check_same(tuple(f"xs[{i}]" for i in range(len(xs))), *xs)
    for i, x in enumerate(xs):
        if x.shape != xs[0].shape:
            raise ValueError(f"xs[{i}]: expected shape {tuple(xs[0].shape)} (as xs[0]), got {tuple(x.shape)}")
    return torch.stack(xs).sum(0) if len(xs) > 2 else (xs[0] + xs[1] if len(xs) == 2 else xs[0])


def add_n(xs) -> torch.Tensor:
    """Sums any number of tensors, eight at a time."""
    xs = list(xs)
    total = add_n8(xs[:8])
    for s in range(8, len(xs), 7):
        total = add_n8([total] + xs[s:s + 7])
    return total


# --- softmax cross-entropy -------------------------------------------------------------------------
def softmax_cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row loss in fp32: logsumexp(logits) - logits[label], computed in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Softmax + cross-entropy. logits: (N, V) fp32/fp16/bf16; labels: (N,) int.

    Returns the (N,) fp32 loss. Works in fp32 internally, so fp16/bf16 logits of vocabularies up
    to 65,536 (and beyond) never overflow; the gradient comes back in the logits' dtype. This is
    PyTorch's cross_entropy: a hand-written Triton kernel did not beat torch.compile of it
    (benchmarks/ops.md), so wrap your loss in torch.compile for the fused speed at large V.
    """
    _check_tensor("logits", logits)
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an int64 or int32 tensor, got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if logits.dim() != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"logits, labels: expected (N, V) and (N,), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels: expected device {logits.device} (as logits), got {labels.device}")
    check_index_range("labels", labels, logits.shape[1])
    return softmax_cross_entropy_ref(logits, labels.long())
