"""Fused softmax cross-entropy over the last axis of logits, in the logits' own dtype.

Under autocast, ``F.cross_entropy(logits.float(), y)`` makes an fp32 copy of the logits, an fp32
log-softmax, and the same again backward. :func:`cross_entropy` reads bf16/fp16 logits once
forward and writes their gradient once backward (:mod:`bstrain.kernels.cross_entropy`), with all
math in fp32 registers. ``bstrain.ops.softmax_cross_entropy`` (the seed's name) runs it on CUDA.

In this file's order: the references → the kernel pair, from which
:func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops ``torch.ops.bstrain.softmax_xent`` and
``softmax_xent_bwd`` (fake, autograd) and the eager ``autograd.Function`` → the public function → the
seed's ``softmax_cross_entropy``, which range-checks the labels and takes any label shape.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._checks import INDEX_DTYPES, as_index, check_tensor, unit_columns, use_kernels
from bstrain.ops._dispatch import kernel_op

__all__ = ["cross_entropy", "cross_entropy_ref", "softmax_cross_entropy", "softmax_cross_entropy_ref"]


# --- reference --------------------------------------------------------------------------------------
def cross_entropy_ref(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row loss (N,) in fp32 (fp64 for fp64 logits) of (N, V) logits: the CPU path and the oracle."""
    work = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(work), labels.long(), reduction="none")


def softmax_cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row loss in fp32 (fp64 for fp64 logits): logsumexp(logits) - logits[label]."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction="none")


def _xent_ref(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    work = torch.promote_types(logits.dtype, torch.float32)
    return cross_entropy_ref(logits, labels), torch.logsumexp(logits.to(work), dim=1)


def _xent_bwd_ref(dloss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor) -> Tensor:
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])
    p[torch.arange(logits.shape[0], device=logits.device), labels.long()] -= 1
    return (p * dloss.to(lse.dtype)[:, None]).to(logits.dtype)


# --- kernel pair: torch.ops.bstrain.softmax_xent and softmax_xent_bwd, and their eager Function ---------
def _forward(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(loss, lse), each (N,) fp32, of (N, V) logits with unit column stride and (N,) labels."""
    from bstrain.kernels.cross_entropy import xent_forward
    return xent_forward(unit_columns(logits), labels.contiguous())   # (a compiler may hand over any strides)


def _backward(dloss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor) -> Tensor:
    """dlogits (N, V) in the logits' dtype: (softmax − onehot)·dloss."""
    from bstrain.kernels.cross_entropy import xent_backward
    return xent_backward(dloss, unit_columns(logits), labels.contiguous(), lse)


def _fake(logits, labels):
    stat = logits.new_empty((logits.shape[0],), dtype=torch.promote_types(logits.dtype, torch.float32))
    return stat, stat.clone()


def _setup(ctx, inputs, output):
    logits, labels = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.mark_non_differentiable(output[1])


def _grads(ctx, bwd, dloss, _dlse):
    logits, labels, lse = ctx.saved_tensors
    return bwd(dloss, logits, labels, lse), None


_xent_bwd = kernel_op("bstrain::softmax_xent_bwd", _backward, ref=_xent_bwd_ref,
                      fake=lambda dloss, logits, labels, lse: logits.new_empty(logits.shape))
_xent = kernel_op("bstrain::softmax_xent", _forward, ref=_xent_ref, fake=_fake, setup=_setup, backward=_grads,
                  bwd=_xent_bwd)


# --- public function ------------------------------------------------------------------------------------
def cross_entropy(logits: Tensor, labels: Tensor, *, backend: str = "auto") -> Tensor:
    """Per-row softmax cross-entropy ``logsumexp(logits) − logits[label]`` over the last axis.

    Args:
        logits: (..., V) fp32/fp16/bf16.
        labels: integer ids (int64/32/16, uint16, uint8), one per row: logits.shape[:-1].
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns the fp32 loss, shape logits.shape[:-1]; the gradient comes back in the logits' dtype.
    Labels are not range-checked here (that would cost a host sync per call): an id outside
    [0, V) gives NaN on the kernel path and an error on the PyTorch one. The seed's
    ``softmax_cross_entropy`` checks them first.
    """
    check_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    rows = logits.shape[:-1]
    if not isinstance(labels, Tensor) or labels.shape != rows or labels.dtype not in INDEX_DTYPES:
        got = f"{tuple(labels.shape)} {labels.dtype}" if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected integer ids of shape {tuple(rows)} (logits.shape[:-1]), got {got}")
    if labels.device != logits.device:
        raise ValueError(f"labels: expected device {logits.device} (as logits), got {labels.device}")
    V = logits.shape[-1]
    flat, ids = logits.reshape(-1, V), labels.reshape(-1)
    if not use_kernels(logits, backend):
        return cross_entropy_ref(flat, ids).reshape(rows)
    flat = flat if flat.stride(1) == 1 else flat.contiguous()
    ids = ids.contiguous() if ids.dtype in (torch.int64, torch.int32) else ids.to(torch.int32)
    return _xent(flat, ids)[0].reshape(rows)


# --- seed API --------------------------------------------------------------------------------------------
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
    check_tensor("logits", logits)
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
    if use_kernels(logits):                      # the fused kernel
        return cross_entropy(logits, labels.reshape(rows))
    flat = softmax_cross_entropy_ref(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return flat.reshape(rows)
