"""Embedding lookup with an fp32 gradient accumulator.

A kernel_op (:func:`~bstrain.ops._dispatch.kernel_op`): the custom op ``torch.ops.bstrain.embedding_lookup``
when traced, its eager Function otherwise, with the backward written once. Its arguments come in
``F.embedding``'s order (indices, table).
"""
from __future__ import annotations

import torch
from torch import Tensor

from bstrain.ops._checks import as_index
from bstrain.ops._dispatch import kernel_op

__all__ = ["embedding_lookup"]


def _lookup(idx: Tensor, emb: Tensor) -> Tensor:
    """emb[idx]: (*idx.shape, D) for a (V, D) table."""
    return emb[idx]


def _lookup_grad(dy: Tensor, idx: Tensor, rows: int) -> Tensor:
    """The table's gradient (rows, D) in dy's dtype (the table's), summed in fp32 (fp64 for fp64
    tables): rows that repeat (common tokens) sum many small fp16/bf16 terms."""
    d = dy.shape[-1]
    acc = torch.promote_types(dy.dtype, torch.float32)
    grad = torch.zeros(rows, d, dtype=acc, device=dy.device)
    grad.index_add_(0, idx.reshape(-1), dy.reshape(-1, d).to(acc))
    return grad.to(dy.dtype)


def _setup(ctx, inputs, output):
    idx, emb = inputs
    ctx.save_for_backward(idx)
    ctx.rows = emb.shape[0]


def _grads(ctx, bwd, dy):
    (idx,) = ctx.saved_tensors
    return None, _lookup_grad(dy, idx, ctx.rows) if ctx.needs_input_grad[1] else None


_embedding_lookup = kernel_op("bstrain::embedding_lookup", _lookup, ref=None,
                              fake=lambda idx, emb: emb.new_empty((*idx.shape, emb.shape[1])),
                              setup=_setup, backward=_grads)


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
    return _embedding_lookup(as_index("idx", idx, emb.shape[0]).contiguous(), emb)
