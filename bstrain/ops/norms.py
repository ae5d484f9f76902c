"""Layer norm and batch norm, seed-compatible.

``layer_norm`` on the common case (features last, no ReLU, one segment, parameters in x's dtype)
is ``torch.nn.functional.layer_norm``. The seed's other cases (features on axis 0, a fused ReLU,
several independently normalised segments, fp32 parameters with 16-bit x) run a Triton kernel
on CUDA where it measurably beats ``torch.compile`` (scripts/bench/bench_ops.py), else
:func:`layer_norm_ref`.

In this file's order: the reference → the kernel pair, from which :func:`~bstrain.ops._dispatch.kernel_op`
makes the custom ops ``torch.ops.bstrain.layer_norm``, ``layer_norm_bwd`` and ``layer_norm_mul_bwd``
(fake, autograd) and the eager ``autograd.Function`` → the seed API.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._checks import KERNEL_FLOATS, check_axis, check_param, check_tensor, use_kernels
from bstrain.ops._dispatch import kernel_op
from bstrain.ops.tables import eager

__all__ = ["layer_norm", "layer_norm_ref", "batch_norm", "batch_norm_inference"]


# --- reference --------------------------------------------------------------------------------------
def _groups(x: Tensor, axis: int) -> Tensor:
    """(groups, C) view of a 2-D x with features on ``axis``."""
    return x if axis == 1 else x.t()


def layer_norm_stats_ref(x: Tensor, axis: int, eps: float, segments: int) -> tuple[Tensor, Tensor]:
    """(mean, rstd), each (groups, segments), in fp32 (fp64 for fp64 x)."""
    xr = _groups(x, axis)
    if not xr.shape[0]:                                   # no rows: empty statistics (no var_mean warning)
        empty = xr.new_empty((0, segments), dtype=torch.promote_types(x.dtype, torch.float32))
        return empty, empty.clone()
    xs = xr.reshape(xr.shape[0], segments, xr.shape[1] // segments).to(torch.promote_types(x.dtype, torch.float32))
    var, mean = torch.var_mean(xs, dim=-1, correction=0)
    return mean, torch.rsqrt(var + eps)


def layer_norm_ref(x, g, b, axis: int = 1, epsilon: float = 1e-6, relu: bool = False, segments: int = 1,
                   mul=None):
    """PyTorch layer norm of a 2-D x over the feature axis, per segment, with optional ReLU, times
    ``mul`` (a tensor like x) if given: the CPU path and the tests' oracle. Statistics and math in
    fp32 (fp64 for fp64 x); the result in x's dtype."""
    mean, rstd = layer_norm_stats_ref(x, axis, epsilon, segments)
    xr = _groups(x, axis)
    xhat = ((xr.reshape(xr.shape[0], segments, xr.shape[1] // segments).to(mean.dtype) - mean[..., None]) * rstd[..., None])
    y = xhat.reshape(xr.shape) * g.to(mean.dtype) + b.to(mean.dtype)
    y = torch.relu(y) if relu else y
    if mul is not None:
        y = y * _groups(mul, axis).to(mean.dtype)
    y = y.to(x.dtype)
    return y if axis == 1 else y.t()


def layer_norm_bwd_ref(dy, x, g, b, mean, rstd, axis: int, relu: bool, segments: int, mul=None):
    """(dx like x, dg, db, dm like mul or None) of :func:`layer_norm_ref`, by the formulas (the
    custom ops' CPU backward runs below autograd)."""
    work = mean.dtype
    xr, dyr = _groups(x, axis).to(work), _groups(dy, axis).to(work)
    n, c = xr.shape
    xhat = ((xr.reshape(n, segments, c // segments) - mean[..., None]) * rstd[..., None]).reshape(n, c)
    gw = g.to(work)
    if relu:
        dyr = dyr * ((xhat * gw + b.to(work)) > 0)
    dm = None
    if mul is not None:
        dm = (dyr * (xhat * gw + b.to(work))).to(mul.dtype)
        dm = (dm if axis == 1 else dm.t()).contiguous()
        dyr = dyr * _groups(mul, axis).to(work)
    dg, db = (dyr * xhat).sum(0), dyr.sum(0)
    dxhat = (dyr * gw).reshape(n, segments, c // segments)
    xh = xhat.reshape(n, segments, c // segments)
    dx = (dxhat - dxhat.mean(-1, keepdim=True) - xh * (dxhat * xh).mean(-1, keepdim=True)) * rstd[..., None]
    dx = dx.reshape(n, c).to(x.dtype)
    return (dx if axis == 1 else dx.t()).contiguous(), dg.to(g.dtype), db.to(b.dtype), dm


def _ln_fwd_ref(x: Tensor, g: Tensor, b: Tensor, axis: int, eps: float, relu: bool, segments: int,
                mul: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    mean, rstd = layer_norm_stats_ref(x, axis, eps, segments)
    return layer_norm_ref(x, g, b, axis, eps, relu, segments, mul).contiguous(), mean, rstd


# --- kernel pair: torch.ops.bstrain.layer_norm, layer_norm_bwd and layer_norm_mul_bwd, and their eager Function
def _check_ln(x: Tensor, g: Tensor, b: Tensor, axis: int, segments: int, mul: Tensor | None = None,
              relu: bool = False) -> None:
    """The kernel's contract: x contiguous 2-D, features on axis 0 or 1 splitting into segments
    of at most MAX_SEGMENT; g and b (C,) contiguous on x's device; mul None or contiguous like x
    (and no relu with it)."""
    from bstrain.kernels.norms import MAX_SEGMENT
    if x.dim() != 2 or axis not in (0, 1) or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous 2-D tensor with features on axis 0 or 1, got shape "
                         f"{tuple(x.shape)}, axis {axis}")
    if x.dtype not in KERNEL_FLOATS:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    C = x.shape[axis]
    if segments < 1 or C % segments or C // segments > MAX_SEGMENT:
        raise ValueError(f"segments: expected a divisor of the {C} features into segments of at most "
                         f"{MAX_SEGMENT}, got {segments}")
    for name, p in (("g", g), ("b", b)):
        if p.shape != (C,) or not p.is_contiguous() or p.device != x.device:
            raise ValueError(f"{name}: expected a contiguous ({C},) tensor on {x.device}, got "
                             f"{tuple(p.shape)} on {p.device}")
    if mul is not None:
        if relu:
            raise ValueError("mul: expected no relu with a multiplicative operand, got relu=True")
        if mul.dtype not in KERNEL_FLOATS:
            raise TypeError(f"mul: expected float32, float16 or bfloat16, got {mul.dtype}")
        if mul.shape != x.shape or not mul.is_contiguous() or mul.device != x.device:
            raise ValueError(f"mul: expected a contiguous {tuple(x.shape)} tensor on {x.device} (as x), got "
                             f"{tuple(mul.shape)} on {mul.device}")


def _ln_forward(x: Tensor, g: Tensor, b: Tensor, axis: int, eps: float, relu: bool, segments: int,
                mul: Tensor | None = None, *, check: bool = True, group=None) -> tuple[Tensor, Tensor, Tensor]:
    """x: contiguous (N, C) (axis=1) or (C, N) (axis=0); g, b: (C,); mul: None, or a contiguous
    tensor like x (any float dtype, not with relu) to multiply the output by. Returns (y, mean,
    rstd); the statistics are (groups, segments) fp32. ``check=False``: the caller has checked the
    arguments; ``group``: a ParamGradGroup for the backward (eager calls; ``ctx.hints``)."""
    from bstrain.kernels.norms import layer_norm_forward
    if check:
        _check_ln(x, g, b, axis, segments, mul, relu)
    return layer_norm_forward(x, g, b, axis, eps, relu, segments, mul)


def _ln_bwd_kernel(dy, x, g, b, mul, mean, rstd, axis, relu, segments, eager_call, workspace):
    """(dx, dg, db, dm or None). Eager calls skip the checks and may take dg and db as views of one
    sum, or have them added into a ParamGradGroup's workspace (then None)."""
    from bstrain.kernels.norms import layer_norm_backward
    if not eager_call:
        _check_ln(x, g, b, axis, segments, mul, relu)
        if dy.shape != x.shape:
            raise ValueError(f"dy: expected shape {tuple(x.shape)} (as x), got {tuple(dy.shape)}")
    dx, dg, db, dm = layer_norm_backward(dy.contiguous(), x, g, b, mean, rstd, axis, relu, segments, mul, workspace)
    if not eager_call and dg.untyped_storage().data_ptr() == db.untyped_storage().data_ptr():
        db = db.clone()                                 # views of one sum: an op's outputs may not share storage
    return dx, dg, db, dm


def _ln_backward(dy: Tensor, x: Tensor, g: Tensor, b: Tensor, mean: Tensor, rstd: Tensor, axis: int,
                 relu: bool, segments: int, *, eager_call: bool = False,
                 workspace=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dg, db in g's and b's dtypes)."""
    return _ln_bwd_kernel(dy, x, g, b, None, mean, rstd, axis, relu, segments, eager_call, workspace)[:3]


def _ln_mul_backward(dy: Tensor, x: Tensor, g: Tensor, b: Tensor, mul: Tensor, mean: Tensor, rstd: Tensor,
                     axis: int, segments: int, *, eager_call: bool = False,
                     workspace=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx like x, dg, db in g's and b's dtypes, dmul like mul)."""
    return _ln_bwd_kernel(dy, x, g, b, mul, mean, rstd, axis, False, segments, eager_call, workspace)


def _ln_fake(x, g, b, axis, eps, relu, segments, mul=None):
    groups = x.shape[1 - axis]
    stats = x.new_empty((groups, segments), dtype=torch.promote_types(x.dtype, torch.float32))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.clone()


def _ln_setup(ctx, inputs, output):
    x, g, b, axis, eps, relu, segments, mul = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, g, b, mul, mean, rstd)
    ctx.config = (axis, relu, segments)
    ctx.mark_non_differentiable(mean, rstd)


def _ln_grads(ctx, bwd, dy, _dmean, _drstd):
    """With a ParamGradGroup (eager calls), g and b are the group's views and the backward kernel
    adds dg and db into the group's workspace."""
    x, g, b, mul, mean, rstd = ctx.saved_tensors
    axis, relu, segments = ctx.config
    group = ctx.hints.get("group")
    workspace = None if group is None else lambda shape: group.workspace(shape, x.device)
    plain, with_mul = bwd
    if mul is None:
        dx, dg, db = plain(dy, x, g, b, mean, rstd, axis, relu, segments, eager_call=True, workspace=workspace)
        return dx, dg, db, None, None, None, None, None
    dx, dg, db, dm = with_mul(dy, x, g, b, mul, mean, rstd, axis, segments, eager_call=True, workspace=workspace)
    return dx, dg, db, None, None, None, None, dm


_ln_bwd = kernel_op(
    "bstrain::layer_norm_bwd", _ln_backward,
    ref=lambda dy, x, g, b, mean, rstd, axis, relu, segments:
        layer_norm_bwd_ref(dy, x, g, b, mean, rstd, axis, relu, segments)[:3],
    fake=lambda dy, x, g, b, mean, rstd, axis, relu, segments: (
        torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(g), torch.empty_like(b)))
_ln_mul_bwd = kernel_op(
    "bstrain::layer_norm_mul_bwd", _ln_mul_backward,
    ref=lambda dy, x, g, b, mul, mean, rstd, axis, segments:
        layer_norm_bwd_ref(dy, x, g, b, mean, rstd, axis, False, segments, mul),
    fake=lambda dy, x, g, b, mul, mean, rstd, axis, segments: (
        torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(g), torch.empty_like(b),
        torch.empty_like(mul, memory_format=torch.contiguous_format)))
_layer_norm = kernel_op("bstrain::layer_norm", _ln_forward, ref=_ln_fwd_ref, fake=_ln_fake, setup=_ln_setup,
                        backward=_ln_grads, bwd=(_ln_bwd, _ln_mul_bwd))


# --- seed API -------------------------------------------------------------------------------------------
def layer_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, axis: int = 1, segments: int = 1,
               epsilon: float = 1e-6, relu: bool = False, atomics: bool = True, bench: int = 0,
               use_tf: bool = False, *, mul: torch.Tensor | None = None, grad_group=None,
               backend: str = "auto") -> torch.Tensor:
    """The seed's layer norm, with the seed's signature.

    Args:
        x: activations of any rank; ``axis`` is the feature axis that is normalised (negative
            counts from the end): (N, C) with axis=1 or -1, (C, N) with axis=0, (B, T, C) with
            axis=-1, ...
        g, b: gain and bias, C elements of any shape ((C,), (1, C), (C, 1)); x's dtype, or
            float32 with 16-bit x.
        segments: normalise each of ``segments`` equal slices of the C features independently
            (e.g. the four LSTM gates); g and b still span all C.
        relu: apply ReLU to the output (fused).
        atomics, bench, use_tf: the seed's tuning switches; accepted, without effect.
        mul: a tensor shaped like x (any float dtype) to multiply the output by, fused:
            y = LN(x)·mul, rounded once to x's dtype (not with relu).
        grad_group: a :class:`bstrain.ops.grouping.ParamGradGroup` of (g, b), made once per
            sequence by a model that calls this at every timestep: the eager kernel path then adds
            dg and db into it instead of handing them to autograd at every step. Other paths
            ignore it.
        backend: "auto" (the kernel on CUDA where it pays, PyTorch otherwise), "triton" (the
            kernel; on CPU under TRITON_INTERPRET=1) or "torch".
    Returns a tensor like x (same shape and dtype). Statistics are computed in fp32.
    """
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    axis = check_axis("axis", axis, x.dim())
    C = x.shape[axis]
    if C == 0:
        raise ValueError(f"x: expected at least one feature on axis {axis}, got shape {tuple(x.shape)}")
    g, b = check_param("g", g, x, C), check_param("b", b, x, C)
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1 or C % segments:
        raise ValueError(f"segments: expected a positive divisor of the {C} features, got {segments!r}")
    if mul is not None:
        _check_mul(x, mul, relu)
    if grad_group is not None and not grad_group.matches((g, b), (0, 1)):
        raise ValueError("grad_group: expected a group of these g and b (param_grad_group(g, b)), got one of "
                         "other parameters")
    kernel = use_kernels(x, backend)
    if x.dim() == 2:                                           # (N, C) or (C, N) as they are: no views
        return _layer_norm_2d(x, g, b, axis, epsilon, relu, segments, kernel, mul, grad_group)
    if axis == 0:                                              # features first: (C, N)
        def to_2d(t):
            return t.reshape(C, -1)
    else:                                                      # features last: (N, C)
        def to_2d(t):
            return (t if axis == t.dim() - 1 else t.movedim(axis, -1)).reshape(-1, C)
    y = _layer_norm_2d(to_2d(x), g, b, 1 if axis else 0, epsilon, relu, segments, kernel,
                       None if mul is None else to_2d(mul), grad_group)
    if axis == 0 or axis == x.dim() - 1:
        return y.reshape(x.shape)
    return y.reshape(x.movedim(axis, -1).shape).movedim(-1, axis)


def _check_mul(x: torch.Tensor, mul, relu: bool) -> None:
    check_tensor("mul", mul)
    if mul.shape != x.shape or mul.device != x.device:
        raise ValueError(f"mul: expected shape {tuple(x.shape)} on {x.device} (as x), got {tuple(mul.shape)} on "
                         f"{mul.device}")
    if relu:
        raise ValueError("mul: expected no relu with a multiplicative operand, got relu=True")


def _layer_norm_2d(x, g, b, axis: int, epsilon: float, relu: bool, segments: int, kernel: bool, mul=None,
                   grad_group=None) -> torch.Tensor:
    """x: (N, C) for axis=1 or (C, N) for axis=0; g, b: (C,); mul: None or like x."""
    if mul is None and axis == 1 and not relu and segments == 1 and (g.dtype == x.dtype or not kernel):
        if g.dtype == x.dtype:
            return F.layer_norm(x, (x.shape[1],), g, b, eps=epsilon)
        return F.layer_norm(x.float(), (x.shape[1],), g, b, eps=epsilon).to(x.dtype)  # fp32 params
    if kernel and (mul is None or mul.dtype in KERNEL_FLOATS):
        # fp32 params with 16-bit x too: one kernel instead of three casts around torch's
        from bstrain.kernels.norms import MAX_SEGMENT
        if x.shape[axis] // segments <= MAX_SEGMENT:
            if grad_group is not None and eager(x):     # (traced calls leave the group out)
                g, b = grad_group.views
            return _layer_norm(x.contiguous(), g.contiguous(), b.contiguous(), axis, float(epsilon), bool(relu),
                               segments, None if mul is None else mul.contiguous(), check=False, group=grad_group)[0]
    return layer_norm_ref(x, g, b, axis, epsilon, relu, segments, mul)


def _check_batch_norm(x, **params) -> list[torch.Tensor]:
    """x: (N, C, ...); each param C elements of any shape, x's dtype or fp32 with 16-bit x."""
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x: expected (N, C, ...) like NCHW or NCDHW, got shape {tuple(x.shape)}")
    return [check_param(name, t, x, x.shape[1]) for name, t in params.items()]


def _in_param_dtype(x: torch.Tensor, params) -> torch.Tensor:
    """x in fp32 when fp32 params meet 16-bit x (the seed's mixed precision), else x."""
    return x.float() if any(p.dtype != x.dtype for p in params) else x


def batch_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, epsilon: float = 1e-6):
    """Training-mode batch norm over N and the spatial axes of NC(D)HW.

    g, b: C elements, x's dtype or fp32. Returns (y like x, mean, var): the (C,) batch mean and
    (biased) variance in fp32 (float64 for float64 x), as the seed does, for the caller's
    running averages.
    """
    g, b = _check_batch_norm(x, g=g, b=b)
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.to(torch.promote_types(x.dtype, torch.float32)), dim=dims, correction=0)
    y = F.batch_norm(_in_param_dtype(x, (g, b)), None, None, g, b, training=True, eps=epsilon)
    return y.to(x.dtype), mean.detach(), var.detach()


def batch_norm_inference(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, m: torch.Tensor | None = None,
                         v: torch.Tensor | None = None, epsilon: float = 1e-6, *, mean: torch.Tensor | None = None,
                         var: torch.Tensor | None = None) -> torch.Tensor:
    """Batch norm with given statistics for NC(D)HW; g, b, m (mean), v (variance): C elements
    each, the seed's names (``mean=`` and ``var=`` still work, deprecated)."""
    if mean is not None or var is not None:
        warnings.warn("batch_norm_inference: mean= and var= are deprecated; use the seed's m= and v=",
                      DeprecationWarning, stacklevel=2)
        if (mean is not None and m is not None) or (var is not None and v is not None):
            raise TypeError("batch_norm_inference: m and mean (or v and var) name the same argument; pass one")
        m = m if mean is None else mean
        v = v if var is None else var
    if m is None or v is None:
        raise TypeError("batch_norm_inference: expected the statistics m (mean) and v (variance), got "
                        f"{'none' if m is None and v is None else 'only one'}")
    mean, var = m, v
    params = _check_batch_norm(x, g=g, b=b, mean=mean, var=var)
    xc = _in_param_dtype(x, params)
    g, b, mean, var = (p.to(xc.dtype) for p in params)
    return F.batch_norm(xc, mean, var, g, b, training=False, eps=epsilon).to(x.dtype)
