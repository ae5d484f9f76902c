"""``BlockSparseAttention``: an ``nn.Module`` that owns a block layout and runs attention on it."""
from __future__ import annotations

import torch
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

    ``forward(q, k, v, key_padding_mask=None)`` takes the seed's (B, T, H·D) or SDPA's (B, H, T, D)
    and returns the same form.
    """

    def __init__(self, layout, block_size: int = 64, heads: int | None = None, mask_callback=None, *,
                 scale: float | None = None, backend: str = "auto"):
        super().__init__()
        self.op = BlocksparseTransformer(layout, block_size, heads=heads, mask_callback=mask_callback,
                                         backend=backend)
        self.scale = scale

    @classmethod
    def from_mask(cls, mask, context: int, block_size: int = 64, heads: int = 1, *, per_head: bool = False,
                  k_context: int | None = None, **kwargs) -> "BlockSparseAttention":
        """The attention of an element mask ``mask(b, h, q_idx, k_idx) -> bool`` (a FlexAttention
        ``mask_mod``, e.g. :func:`bstrain.layout.causal_mask`) at ``context`` positions."""
        lay, cb = layouts.attention_layout(mask, context, k_context or context, block_size,
                                           heads=heads if per_head else None)
        return cls(lay, block_size, heads=None if per_head else heads, mask_callback=cb, **kwargs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        four = q.dim() == 4
        if four:                                              # SDPA's (B, H, T, D) -> (B, T, H·D)
            q, k, v = (t.transpose(1, 2).flatten(2) for t in (q, k, v))
        out = self.op.attention(q, k, v, self.scale, key_padding_mask)
        if four:
            B, T, HD = out.shape
            out = out.view(B, T, self.op.heads, HD // self.op.heads).transpose(1, 2)
        return out

    def extra_repr(self) -> str:
        op = self.op
        return (f"heads={op.heads}, q_blocks={op.q_blocks}, k_blocks={op.k_blocks}, block_size={op.block_size}, "
                f"blocks={op.blocks}, scale={self.scale}")
