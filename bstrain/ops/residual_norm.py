"""The pre-LN residual step, fused: ``h = x + residual (+ residual_bias)``, ``y = layer_norm(h)``, one
kernel each way on CUDA (:mod:`bstrain.kernels.residual_norm`).

A pre-LN transformer block reads its input through a layer norm and adds its output back to the
stream; run as torch ops under autocast that is an fp32 add, an fp32 layer norm and two casts per
sublayer, each a pass over memory. Here the stream stays in its own dtype (bf16 under bf16
training), the add and the statistics are fp32 in registers, and the backward writes the
gradient of the stream once (it is the gradient of both x and residual). The bias of the
sublayer's output projection can ride along (``residual_bias``): the projection then runs without
its bias, and the bias gradient (the column sum of the stream's gradient) comes out of this
kernel instead of a separate reduction.

In this file's order: the references → the kernel pair, from which
:func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops ``torch.ops.bstrain.add_layer_norm`` and
``add_layer_norm_bwd`` (fake, autograd) and the eager ``autograd.Function`` → the public function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._checks import KERNEL_FLOATS, check_param, check_tensor, unit_columns, use_kernels
from bstrain.ops._dispatch import kernel_op

__all__ = ["add_layer_norm", "add_layer_norm_ref"]

MAX_C = 8192       # features the kernel's one-tile rows hold (bstrain.kernels.residual_norm)


# --- reference --------------------------------------------------------------------------------------
def add_layer_norm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor, eps: float = 1e-5,
                       residual_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """PyTorch (y, h) over the last axis, differentiable: the CPU path and the tests' oracle. The add
    and the norm in fp32 (fp64 for fp64 x); h is rounded to x's dtype before it is normalised."""
    work = torch.promote_types(x.dtype, torch.float32)
    if residual is not None and residual_bias is not None:
        residual = residual.to(work) + residual_bias.to(work)
    h = x if residual is None else (x.to(work) + residual.to(work)).to(x.dtype)
    y = F.layer_norm(h.to(work), (h.shape[-1],), weight.to(work), bias.to(work), eps)
    return y.to(x.dtype), h


def _stats_ref(h: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    var, mean = torch.var_mean(h.to(torch.promote_types(h.dtype, torch.float32)), dim=-1, correction=0)
    return mean, torch.rsqrt(var + eps)


def _bwd_ref(dy, dh, h, w, mean, rstd, dx_dtype):
    """(dx, dw, db, dc = column sum of dx) by the formulas (the custom op's CPU backward runs below
    autograd)."""
    work = mean.dtype
    xhat = (h.to(work) - mean[:, None]) * rstd[:, None]
    dyw = dy.to(work)
    dxhat = dyw * w.to(work)
    dx = (dxhat - xhat * (dxhat * xhat).mean(1, keepdim=True) - dxhat.mean(1, keepdim=True)) * rstd[:, None]
    if dh is not None:
        dx = dx + dh.to(work)
    return dx.to(dx_dtype), (dyw * xhat).sum(0), dyw.sum(0), dx.sum(0)


def _add_ln_ref(x: Tensor, r: Tensor | None, rb: Tensor | None, w: Tensor, b: Tensor,
                eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, h = add_layer_norm_ref(x, r, w, b, eps, rb)
    mean, rstd = _stats_ref(h, eps)
    return y.contiguous(), x.new_empty((0, x.shape[1])) if r is None else h.contiguous(), mean, rstd


# --- kernel pair: torch.ops.bstrain.add_layer_norm and add_layer_norm_bwd, and their eager Function -----
def _forward(x: Tensor, r: Tensor | None, rb: Tensor | None, w: Tensor, b: Tensor,
             eps: float) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """x, r: (N, C), unit feature stride; rb (r's bias, only with r), w, b: (C,). Returns (y, h,
    mean, rstd): y and h (N, C) in x's dtype (h None when r is None: the stream is x),
    statistics (N,) fp32 (fp64 for fp64 x)."""
    from bstrain.kernels.residual_norm import add_layer_norm_forward
    x, r = unit_columns(x), None if r is None else unit_columns(r)   # (a compiler may hand over any strides)
    return add_layer_norm_forward(x, r, w.contiguous(), b.contiguous(), eps, rb=None if rb is None else rb.contiguous())


def _forward_op(x: Tensor, r: Tensor | None, rb: Tensor | None, w: Tensor, b: Tensor,
                eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's :func:`_forward`: h is (0, C) when r is None (an op returns no None)."""
    y, h, mean, rstd = _forward(x, r, rb, w, b, eps)
    return y, x.new_empty((0, x.shape[1])) if h is None else h, mean, rstd


def _backward(dy: Tensor, dh: Tensor | None, h: Tensor, w: Tensor, mean: Tensor, rstd: Tensor,
              dx_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx in dx_dtype, dw, db, dc in fp32 (fp64 for fp64 h)): dx = dh + LN'(dy), the gradient of
    the stream h (of x, and of r), and dc its column sum (the gradient of r's bias)."""
    from bstrain.kernels.residual_norm import add_layer_norm_backward
    return add_layer_norm_backward(dy.contiguous(), None if dh is None else dh.contiguous(), unit_columns(h),
                                   w.contiguous(), mean, rstd, dx_dtype)


def _fake(x, r, rb, w, b, eps):
    stats = x.new_empty((x.shape[0],), dtype=torch.promote_types(x.dtype, torch.float32))
    h = x.new_empty((0, x.shape[1])) if r is None else x.new_empty(x.shape)
    return x.new_empty(x.shape), h, stats, stats.clone()


def _bwd_fake(dy, dh, h, w, mean, rstd, dx_dtype):
    work = torch.promote_types(h.dtype, torch.float32)
    return (h.new_empty(h.shape, dtype=dx_dtype), *(w.new_empty(w.shape, dtype=work) for _ in range(3)))


def _setup(ctx, inputs, output):
    x, r, rb, w, b, eps = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(x if r is None else h, w, mean, rstd)
    ctx.dtypes = (x.dtype, None if r is None else r.dtype, None if rb is None else rb.dtype, w.dtype, b.dtype)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _grads(ctx, bwd, dy, dh, _dmean, _drstd):
    """(dx, dr, drb, dw, db, None) in their inputs' dtypes (None for absent inputs)."""
    stream, w, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(stream)
    if dh is not None and dh.numel() == 0:
        dh = None
    dx, dw, db, dc = bwd(dy, dh, stream, w, mean, rstd, ctx.dtypes[0])
    x_dtype, r_dtype, rb_dtype, w_dtype, b_dtype = ctx.dtypes
    dr = None if r_dtype is None else dx if r_dtype == x_dtype else dx.to(r_dtype)
    return dx, dr, None if rb_dtype is None else dc.to(rb_dtype), dw.to(w_dtype), db.to(b_dtype), None


_add_ln_bwd = kernel_op("bstrain::add_layer_norm_bwd", _backward, ref=_bwd_ref, fake=_bwd_fake)
_add_ln = kernel_op("bstrain::add_layer_norm", _forward, op_kernel=_forward_op, ref=_add_ln_ref, fake=_fake,
                    setup=_setup, backward=_grads, bwd=_add_ln_bwd)


# --- public function ------------------------------------------------------------------------------------
def add_layer_norm(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor, eps: float = 1e-5, *,
                   residual_bias: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``h = x + residual + residual_bias`` and ``y = layer_norm(h, weight, bias)`` over the last axis, fused.

    Args:
        x: (..., C) the residual stream, fp32, fp16 or bf16.
        residual: None (then h is x), or a tensor of x's shape and device in any float dtype: the
            output of the sublayer before.
        weight, bias: the norm's (C,) parameters, in x's dtype or float32 with 16-bit x.
        residual_bias: None, or the (C,) bias of the sublayer's output projection (as weight), added
            here rather than by the projection: its gradient comes out of the same kernel.
        eps: added to the variance.
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns (y, h), both of x's shape and dtype. The add and the statistics are fp32; h is rounded
    to x's dtype before it is normalised, so y is exactly the norm of the stream handed on.
    """
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected (..., C) with C >= 1, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual: expected shape {tuple(x.shape)} on {x.device} (as x), got "
                             f"{tuple(residual.shape)} on {residual.device}")
    weight, bias = check_param("weight", weight, x, C), check_param("bias", bias, x, C)
    if residual_bias is not None:
        if residual is None:
            raise ValueError("residual_bias: expected None without a residual, got a tensor")
        residual_bias = check_param("residual_bias", residual_bias, x, C).contiguous()
    if not use_kernels(x, backend) or C > MAX_C or (residual is not None and residual.dtype not in KERNEL_FLOATS):
        return add_layer_norm_ref(x, residual, weight, bias, eps, residual_bias)
    x2 = x.reshape(-1, C)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = None if residual is None else residual.reshape(-1, C)
    if r2 is not None and r2.stride(-1) != 1:
        r2 = r2.contiguous()
    w, b = weight.contiguous(), bias.contiguous()
    y, h, _, _ = _add_ln(x2, r2, residual_bias, w, b, float(eps))
    h = x if r2 is None else h
    return y.view(x.shape), h.view(x.shape)
