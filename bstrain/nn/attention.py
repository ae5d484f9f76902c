"""``BlockSparseAttention``: an ``nn.Module`` that owns a block layout and runs attention on it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bstrain import layout as layouts
from bstrain.ops.transformer import BlocksparseTransformer

__all__ = ["BlockSparseAttention"]


class BlockSparseAttention(nn.Module):
    """softmax(q·kᵀ·scale, masked)·v over a block layout: the fused kernels on CUDA, PyTorch elsewhere.

    Args:
        layout: (q_blocks, k_blocks) 0/1 array shared by the heads (``heads`` required), or
            (heads, q_blocks, k_blocks).
        block_size: 16, 32, 64 or 128.
        heads: number of heads for a 2-D layout.
        mask_callback: the seed's per-block element mask, as :class:`BlocksparseTransformer`.
        scale: softmax scale; default 1/sqrt(head_dim).
        backend: "auto" | "triton" | "torch".

    ``forward(q, k, v, key_padding_mask=None)`` takes the seed's (B, T, H·D) or SDPA's
    (B, H, T, D) and returns q's form. k and v may have fewer heads than q, a divisor of them
    (grouped-query attention, as SDPA's ``enable_gqa``). Inputs shorter than the layout's
    context (T <= q_context, Tk <= k_context) attend as the layout's first T x Tk positions do:
    they are padded to the context and the padded keys are masked. ``key_padding_mask`` is
    (B, Tk) bool, True = padding (as ``nn.MultiheadAttention``).

    The module has no parameters or buffers: the layout is part of its construction, held by
    its op with tables shared by every module of the same layout (``bstrain.ops.tables``).
    """

    def __init__(self, layout, block_size: int = 64, heads: int | None = None, mask_callback=None, *,
                 scale: float | None = None, backend: str = "auto"):
        super().__init__()
        self.op = BlocksparseTransformer(layout, block_size, heads=heads, mask_callback=mask_callback,
                                         backend=backend)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
            raise ValueError(f"scale: expected a positive number or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)

    @classmethod
    def from_mask(cls, mask, context: int, block_size: int = 64, heads: int = 1, *, per_head: bool = False,
                  k_context: int | None = None, **kwargs) -> "BlockSparseAttention":
        """The attention of an element mask ``mask(b, h, q_idx, k_idx) -> bool`` (a FlexAttention
        ``mask_mod``, e.g. :func:`bstrain.layout.causal_mask`) at ``context`` query positions and
        ``k_context`` (default ``context``) key positions. ``per_head``: the mask depends on h, so
        each head gets its own layout."""
        lay, cb = layouts.attention_layout(mask, context, k_context or context, block_size,
                                           heads=heads if per_head else None)
        return cls(lay, block_size, heads=None if per_head else heads, mask_callback=cb, **kwargs)

    @property
    def heads(self) -> int:
        return self.op.heads

    @property
    def block_size(self) -> int:
        return self.op.block_size

    @property
    def context(self) -> tuple[int, int]:
        """(q_context, k_context): the longest inputs, in positions."""
        return self.op.q_ctx, self.op.k_ctx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, T, H·D) or (B, H, T, D); k, v (B, Tk, Hk·D) or (B, Hk, Tk, D). Returns q's shape."""
        four = q.dim() == 4
        if four:                                              # SDPA's (B, H, T, D) -> (B, T, H·D)
            if q.shape[1] != self.op.heads:
                raise ValueError(f"q: expected (batch, {self.op.heads}, T, head_dim) or (batch, T, "
                                 f"{self.op.heads}·head_dim), got {tuple(q.shape)}")
            q, k, v = (_merge_heads(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
        B, T, HD = q.shape if q.dim() == 3 else (None, None, None)
        if T is None or not 0 < T <= self.op.q_ctx:
            raise ValueError(f"q: expected (batch, T, heads·head_dim) or (batch, heads, T, head_dim) with 1 <= T <= "
                             f"{self.op.q_ctx}, got {tuple(q.shape)}")
        Tk = k.shape[1] if k.dim() == 3 else -1
        if not 0 < Tk <= self.op.k_ctx:
            raise ValueError(f"k: expected 1 to {self.op.k_ctx} positions, got shape {tuple(k.shape)}")
        pad = key_padding_mask
        if pad is not None and (not isinstance(pad, torch.Tensor) or pad.shape != (B, Tk)):
            got = tuple(pad.shape) if isinstance(pad, torch.Tensor) else type(pad).__name__
            raise ValueError(f"key_padding_mask: expected a bool ({B}, {Tk}) tensor (True = padding), got {got}")
        # a symbolic T (torch.export with a dynamic length, compile with dynamic shapes) pads
        # always, by zero rows where T is the context: one graph for every length up to it
        symbolic = isinstance(T, torch.SymInt) or isinstance(Tk, torch.SymInt)
        if symbolic or T < self.op.q_ctx:
            q = F.pad(q, (0, 0, 0, self.op.q_ctx - T))
        if symbolic or Tk < self.op.k_ctx:                     # the keys past Tk: padding, masked
            k, v = (F.pad(t, (0, 0, 0, self.op.k_ctx - Tk)) for t in (k, v))
            if pad is None:
                pad = (torch.arange(self.op.k_ctx, device=q.device) >= Tk).expand(B, -1)
            else:
                pad = F.pad(pad, (0, self.op.k_ctx - Tk), value=True)
        out = self.op.attention(q, k, v, self.scale, pad)
        if symbolic:                                           # a gather: no slice guard (T == context)
            out = out.index_select(1, torch.arange(T, device=out.device))
        elif T < self.op.q_ctx:
            out = out[:, :T]
        if four:
            out = out.view(B, T, self.op.heads, HD // self.op.heads).transpose(1, 2)
        return out

    def extra_repr(self) -> str:
        op = self.op
        shape = f"q_context={op.q_ctx}, k_context={op.k_ctx}" if op.q_ctx != op.k_ctx else f"context={op.q_ctx}"
        density = op.blocks / op.layout.size
        return (f"heads={op.heads}, {shape}, block_size={op.block_size}, blocks={op.blocks} "
                f"({density:.1%} live), scale={self.scale}, backend={op.backend!r}")


def _merge_heads(name: str, t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected (batch, heads, T, head_dim) like q, got {got}")
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B, T, H * D)
