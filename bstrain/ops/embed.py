"""Embedding lookup with an fp32 gradient accumulator."""
from __future__ import annotations

import torch

from bstrain.ops._checks import as_index

__all__ = ["embedding_lookup"]


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, emb, idx):
        ctx.save_for_backward(idx)
        ctx.num_rows, ctx.emb_dtype = emb.shape[0], emb.dtype
        return emb[idx]                                                  # (*idx.shape, D)

    @staticmethod
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        d = dy.shape[-1]
        # Rows that repeat (common tokens) sum many small fp16/bf16 terms: add them up in fp32.
        acc = torch.promote_types(ctx.emb_dtype, torch.float32)         # fp32, or fp64 for fp64 tables
        grad = torch.zeros(ctx.num_rows, d, dtype=acc, device=dy.device)
        grad.index_add_(0, idx.reshape(-1), dy.reshape(-1, d).to(acc))
        return grad.to(ctx.emb_dtype), None


def embedding_lookup(emb: torch.Tensor, idx: torch.Tensor, sort_grad: bool = True, bench: int = 0,
                     use_tf: bool = False) -> torch.Tensor:
    """y = emb[idx]. The seed's signature.

    Args:
        emb: (V, D) table.
        idx: integer ids of any shape (int64/32/16, uint16, uint8), each in [0, V).
        sort_grad, bench, use_tf: the seed's switches; accepted, without effect (the gradient here
            needs no sorting).
    Returns (*idx.shape, D). The gradient of emb is accumulated in fp32 even for fp16/bf16
    tables, then cast to emb's dtype.
    """
    if not isinstance(emb, torch.Tensor) or emb.dim() != 2 or not emb.is_floating_point():
        raise ValueError(f"emb: expected a 2-D floating (V, D) tensor, got "
                         f"{getattr(emb, 'shape', type(emb).__name__)}")
    if isinstance(idx, torch.Tensor) and idx.device != emb.device:
        raise ValueError(f"idx: expected device {emb.device} (as emb), got {idx.device}")
    # contiguous: a strided index (e.g. x.t()) makes eager and meta strides of emb[idx] disagree
    # under torch.compile
    return _EmbeddingLookup.apply(emb, as_index("idx", idx, emb.shape[0]).contiguous())
