"""The seed's elementwise ops, casts, dropout and add_n8.

They are torch calls with torch's broadcasting: a hand-written kernel would not beat torch (or
torch.compile) on them. The seed's other names that lived here have homes of their own and stay
importable from here: the LSTM gates (``split4``, ``concat4``, ``fused_lstm_gates``) in
:mod:`bstrain.ops.lstm_cell`, ``softmax_cross_entropy`` in :mod:`bstrain.ops.cross_entropy`, and the
input checks every op file shares (``check_param``, ``as_index``, ``use_kernels``, ...) in
:mod:`bstrain.ops._checks`.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from bstrain.ops._checks import FLOATS, HALF, check_axis, check_param, check_same, check_tensor
from bstrain.ops._dispatch import kernel_op
from bstrain.ops._seed import ignores
# their old home: re-exported so that imports from here keep working
from bstrain.ops._checks import INDEX_DTYPES, as_index, check_index_range, unit_columns, use_kernels  # noqa: F401
from bstrain.ops.cross_entropy import softmax_cross_entropy, softmax_cross_entropy_ref  # noqa: F401
from bstrain.ops.lstm_cell import (  # noqa: F401
    concat4, fused_lstm_gates, fused_lstm_gates_bwd_ref, fused_lstm_gates_ref, split4,
)

__all__ = [
    "add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square",
    "sqrt", "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "fast_gelu", "swish", "bias_relu",
    "split4", "concat4", "fused_lstm_gates", "fused_lstm_gates_ref", "float_cast", "dropout",
    "filter_tensor", "scale_tensor", "ceil_div", "reduce_mul",
    "add_n8", "add_n", "softmax_cross_entropy", "softmax_cross_entropy_ref",
]


def _number(y) -> bool:
    """y is a Python number (as the seed's ops, and torch's, take ``add(x, 2.0)``): it goes to the
    torch op as it is, which computes in x's dtype at fp32 precision (opmath) and rounds once."""
    return isinstance(y, (int, float)) and not isinstance(y, bool)


# --- binary and unary ops: torch, with torch's broadcasting ---------------------------------------
def _broadcasts_into(y: torch.Tensor, x: torch.Tensor) -> bool:
    """y has another shape than x and broadcasts into it (as the seed's bias add: a (1, K) or (K,)
    parameter)."""
    if y.shape == x.shape:
        return False
    try:
        return torch.broadcast_shapes(x.shape, y.shape) == x.shape
    except RuntimeError:
        return False


def _param_or_same(x, y) -> bool:
    """Checks y against x; True when y is a float32 parameter of 16-bit x (a bias or gain that
    broadcasts into x's shape), which the seed's bias add and gain multiply take: the op then
    computes in fp32 and returns x's dtype."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype in HALF \
            and y.dtype == torch.float32 and _broadcasts_into(y, x):
        if y.device != x.device:
            raise ValueError(f"y: expected device {x.device} (as x), got {y.device}")
        return True
    check_same(("x", "y"), x, y)
    return False


def add(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.add(x, y)
    if _param_or_same(x, y):
        return torch.add(x.float(), y).to(x.dtype)
    return torch.add(x, y)


def multiply(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.mul(x, y)
    if _param_or_same(x, y):
        return torch.mul(x.float(), y).to(x.dtype)
    return torch.mul(x, y)


def subtract(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.sub(x, y)
    check_same(("x", "y"), x, y)
    return torch.sub(x, y)


def divide(x, y):
    """x / y; 16-bit inputs are divided in fp32 and rounded once (their gradients too)."""
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.div(x, y)
    check_same(("x", "y"), x, y)
    if x.dtype in HALF:
        return torch.div(x.float(), y.float()).to(x.dtype)
    return torch.div(x, y)


def maximum(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.clamp_min(x, y)
    check_same(("x", "y"), x, y)
    return torch.maximum(x, y)


def minimum(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.clamp_max(x, y)
    check_same(("x", "y"), x, y)
    return torch.minimum(x, y)


def negative(x):
    return torch.neg(x)


def reciprocal(x):
    """1 / x; 16-bit x in fp32, rounded once (its gradient too)."""
    if isinstance(x, torch.Tensor) and x.dtype in HALF:
        return torch.reciprocal(x.float()).to(x.dtype)
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


def gelu(x, alpha: float = 0.044715):
    """The tanh approximation of GELU, as in the seed: 0.5·x·(1 + tanh(√(2/π)·(x + alpha·x³)))."""
    if alpha == 0.044715:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + alpha * x * x * x)))


def swish(x, alpha: float = 1.0):
    """x·σ(alpha·x)."""
    return x * torch.sigmoid(alpha * x)


def fast_gelu(x):
    """x·σ(1.702·x): the seed's fast GELU."""
    return swish(x, alpha=1.702)


def bias_relu(x: torch.Tensor, b: torch.Tensor, axis: int = -1, relu: bool = False, fast_gelu: bool = False,
              atomics: bool = True, bench: int = 0, use_tf: bool = False) -> torch.Tensor:
    """y = act(x + b), b broadcast along the feature ``axis`` of x. The seed's signature.

    Args:
        x: activations of any rank; ``axis`` (negative counts from the end) is the feature axis,
            e.g. (N, K) with axis=-1 or (K, N) with axis=0.
        b: K elements of any shape ((K,), (1, K), (K, 1)); x's dtype, or float32 with 16-bit x
            (then computed in fp32, returned in x's dtype).
        relu: act is ReLU. fast_gelu: act is x·σ(1.702x). Neither: the identity (plain bias add).
        atomics, bench, use_tf: the seed's kernel-tuning and benchmarking switches; accepted so
            seed code runs unchanged, and without effect (the result is the same either way).
    """
    check_tensor("x", x)
    if relu and fast_gelu:
        raise ValueError("relu, fast_gelu: expected at most one of them, got both")
    axis = check_axis("axis", axis, x.dim())
    b = check_param("b", b, x, x.shape[axis])
    shape = [1] * x.dim()
    shape[axis] = -1
    y = x + b.view(shape)                                     # fp32 when b is fp32 master params
    if relu:
        y = torch.relu(y)
    elif fast_gelu:
        y = y * torch.sigmoid(1.702 * y)
    return y.to(x.dtype)


# --- casts, filters, dropout, sums --------------------------------------------------------------------
# The seed's float_cast and filter_tensor have gradients that are no derivative of their forward (a
# rounding through dx_dtype; the filter applied to dy): each is a kernel_op, whose backward is written
# once for the custom op (traced calls) and its eager Function.
def _cast(x: torch.Tensor, dtype: torch.dtype, dx_dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, a copy even where the dtype is x's already (an op returns no alias of its input)."""
    return x.to(dtype, copy=True)


def _cast_setup(ctx, inputs, output):
    ctx.dx_dtype = inputs[2]


def _cast_grads(ctx, bwd, dy):
    return dy.to(ctx.dx_dtype), None, None


_float_cast = kernel_op("bstrain::float_cast", _cast, ref=None, fake=lambda x, dtype, dx_dtype: torch.empty_like(
    x, dtype=dtype), setup=_cast_setup, backward=_cast_grads)
_FloatCast = _float_cast.function                           # the eager Function (its old name)


def float_cast(x: torch.Tensor, dtype: torch.dtype, dx_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Casts x to ``dtype``; the backward casts the gradient to ``dx_dtype`` (default: x's dtype).

    Unlike TensorFlow, PyTorch's autograd always hands x its gradient in x's own dtype, so a
    dx_dtype other than x's only changes the rounding the gradient passes through on the way.
    """
    check_tensor("x", x)
    for name, dt in (("dtype", dtype), ("dx_dtype", dx_dtype)):
        if dt is not None and dt not in FLOATS:
            raise TypeError(f"{name}: expected a floating torch.dtype, got {dt!r}")
    if dx_dtype in (None, x.dtype, dtype):       # no rounding beside .to's own: torch's cast and its backward
        return x.to(dtype)
    return _float_cast(x, dtype, dx_dtype)


def _filter(x: torch.Tensor, scale: float, saturate: float, zero_infs: bool, zero_nans: bool) -> torch.Tensor:
    """The seed's filter: infs and/or NaNs zeroed, then x·scale clamped to ±saturate (0: no clamp)."""
    if zero_infs:
        x = torch.where(torch.isinf(x), 0.0, x)
    if zero_nans:
        x = torch.nan_to_num(x, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    x = x * scale
    return x.clamp(-saturate, saturate) if saturate else x


def _filter_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _filter_grads(ctx, bwd, dy):
    return _filter(dy, *ctx.args), None, None, None, None     # the seed sanitises gradients too


_filter_tensor = kernel_op("bstrain::filter_tensor", _filter, ref=None, fake=lambda x, *args: torch.empty_like(x),
                           setup=_filter_setup, backward=_filter_grads)


def filter_tensor(x: torch.Tensor, scale: float = 1.0, saturate: float = 0.0, zero_infs: bool = False,
                  zero_nans: bool = False) -> torch.Tensor:
    """The seed's filter_tensor: y = clamp(x·scale, ±saturate) (no clamp when saturate is 0), with
    infs and/or NaNs zeroed first. ``saturate=65504.0`` saturates fp16 infinities. As in the seed,
    the backward applies the same filter to the gradient."""
    check_tensor("x", x)
    return _filter_tensor(x, float(scale), float(saturate), bool(zero_infs), bool(zero_nans))


def scale_tensor(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """filter_tensor with scaling only."""
    return filter_tensor(x, scale)


def ceil_div(x: int, y: int) -> int:
    """⌈x / y⌉ for integers (the seed's utility)."""
    return -(-x // y)


def reduce_mul(vals, init=1):
    """The product of ``vals`` (the seed's utility)."""
    return functools.reduce(lambda a, b: a * b, vals, init)


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


def _mask_shape(mask_shape, x: torch.Tensor) -> tuple[int, ...]:
    """The shape the keep mask is drawn at: x's, or the seed's broadcastable ``mask_shape``."""
    if mask_shape is None or len(mask_shape) == 0:
        return tuple(x.shape)
    shape = tuple(int(m) for m in mask_shape)
    if len(shape) != x.dim() or any(m not in (1, d) for m, d in zip(shape, x.shape)):
        raise ValueError(f"mask_shape: expected {x.dim()} dims, each 1 or x's size (x {tuple(x.shape)}), "
                         f"got {tuple(mask_shape)}")
    return shape


def dropout(x: torch.Tensor, keep_prob: float, mask: torch.Tensor | None = None, mask_shape=None, *,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverted dropout: y = x·m/keep_prob. Returns (y, mask). The seed's signature.

    Args:
        keep_prob: probability of keeping an element, in (0, 1].
        mask: a mask returned by an earlier call: the same drop again (e.g. when a layer is
            recomputed). Bit-packed uint8, one bit per mask element.
        mask_shape: draw the mask at this shape and broadcast it over x: one decision per row
            ``(N, 1)``, per channel ``(1, C)``, and so on. Same rank as x; each dim 1 or x's.
        generator: torch.Generator for the draw (default: torch's global one).
    """
    check_tensor("x", x)
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob: expected a value in (0, 1], got {keep_prob}")
    shape = _mask_shape(mask_shape, x)
    n = math.prod(shape)
    if mask is None:
        keep = torch.rand(shape, device=x.device, generator=generator) < keep_prob
        mask = _pack_bits(keep)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.uint8 or mask.numel() != (n + 7) // 8 \
                or mask.device != x.device:
            raise ValueError(f"mask: expected a uint8 tensor of {(n + 7) // 8} bytes on {x.device} (bit-packed, "
                             f"for a mask of {n} elements), got {getattr(mask, 'dtype', type(mask).__name__)} "
                             f"of {getattr(mask, 'numel', lambda: '?')()} on {getattr(mask, 'device', '?')}")
        keep = _unpack_bits(mask, n).view(shape)
    return x * (keep.to(x.dtype) * (1.0 / keep_prob)), mask


def add_n8(xs) -> torch.Tensor:
    """Sums 1 to 8 tensors of one shape, dtype and device."""
    xs = list(xs)
    if not 1 <= len(xs) <= 8:
        raise ValueError(f"xs: expected 1 to 8 tensors, got {len(xs)}")
    check_same(tuple(f"xs[{i}]" for i in range(len(xs))), *xs)
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


# the seed's name= (a TensorFlow op name) is accepted and ignored
for _fn in ("add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square", "sqrt",
            "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "swish", "fast_gelu", "float_cast", "add_n8",
            "add_n"):
    globals()[_fn] = ignores("name")(globals()[_fn])
del _fn
