"""A bias add fused with GELU, ``gelu(x + bias)``, whose backward also makes the bias gradient: one
kernel each way on CUDA (:mod:`bstrain.kernels.bias_act`).

``nn.Linear`` followed by ``F.gelu`` costs, besides the GEMM, a GELU pass each way and, backward, a
separate reduction over every row for the bias gradient. With the projection run bias-free
(``F.linear(x, weight)``) and this op after it, the bias rides into the GELU and its gradient
out of the GELU's backward.

In this file's order: the reference → the kernel pair, from which :func:`~bstrain.ops._dispatch.kernel_op`
makes the custom ops ``torch.ops.bstrain.bias_gelu`` and ``bias_gelu_bwd`` (fake, autograd) and the
eager ``autograd.Function`` → the public function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._checks import check_param, check_tensor, unit_columns, use_kernels
from bstrain.ops._dispatch import kernel_op

__all__ = ["bias_gelu", "bias_gelu_ref"]


# --- reference --------------------------------------------------------------------------------------
def bias_gelu_ref(x: Tensor, bias: Tensor) -> Tensor:
    """PyTorch gelu(x + bias) over the last axis (differentiable): math in fp32 (fp64 for fp64 x),
    the result in x's dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    return F.gelu(x.to(work) + bias.to(work)).to(x.dtype)


def _bwd_ref(dy: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    work = torch.promote_types(x.dtype, torch.float32)
    z = x.to(work) + bias.to(work)
    cdf = 0.5 * (1 + torch.erf(z * 0.5 ** 0.5))
    dx = dy.to(work) * (cdf + z * torch.exp(-0.5 * z * z) * (2 * torch.pi) ** -0.5)
    return dx.to(x.dtype), dx.sum(0)


# --- kernel pair: torch.ops.bstrain.bias_gelu and bias_gelu_bwd, and their eager Function ---------------
def _forward(x: Tensor, bias: Tensor) -> Tensor:
    """x (N, C) with unit column stride, bias (C,) -> gelu(x + bias) (N, C) contiguous in x's dtype."""
    from bstrain.kernels.bias_act import bias_gelu_forward
    return bias_gelu_forward(unit_columns(x), bias.contiguous())    # (a compiler may hand over any strides)


def _backward(dy: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dbias (C,) in fp32; fp64 for fp64 x)."""
    from bstrain.kernels.bias_act import bias_gelu_backward
    return bias_gelu_backward(dy.contiguous(), unit_columns(x), bias.contiguous())


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grads(ctx, bwd, dy):
    x, bias = ctx.saved_tensors
    dx, db = bwd(dy, x, bias)
    return dx, db.to(bias.dtype)


_bias_gelu_bwd = kernel_op(
    "bstrain::bias_gelu_bwd", _backward, ref=_bwd_ref,
    fake=lambda dy, x, bias: (x.new_empty(x.shape),
                              bias.new_empty(bias.shape, dtype=torch.promote_types(x.dtype, torch.float32))))
_bias_gelu = kernel_op(
    "bstrain::bias_gelu", _forward, ref=lambda x, bias: bias_gelu_ref(x, bias).contiguous(),
    fake=lambda x, bias: x.new_empty(x.shape), setup=_setup, backward=_grads, bwd=_bias_gelu_bwd)


# --- public function ------------------------------------------------------------------------------------
def bias_gelu(x: Tensor, bias: Tensor, *, backend: str = "auto") -> Tensor:
    """``F.gelu(x + bias)`` (exact GELU) over the last axis, fused with its bias gradient.

    Args:
        x: (..., C) fp32, fp16 or bf16, e.g. the output of a bias-free ``F.linear``.
        bias: C elements, x's dtype or float32 with 16-bit x.
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns a contiguous tensor of x's shape and dtype; math in fp32.
    """
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected (..., C) with C >= 1, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    bias = check_param("bias", bias, x, C).contiguous()
    if not use_kernels(x, backend):
        return bias_gelu_ref(x, bias)
    x2 = x.reshape(-1, C)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    return _bias_gelu(x2, bias).view(x.shape)
