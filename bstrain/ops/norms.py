"""Layer norm and batch norm, seed-compatible.

``layer_norm`` on the common case (features last, no ReLU, one segment) is
``torch.nn.functional.layer_norm``. The seed's other cases (features on axis 0, a fused ReLU,
several independently normalised segments) run a Triton kernel on CUDA where it measurably beats
``torch.compile`` (scripts/bench_ops.py), else :func:`layer_norm_ref`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bstrain.ops.ew import _check_same, _check_tensor, _use_kernel

__all__ = ["layer_norm", "layer_norm_ref", "batch_norm", "batch_norm_inference"]


def _check_layer_norm(x, g, b, axis, segments) -> int:
    _check_same(("x", "g", "b"), x, g, b)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D (N, C) or (C, N) tensor, got shape {tuple(x.shape)}")
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 (features first, (C, N)) or 1 ((N, C)), got {axis!r}")
    C = x.shape[axis]
    for name, t in (("g", g), ("b", b)):
        if tuple(t.shape) != (C,):
            raise ValueError(f"{name}: expected shape ({C},) for x {tuple(x.shape)} on axis {axis}, "
                             f"got {tuple(t.shape)}")
    if not isinstance(segments, int) or segments < 1 or C % segments:
        raise ValueError(f"segments: expected a positive divisor of the {C} features, got {segments!r}")
    return C


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


def layer_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, axis: int = 1, epsilon: float = 1e-6,
               relu: bool = False, segments: int = 1) -> torch.Tensor:
    """The seed's layer norm.

    Args:
        x: (N, C) with axis=1, or (C, N) with axis=0 (the feature axis is normalised).
        g, b: (C,) gain and bias.
        relu: apply ReLU to the output (fused).
        segments: normalise each of ``segments`` equal slices of the C features independently
            (e.g. the four LSTM gates); g and b still span all C.
    Returns a tensor like x. Statistics are computed in fp32.
    """
    _check_layer_norm(x, g, b, axis, segments)
    if axis == 1 and not relu and segments == 1:
        return F.layer_norm(x, (x.shape[1],), g, b, eps=epsilon)
    if _use_kernel(x):
        from bstrain.kernels.norms import MAX_SEGMENT
        if x.shape[axis] // segments <= MAX_SEGMENT:
            return _LayerNorm.apply(x, g, b, axis, float(epsilon), bool(relu), segments)
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


def _check_batch_norm(x, *params) -> int:
    _check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x: expected (N, C, ...) like NCHW or NCDHW, got shape {tuple(x.shape)}")
    C = x.shape[1]
    for name, t in zip(("g", "b", "mean", "var"), params):
        if name in ("mean", "var") and t.dtype == torch.float32:
            _check_tensor(name, t)                      # batch_norm's fp32 statistics are welcome
            if t.device != x.device:
                raise ValueError(f"{name}: expected device {x.device} (as x), got {t.device}")
        else:
            _check_same(("x", name), x, t)
        if tuple(t.shape) != (C,):
            raise ValueError(f"{name}: expected shape ({C},), got {tuple(t.shape)}")
    return C


def batch_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, epsilon: float = 1e-6):
    """Training-mode batch norm over N and the spatial axes of NC(D)HW.

    Returns (y, mean, var): the (C,) batch mean and (biased) variance, as the seed does, for the
    caller's running averages.
    """
    _check_batch_norm(x, g, b)
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.to(torch.promote_types(x.dtype, torch.float32)), dim=dims, correction=0)
    y = F.batch_norm(x, None, None, g, b, training=True, eps=epsilon)
    return y, mean.detach(), var.detach()


def batch_norm_inference(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, mean: torch.Tensor,
                         var: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Batch norm with given (C,) statistics, for NC(D)HW."""
    _check_batch_norm(x, g, b, mean, var)
    if x.device.type == "cpu":                 # the CPU kernel wants statistics in x's dtype
        mean, var = mean.to(x.dtype), var.to(x.dtype)
    return F.batch_norm(x, mean, var, g, b, training=False, eps=epsilon)
