"""Rotary position embeddings (RoPE, rotate-half form) on the heads of a fused projection.

``apply_rotary(qkv, cos, sin, head_dim, rotated=2·H)`` rotates the q and k heads of a (B, T, 3·H·D)
projection by their positions and copies v, in one kernel on CUDA (:mod:`bstrain.kernels.rotary`);
its backward is the same kernel turning the other way. The projection's bias can ride along
(``bias=``): the GEMM then runs without it, and the bias gradient comes out of the backward
kernel instead of a separate reduction. The cos/sin tables are made once per
(length, head_dim, base, device) by :func:`rotary_tables` and kept, never per call.

In this file's order: the tables → the references → the kernel pair, from which
:func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops ``torch.ops.bstrain.rotary`` and
``rotary_bwd`` (fake, autograd) and the eager ``autograd.Function`` → the public functions.
"""
from __future__ import annotations

import torch
from torch import Tensor

from bstrain.ops._checks import check_param, check_tensor, use_kernels
from bstrain.ops._dispatch import kernel_op
from bstrain.ops.tables import real_tensors, tracing

__all__ = ["apply_rotary", "apply_rotary_ref", "rotary_tables"]

_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}


# --- tables -----------------------------------------------------------------------------------------
def _make_tables(length: int, head_dim: int, base: float, device) -> tuple[Tensor, Tensor]:
    half = head_dim // 2
    inv = 1.0 / (base ** (torch.arange(half, device=device, dtype=torch.float64) / half))
    ang = torch.arange(length, device=device, dtype=torch.float64)[:, None] * inv[None, :]      # (length, half)
    return ang.cos().float(), ang.sin().float()


def rotary_tables(length: int, head_dim: int, device, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (length, head_dim/2) float32: the angles t·base^(-2i/head_dim) of positions
    t < length, computed in float64. Made once per (length, head_dim, base, device) and cached
    (while a graph is traced, or on the meta device, an uncached copy is made instead)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {head_dim!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length: expected an int >= 0, got {length!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (length, head_dim, float(base), device)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    if device.type == "meta" or tracing():
        return _make_tables(length, head_dim, base, device)
    with real_tensors(device):
        hit = _TABLES[key] = _make_tables(length, head_dim, base, device)
    return hit


# --- reference --------------------------------------------------------------------------------------
def apply_rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, rotated: int,
                     inverse: bool = False, bias: Tensor | None = None) -> Tensor:
    """PyTorch rotary embedding (differentiable): the CPU path and the tests' oracle. x (B, T, C) plus
    bias (C,) if given; the first ``rotated`` heads of head_dim turned by +t·θ (−t·θ if inverse);
    math in fp32 (fp64 for fp64 x); returns x's dtype."""
    B, T, C = x.shape
    work = torch.promote_types(x.dtype, torch.float32)
    half = head_dim // 2
    xw = x.to(work) if bias is None else x.to(work) + bias.to(work)
    xh = xw.view(B, T, C // head_dim, head_dim)
    a, b = xh[:, :, :rotated, :half], xh[:, :, :rotated, half:]
    c, s = cos[:T].to(work)[None, :, None, :], sin[:T].to(work)[None, :, None, :]
    s = -s if inverse else s
    turned = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([turned, xh[:, :, rotated:]], dim=2).reshape(B, T, C).to(x.dtype)


def _bwd_ref(dy: Tensor, cos: Tensor, sin: Tensor, head_dim: int, rotated: int, inverse: bool) -> tuple[Tensor, Tensor]:
    dx = apply_rotary_ref(dy, cos, sin, head_dim, rotated, not inverse)
    return dx.contiguous(), dx.to(torch.promote_types(dy.dtype, torch.float32)).sum((0, 1))


# --- kernel pair: torch.ops.bstrain.rotary and rotary_bwd, and their eager Function ---------------------
def _rows(x: Tensor) -> Tensor:
    """x as the kernel takes it: unit feature stride and B·T rows of one stride."""
    B, T, C = x.shape
    if x.stride(2) == 1 and (B == 1 or x.stride(0) == T * x.stride(1)):
        return x
    return x.contiguous()


def _forward(x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None, head_dim: int, rotated: int,
             inverse: bool) -> Tensor:
    """x (B, T, C), bias None or (C,) -> contiguous y like x."""
    from bstrain.kernels.rotary import rotary_forward
    return rotary_forward(_rows(x), cos, sin, head_dim, rotated, inverse, bias)[0]


def _backward(dy: Tensor, cos: Tensor, sin: Tensor, head_dim: int, rotated: int, inverse: bool, *,
              sum_cols: bool = True) -> tuple[Tensor, Tensor]:
    """(dx like dy, its (C,) column sum in fp32 (fp64 for fp64 dy): the bias gradient): the turn
    the other way. ``sum_cols=False`` (eager calls without a bias) skips the sum."""
    from bstrain.kernels.rotary import rotary_forward
    return rotary_forward(_rows(dy), cos, sin, head_dim, rotated, not inverse, sum_cols=sum_cols)


def _setup(ctx, inputs, output):
    _, cos, sin, bias, head_dim, rotated, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.config = (head_dim, rotated, inverse, None if bias is None else bias.dtype)


def _grads(ctx, bwd, dy):
    cos, sin = ctx.saved_tensors
    head_dim, rotated, inverse, bias_dtype = ctx.config
    dx, dbias = bwd(dy, cos, sin, head_dim, rotated, inverse, sum_cols=bias_dtype is not None)
    return dx, None, None, None if bias_dtype is None else dbias.to(bias_dtype), None, None, None


_rotary_bwd = kernel_op(
    "bstrain::rotary_bwd", _backward, ref=_bwd_ref,
    fake=lambda dy, cos, sin, head_dim, rotated, inverse: (
        dy.new_empty(dy.shape), dy.new_empty(dy.shape[2:], dtype=torch.promote_types(dy.dtype, torch.float32))))
_rotary = kernel_op(
    "bstrain::rotary", _forward,
    ref=lambda x, cos, sin, bias, head_dim, rotated, inverse:
        apply_rotary_ref(x, cos, sin, head_dim, rotated, inverse, bias).contiguous(),
    fake=lambda x, cos, sin, bias, head_dim, rotated, inverse: x.new_empty(x.shape),
    setup=_setup, backward=_grads, bwd=_rotary_bwd)


# --- public function ------------------------------------------------------------------------------------
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, rotated: int | None = None, *,
                 bias: Tensor | None = None, inverse: bool = False, backend: str = "auto") -> Tensor:
    """Rotary position embedding of the heads of x, position t = index along T.

    Args:
        x: (B, T, C) with C = heads·head_dim, e.g. a fused (B, T, 3·H·D) qkv projection.
        cos, sin: (>= T, head_dim/2) float32 tables on x's device (:func:`rotary_tables`).
        head_dim: the (even) width of a head; a head's pair (i, i + head_dim/2) turns by t·θ_i.
        rotated: the number of leading heads to rotate (default all); the rest are copied. For a
            fused qkv projection of H heads: 2·H (q and k).
        bias: None, or the projection's (C,) bias (x's dtype, or float32 with 16-bit x), added
            to x before the turn; its gradient comes out of the backward kernel.
        inverse: turn by −t·θ (undoes the rotation).
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns a contiguous tensor of x's shape and dtype. Math in fp32.
    """
    check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: expected (batch, T, heads·head_dim), got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2 or C % head_dim:
        raise ValueError(f"head_dim: expected an even int dividing the {C} features, got {head_dim!r}")
    heads = C // head_dim
    rotated = heads if rotated is None else rotated
    if isinstance(rotated, bool) or not isinstance(rotated, int) or not 0 <= rotated <= heads:
        raise ValueError(f"rotated: expected an int in [0, {heads}] (heads of x), got {rotated!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] < T or \
                t.shape[1] != head_dim // 2 or t.device != x.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a float32 (>= {T}, {head_dim // 2}) table on {x.device} "
                             f"(rotary_tables), got {got}")
    cos, sin = cos.contiguous(), sin.contiguous()
    if bias is not None:
        bias = check_param("bias", bias, x, C).contiguous()
    if not use_kernels(x, backend):
        return apply_rotary_ref(x, cos, sin, head_dim, rotated, inverse, bias)
    return _rotary(x, cos, sin, bias, head_dim, rotated, bool(inverse))
