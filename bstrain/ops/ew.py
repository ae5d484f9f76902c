"""The seed's elementwise ops, LSTM gates, casts, dropout, add_n8 and softmax cross-entropy.

Plain elementwise ops are torch calls with torch's broadcasting: a hand-written kernel would not
beat torch (or torch.compile) on them. Fused ops whose Triton kernel measurably beats
``torch.compile`` of the same math (scripts/bench_ops.py, benchmarks/ops.md) run that kernel on CUDA
tensors: of the ops here, that is fused_lstm_gates. Everything else, and every CPU tensor, runs
PyTorch.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from bstrain.ops._seed import ignores
from bstrain.ops.tables import eager

__all__ = [
    "add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square",
    "sqrt", "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "fast_gelu", "swish", "bias_relu",
    "split4", "concat4", "fused_lstm_gates", "fused_lstm_gates_ref", "float_cast", "dropout",
    "filter_tensor", "scale_tensor", "ceil_div", "reduce_mul",
    "add_n8", "add_n", "softmax_cross_entropy", "softmax_cross_entropy_ref",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


_BACKENDS = ("auto", "triton", "torch")


def use_kernels(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an op with a Triton kernel runs it on x: the ``backend=`` argument of every such op.

    "auto": on CUDA for fp32/fp16/bf16; "torch": never; "triton": always (on the CPU through
    Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is imported).

    Test-only switch: with BSTRAIN_FORCE_TRITON=1 and TRITON_INTERPRET=1 in the environment, "auto"
    takes the kernels on CPU tensors too, so the test suite can route whole models (whose layers
    call these ops with the default backend) through the interpreted kernels and custom ops.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    floating = x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if backend == "auto":
        return floating and (x.is_cuda or (os.environ.get("BSTRAIN_FORCE_TRITON") == "1"
                                            and os.environ.get("TRITON_INTERPRET") == "1"))
    if not floating:
        raise TypeError(f"x: the Triton backend takes float32, float16 or bfloat16, got {x.dtype}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x: backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a tensor on {x.device}")
    return True


_DTYPE_BOUND = {torch.uint8: 256, torch.uint16: 65536}


def check_index_range(name: str, idx: torch.Tensor, n: int) -> None:
    """ValueError unless every value of ``idx`` lies in [0, n).

    One host sync on CUDA, so it is skipped where the values cannot be read: while a CUDA graph
    is captured, where syncs are reported as errors (``torch.cuda.set_sync_debug_mode``, which
    a graph's last warm-up step sets), and while tracing (torch.compile, export; the indexing op then asserts on the
    device). :func:`as_index` skips it for dtypes whose every value is below n (bytes into a
    256-row table).
    """
    if not eager(idx):
        return
    if idx.numel() and not (idx.is_cuda and (torch.cuda.is_current_stream_capturing()
                                             or torch.cuda.get_sync_debug_mode() == 2)):
        lo, hi = torch.stack(torch.aminmax(idx)).tolist()
        if lo < 0 or hi >= n:
            raise ValueError(f"{name}: expected values in [0, {n}), got [{lo}, {hi}]")


def unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last axis (a copy only if it has another): what the row kernels
    take. Custom-op bodies call it, since a compiler may hand them inputs of any strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")


_HALF = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint16, torch.uint8)


def check_param(name: str, p, x: torch.Tensor, numel: int) -> torch.Tensor:
    """A seed-style parameter (bias, gain, gate bias) of activation x, as a flat (numel,) tensor.

    As in the seed, any shape with ``numel`` elements is accepted ((K,), (1, K), (K, 1), ...), in
    x's dtype or, for fp16/bf16 activations, in float32 (mixed-precision master parameters; the
    op then computes in fp32 and returns x's dtype).
    """
    _check_tensor(name, p)
    if p.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements (shape ({numel},), (1, {numel}) or any shape of "
                         f"that size) for x {tuple(x.shape)}, got shape {tuple(p.shape)}")
    if p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in _HALF):
        raise TypeError(f"{name}: expected dtype {x.dtype} (as x), or float32 with 16-bit x, got {p.dtype}")
    if p.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (as x), got {p.device}")
    return p if p.dim() == 1 else p.reshape(numel)


def check_axis(name: str, axis, ndim: int) -> int:
    """A feature axis of an ndim-D tensor, negative values counted from the end, as 0..ndim-1."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected an int axis in [{-ndim}, {ndim}) for a {ndim}-D x, got {axis!r}")
    return axis % ndim


def as_index(name: str, idx, n: int) -> torch.Tensor:
    """An integer index tensor (int64/32/16, uint16 or uint8, as the seed's) checked to lie in
    [0, n), as int64. uint8 is converted before use: torch would read it as a boolean mask."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int64, int32, int16, uint16 or uint8 tensor, got "
                        f"{getattr(idx, 'dtype', type(idx).__name__)}")
    if _DTYPE_BOUND.get(idx.dtype, n + 1) > n:          # else every value of the dtype is in range
        check_index_range(name, idx.long(), n)
    return idx.long()


def _number(y) -> bool:
    """y is a Python number (as the seed's ops, and torch's, take ``add(x, 2.0)``): it goes to the
    torch op as it is, which computes in x's dtype at fp32 precision (opmath) and rounds once."""
    return isinstance(y, (int, float)) and not isinstance(y, bool)


def _check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    for name, x in zip(names, xs):
        _check_tensor(name, x)
    for name, x in zip(names[1:], xs[1:]):
        if x.dtype != xs[0].dtype:
            raise TypeError(f"{name}: expected dtype {xs[0].dtype} (as {names[0]}), got {x.dtype}")
        if x.device != xs[0].device:
            raise ValueError(f"{name}: expected device {xs[0].device} (as {names[0]}), got {x.device}")


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
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype in _HALF \
            and y.dtype == torch.float32 and _broadcasts_into(y, x):
        if y.device != x.device:
            raise ValueError(f"y: expected device {x.device} (as x), got {y.device}")
        return True
    _check_same(("x", "y"), x, y)
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
    _check_same(("x", "y"), x, y)
    return torch.sub(x, y)


def divide(x, y):
    """x / y; 16-bit inputs are divided in fp32 and rounded once (their gradients too)."""
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.div(x, y)
    _check_same(("x", "y"), x, y)
    if x.dtype in _HALF:
        return torch.div(x.float(), y.float()).to(x.dtype)
    return torch.div(x, y)


def maximum(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.clamp_min(x, y)
    _check_same(("x", "y"), x, y)
    return torch.maximum(x, y)


def minimum(x, y):
    if _number(y) and isinstance(x, torch.Tensor):
        return torch.clamp_max(x, y)
    _check_same(("x", "y"), x, y)
    return torch.minimum(x, y)


def negative(x):
    return torch.neg(x)


def reciprocal(x):
    """1 / x; 16-bit x in fp32, rounded once (its gradient too)."""
    if isinstance(x, torch.Tensor) and x.dtype in _HALF:
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
    _check_tensor("x", x)
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


def _gates_work(c, i, u, f, o, bias):
    """c and the four gate pre-activations (bias added) in the math dtype (fp32 for 16-bit)."""
    work = torch.promote_types(c.dtype, torch.float32)
    gates = [t.to(work) for t in (i, u, f, o)]
    if bias is not None:
        gates = [t + bb.to(work) for t, bb in zip(gates, bias.reshape(4, -1))]
    return c.to(work), gates


def fused_lstm_gates_bwd_ref(c, i, u, f, o, bias, dc_new, dh_new, forget_bias: float):
    """(dc (N, K), dgates (N, 4K) in the order i, u, f, o) of the cell update, by the formulas, in
    c's dtype (math in fp32 for 16-bit inputs)."""
    cw, (gi, gu, gf, go) = _gates_work(c, i, u, f, o, bias)
    si, tu, sf, so = torch.sigmoid(gi), torch.tanh(gu), torch.sigmoid(gf + forget_bias), torch.sigmoid(go)
    t = torch.tanh(cw * sf + si * tu)
    dh = dh_new.to(cw.dtype)
    dcn = dh * so * (1 - t * t) + (dc_new.to(cw.dtype) if dc_new is not None else 0)
    dg = torch.cat([dcn * tu * si * (1 - si), dcn * si * (1 - tu * tu), dcn * cw * sf * (1 - sf),
                    dh * t * so * (1 - so)], dim=1)
    return (dcn * sf).to(c.dtype), dg.to(c.dtype)


# custom ops torch.ops.bstrain.lstm_gates and lstm_gates_bwd (traced calls): CUDA runs the kernels,
# CPU the references
@torch.library.custom_op("bstrain::lstm_gates", mutates_args=())
def _lstm_gates_op(c: torch.Tensor, i: torch.Tensor, u: torch.Tensor, f: torch.Tensor, o: torch.Tensor,
                   bias: torch.Tensor | None, forget_bias: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_c, new_h), (N, K) each, from c and the gates i, u, f, o ((N, K) views, unit feature
    stride); bias: (4K,) or None, added to the gates. The math is fp32 for 16-bit inputs."""
    if c.is_cuda:
        from bstrain.kernels.ew import lstm_gates_forward
        return lstm_gates_forward(c, i, u, f, o, bias, forget_bias)
    cw, gates = _gates_work(c, i, u, f, o, bias)
    new_c, new_h = fused_lstm_gates_ref(cw, *gates, forget_bias=forget_bias)
    return new_c.to(c.dtype), new_h.to(c.dtype)


@_lstm_gates_op.register_fake
def _(c, i, u, f, o, bias, forget_bias):
    return c.new_empty(c.shape), c.new_empty(c.shape)


@torch.library.custom_op("bstrain::lstm_gates_bwd", mutates_args=())
def _lstm_gates_bwd_op(c: torch.Tensor, i: torch.Tensor, u: torch.Tensor, f: torch.Tensor, o: torch.Tensor,
                       bias: torch.Tensor | None, dc_new: torch.Tensor | None, dh_new: torch.Tensor,
                       forget_bias: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dc (N, K), dgates (N, 4K) in the order i, u, f, o), in c's dtype."""
    if c.is_cuda:
        from bstrain.kernels.ew import lstm_gates_backward
        for name, d in (("dc_new", dc_new), ("dh_new", dh_new)):
            if d is not None and d.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(d.shape)}")
        return lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias, forget_bias)
    return fused_lstm_gates_bwd_ref(c, i, u, f, o, bias, dc_new, dh_new, forget_bias)


@_lstm_gates_bwd_op.register_fake
def _(c, i, u, f, o, bias, dc_new, dh_new, forget_bias):
    return c.new_empty(c.shape), c.new_empty((c.shape[0], 4 * c.shape[1]))


def _gates_setup(ctx, inputs, output):
    c, i, u, f, o, bias, forget_bias = inputs
    ctx.save_for_backward(c, i, u, f, o, bias)
    ctx.forget_bias = forget_bias
    ctx.set_materialize_grads(False)


def _dbias(dg: torch.Tensor, bias: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    if bias is None or not needed:
        return None
    dbias = dg.sum(0, dtype=torch.float32)
    return dbias if dbias.dtype == bias.dtype else dbias.to(bias.dtype)


def _gates_backward(ctx, dc_new, dh_new):
    c, i, u, f, o, bias = ctx.saved_tensors
    if dh_new is None:
        dh_new = torch.zeros_like(c)
    dc, dg = _lstm_gates_bwd_op(c, i, u, f, o, bias, dc_new, dh_new, ctx.forget_bias)
    return (dc,) + tuple(dg.chunk(4, dim=1)) + (_dbias(dg, bias, ctx.needs_input_grad[5]), None)


_lstm_gates_op.register_autograd(_gates_backward, setup_context=_gates_setup)


class _LstmGates(torch.autograd.Function):
    """The custom op's kernels without the dispatcher's round trip (eager calls)."""

    @staticmethod
    def forward(ctx, c, bias, forget_bias, i, u, f, o):
        from bstrain.kernels.ew import lstm_gates_forward
        c, i, u, f, o = (t if t.stride(1) == 1 else t.contiguous() for t in (c, i, u, f, o))
        bias = bias.contiguous() if bias is not None else None
        ctx.save_for_backward(c, bias, i, u, f, o)
        ctx.forget_bias = forget_bias
        return lstm_gates_forward(c, i, u, f, o, bias, forget_bias, check=False)

    @staticmethod
    def backward(ctx, dc_new, dh_new):
        from bstrain.kernels.ew import lstm_gates_backward
        c, bias, i, u, f, o = ctx.saved_tensors
        if dh_new is None:
            dh_new = torch.zeros_like(c)
        dc, dg = lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias, ctx.forget_bias, check=False)
        return (dc, _dbias(dg, bias, ctx.needs_input_grad[1]), None) + tuple(dg.chunk(4, dim=1))


def fused_lstm_gates(c: torch.Tensor, *args: torch.Tensor, bias: torch.Tensor | None = None,
                     forget_bias: float = 1.0, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's fused LSTM cell update.

    Gate order (as in the seed): **i, u, f, o** — input gate, update (candidate), forget gate,
    output gate. ``new_c = σ(f + forget_bias)·c + σ(i)·tanh(u)``, ``new_h = σ(o)·tanh(new_c)``.

    Args:
        c: (N, K) cell state.
        *args: one (N, 4K) tensor holding the four gate pre-activations side by side, or four
            (N, K) tensors i, u, f, o.
        bias: 4K elements of any shape ((4K,), (1, 4K), ...), added to the fused gates
            (one-tensor form only); c's dtype, or float32 with 16-bit gates.
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns (new_c, new_h), each (N, K) in c's dtype. The math is fp32 for 16-bit inputs.
    """
    _check_tensor("c", c)
    if len(args) == 1:
        h = args[0]
        _check_same(("c", "h"), c, h)
        if c.dim() != 2 or h.dim() != 2 or h.shape != (c.shape[0], 4 * c.shape[1]):
            raise ValueError(f"h: expected shape (N, 4K) = {(c.shape[0], 4 * c.shape[1])} for c "
                             f"{tuple(c.shape)}, got {tuple(h.shape)}")
        if bias is not None:
            bias = check_param("bias", bias, h, h.shape[1])
        gates = h.chunk(4, dim=1)
    elif len(args) == 4:
        _check_same(("c", "i", "u", "f", "o"), c, *args)
        if c.dim() != 2:
            raise ValueError(f"c: expected a 2-D (N, K) tensor, got shape {tuple(c.shape)}")
        for name, g in zip("iufo", args):
            if g.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(g.shape)}")
        if bias is not None:
            raise ValueError("bias: only supported with the fused (N, 4K) gate tensor")
        gates = args
    else:
        raise ValueError(f"args: expected one (N, 4K) gate tensor or four (N, K) tensors i, u, f, o, "
                         f"got {len(args)} tensors")
    if use_kernels(c, backend):                                              # the kernel adds the bias
        if eager(c):
            return _LstmGates.apply(c, bias, float(forget_bias), *gates)
        c, *gates = (t if t.stride(1) == 1 else t.contiguous() for t in (c, *gates))
        return torch.ops.bstrain.lstm_gates(c, *gates, bias.contiguous() if bias is not None else None,
                                            float(forget_bias))
    if bias is not None:
        gates = (args[0] + bias).chunk(4, dim=1)                             # fp32 with an fp32 bias
    elif c.dtype in _HALF:
        gates = tuple(g.float() for g in gates)
    new_c, new_h = fused_lstm_gates_ref(c.to(gates[0].dtype), *gates, forget_bias=forget_bias)
    return new_c.to(c.dtype), new_h.to(c.dtype)


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


def _filter(x: torch.Tensor, scale, saturate: float, zero_infs: bool, zero_nans: bool) -> torch.Tensor:
    if zero_infs:
        x = torch.where(torch.isinf(x), 0.0, x)
    if zero_nans:
        x = torch.nan_to_num(x, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    x = x * scale
    return x.clamp(-saturate, saturate) if saturate else x


class _FilterTensor(torch.autograd.Function):
    """The seed's filter: the gradient passes through the same filter (it sanitises gradients too)."""

    @staticmethod
    def forward(ctx, x, scale, saturate, zero_infs, zero_nans):
        ctx.args = (scale, saturate, zero_infs, zero_nans)
        return _filter(x, *ctx.args)

    @staticmethod
    def backward(ctx, dy):
        return _filter(dy, *ctx.args), None, None, None, None


def filter_tensor(x: torch.Tensor, scale: float = 1.0, saturate: float = 0.0, zero_infs: bool = False,
                  zero_nans: bool = False) -> torch.Tensor:
    """The seed's filter_tensor: y = clamp(x·scale, ±saturate) (no clamp when saturate is 0), with
    infs and/or NaNs zeroed first. ``saturate=65504.0`` saturates fp16 infinities. As in the seed,
    the backward applies the same filter to the gradient."""
    _check_tensor("x", x)
    return _FilterTensor.apply(x, scale, float(saturate), bool(zero_infs), bool(zero_nans))


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
    _check_tensor("x", x)
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
    """Per-row loss in fp32 (fp64 for fp64 logits): logsumexp(logits) - logits[label]."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction="none")


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Softmax + cross-entropy over the last axis. The seed's signature.

    Args:
        logits: (..., V) fp32/fp16/bf16, any rank >= 1.
        labels: integer class ids (int64/32/16, uint16, uint8), one per row of logits: any shape
            with logits.numel() // V elements.
    Returns the fp32 loss (fp64 for fp64 logits) of shape logits.shape[:-1]. Works in fp32 internally, so fp16/bf16
    logits of vocabularies up to 65,536 (and beyond) never overflow; the gradient comes back in
    the logits' dtype. On CUDA the fused kernel of :func:`bstrain.ops.cross_entropy.cross_entropy`
    (no fp32 copy of the logits), elsewhere PyTorch's cross_entropy.
    """
    _check_tensor("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits: expected at least 1 dim (..., V), got a scalar")
    rows = logits.shape[:-1]
    if not isinstance(labels, torch.Tensor) or labels.numel() != math.prod(rows):
        raise ValueError(f"logits, labels: expected labels with one id per row of logits "
                         f"({math.prod(rows)} for logits {tuple(logits.shape)}), got "
                         f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if labels.device != logits.device:
        raise ValueError(f"labels: expected device {logits.device} (as logits), got {labels.device}")
    labels = as_index("labels", labels, logits.shape[-1])
    if use_kernels(logits):                      # the fused kernel (bstrain.ops.cross_entropy)
        from bstrain.ops.cross_entropy import cross_entropy
        return cross_entropy(logits, labels.reshape(rows))
    flat = softmax_cross_entropy_ref(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return flat.reshape(rows)


# the seed's name= (a TensorFlow op name) is accepted and ignored
for _fn in ("add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square", "sqrt",
            "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "swish", "fast_gelu", "float_cast", "add_n8",
            "add_n", "fused_lstm_gates"):
    globals()[_fn] = ignores("name")(globals()[_fn])
del _fn
