"""Layer norm and batch norm, seed-compatible.

``layer_norm`` on the common case (features last, no ReLU, one segment, parameters in x's dtype)
is ``torch.nn.functional.layer_norm``. The seed's other cases (features on axis 0, a fused ReLU,
several independently normalised segments, fp32 parameters with 16-bit x) run a Triton kernel
on CUDA where it measurably beats ``torch.compile`` (scripts/bench_ops.py), else
:func:`layer_norm_ref`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bstrain.ops.ew import _check_tensor, _use_kernel, check_axis, check_param
from bstrain.ops.library import eager

__all__ = ["layer_norm", "layer_norm_ref", "batch_norm", "batch_norm_inference"]


def layer_norm_ref(x, g, b, axis: int = 1, epsilon: float = 1e-6, relu: bool = False, segments: int = 1):
    """PyTorch layer norm over the feature axis, per segment, with optional ReLU."""
    xr = x if axis == 1 else x.t()                                # (N, C)
    n, c = xr.shape
    work = torch.promote_types(x.dtype, torch.float32)                # fp32 statistics for 16-bit x
    xs = xr.reshape(n, segments, c // segments).to(work)
    y = F.layer_norm(xs, (c // segments,), eps=epsilon).reshape(n, c)
    y = (y * g.to(work) + b.to(work)).to(x.dtype)
    if relu:
        y = torch.relu(y)
    return y if axis == 1 else y.t()


def layer_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, axis: int = 1, segments: int = 1,
               epsilon: float = 1e-6, relu: bool = False, atomics: bool = True, bench: int = 0,
               use_tf: bool = False) -> torch.Tensor:
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
    Returns a tensor like x (same shape and dtype). Statistics are computed in fp32.
    """
    _check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    axis = check_axis("axis", axis, x.dim())
    C = x.shape[axis]
    if C == 0:
        raise ValueError(f"x: expected at least one feature on axis {axis}, got shape {tuple(x.shape)}")
    g, b = check_param("g", g, x, C), check_param("b", b, x, C)
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1 or C % segments:
        raise ValueError(f"segments: expected a positive divisor of the {C} features, got {segments!r}")
    if x.dim() == 2:                                           # (N, C) or (C, N) as they are: no views
        return _layer_norm_2d(x, g, b, axis, epsilon, relu, segments)
    if axis == 0:                                              # features first: (C, N)
        return _layer_norm_2d(x.reshape(C, -1), g, b, 0, epsilon, relu, segments).reshape(x.shape)
    moved = x if axis == x.dim() - 1 else x.movedim(axis, -1)  # features last: (N, C)
    y = _layer_norm_2d(moved.reshape(-1, C), g, b, 1, epsilon, relu, segments).reshape(moved.shape)
    return y if moved is x else y.movedim(-1, axis)


def _layer_norm_2d(x, g, b, axis: int, epsilon: float, relu: bool, segments: int) -> torch.Tensor:
    """x: (N, C) for axis=1 or (C, N) for axis=0; g, b: (C,)."""
    kernel = _use_kernel(x)
    if axis == 1 and not relu and segments == 1 and (g.dtype == x.dtype or not kernel):
        if g.dtype == x.dtype:
            return F.layer_norm(x, (x.shape[1],), g, b, eps=epsilon)
        return F.layer_norm(x.float(), (x.shape[1],), g, b, eps=epsilon).to(x.dtype)  # fp32 params
    if kernel:                  # fp32 params with 16-bit x too: one kernel instead of three casts around torch's
        from bstrain.kernels.norms import MAX_SEGMENT
        if x.shape[axis] // segments <= MAX_SEGMENT:
            if eager(x):
                return _LayerNorm.apply(x, g, b, axis, float(epsilon), bool(relu), segments)
            return torch.ops.bstrain.layer_norm(x.contiguous(), g.contiguous(), b.contiguous(), axis, float(epsilon),
                                                bool(relu), segments)[0]
    return layer_norm_ref(x, g, b, axis, epsilon, relu, segments)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, b, axis, epsilon, relu, segments):
        from bstrain.kernels.norms import layer_norm_forward
        x = x.contiguous()
        y, mean, rstd = layer_norm_forward(x, g.contiguous(), b.contiguous(), axis, epsilon, relu, segments)
        ctx.save_for_backward(x, g, b, mean, rstd)
        ctx.config = (axis, relu, segments)
        return y

    @staticmethod
    def backward(ctx, dy):
        from bstrain.kernels.norms import layer_norm_backward
        x, g, b, mean, rstd = ctx.saved_tensors
        axis, relu, segments = ctx.config
        dx, dg, db = layer_norm_backward(dy.contiguous(), x, g.contiguous(), b.contiguous(), mean, rstd,
                                         axis, relu, segments)
        return dx, dg, db, None, None, None, None


def _check_batch_norm(x, **params) -> list[torch.Tensor]:
    """x: (N, C, ...); each param C elements of any shape, x's dtype or fp32 with 16-bit x."""
    _check_tensor("x", x)
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


def batch_norm_inference(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, mean: torch.Tensor,
                         var: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Batch norm with given statistics for NC(D)HW; g, b, mean, var: C elements each."""
    params = _check_batch_norm(x, g=g, b=b, mean=mean, var=var)
    xc = _in_param_dtype(x, params)
    g, b, mean, var = (p.to(xc.dtype) for p in params)
    return F.batch_norm(xc, mean, var, g, b, training=False, eps=epsilon).to(x.dtype)
