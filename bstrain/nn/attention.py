"""``BlockSparseAttention``: an ``nn.Module`` that owns a block layout and runs attention on it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bstrain import layout as layouts
from bstrain.ops.transformer import BlocksparseTransformer, _check_alibi, _check_softcap

__all__ = ["BlockSparseAttention"]


class BlockSparseAttention(nn.Module):
    """softmax(s, masked)·v over a block layout, s = q·kᵀ·scale with optional soft-capping and
    ALiBi: the fused kernels on CUDA, PyTorch elsewhere.

    Args:
        layout: (q_blocks, k_blocks) 0/1 array shared by the heads (``heads`` required), or
            (heads, q_blocks, k_blocks).
        block_size: 16, 32, 64 or 128.
        heads: number of heads for a 2-D layout.
        mask_callback: the seed's per-block element mask, as :class:`BlocksparseTransformer`.
        scale: softmax scale; default 1/sqrt(head_dim).
        backend: "auto" | "triton" | "torch".
        alibi: None, True (ALiBi's standard slopes for the head count,
            :func:`bstrain.ops.transformer.alibi_slopes`) or one slope per head: adds
            ``slope[h]·(k_pos − q_pos)`` to the scores (positions from the layout's first).
        softcap: None or a positive number c: scores become ``c·tanh(s/c)`` (before ALiBi).

    ``forward(q, k, v, key_padding_mask=None, *, return_lse=False)`` takes the seed's
    (B, T, H·D) or SDPA's (B, H, T, D) and returns q's form. k and v may have fewer heads than q,
    a divisor of them (grouped-query attention, as SDPA's ``enable_gqa``), and v a head dim Dv of
    its own (the output's). Inputs shorter than the layout's context (T <= q_context,
    Tk <= k_context) attend as the layout's first T x Tk positions do: they are padded to the
    context and the padded keys are masked. ``key_padding_mask`` is (B, Tk) bool, True = padding
    (as ``nn.MultiheadAttention``). ``return_lse=True`` returns (out, lse), lse (B, H, T) the
    rows' natural log-sum-exp of the scores (FlexAttention's), −inf for a query with no live key.

    The module has no parameters and no state: the layout is part of its construction, held by
    its op with tables shared by every module of the same layout (``bstrain.ops.tables``). ALiBi
    slopes are a non-persistent fp32 buffer ``alibi_slopes`` (None without ALiBi), so ``.to()``
    moves them once and state dicts hold nothing.
    """

    def __init__(self, layout, block_size: int = 64, heads: int | None = None, mask_callback=None, *,
                 scale: float | None = None, backend: str = "auto", alibi=None, softcap: float | None = None):
        super().__init__()
        self.op = BlocksparseTransformer(layout, block_size, heads=heads, mask_callback=mask_callback,
                                         backend=backend)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
            raise ValueError(f"scale: expected a positive number or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.softcap = _check_softcap(softcap) or None
        slopes = _check_alibi(alibi, self.op.heads, torch.device("cpu"), torch.float32)     # (H,) or None
        self._slopes = None if slopes is None else tuple(slopes.tolist())
        self.register_buffer("alibi_slopes", None if slopes is None else slopes.clone(), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``to_empty()``: the ALiBi slopes keep their current values, in
        fp32, on the new device (a cast would round them); from meta or after ``to_empty()``, which
        hold no values, they are the construction's."""
        slopes = self.alibi_slopes
        if slopes is not None and slopes.device.type != "meta":
            self._slopes = tuple(slopes.detach().float().cpu().tolist())      # a user's in-place change stays
        out = super()._apply(fn, recurse)
        if self.alibi_slopes is not None:
            self.alibi_slopes = torch.tensor(self._slopes, dtype=torch.float32, device=self.alibi_slopes.device)
        return out

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                *, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q (B, T, H·D) or (B, H, T, D); k (B, Tk, Hk·D) or (B, Hk, Tk, D); v (B, Tk, Hk·Dv) or
        (B, Hk, Tk, Dv). Returns q's form with head dim Dv, and with ``return_lse`` the (B, H, T) LSE."""
        four = q.dim() == 4
        if four:                                              # SDPA's (B, H, T, D) -> (B, T, H·D)
            if q.shape[1] != self.op.heads:
                raise ValueError(f"q: expected (batch, {self.op.heads}, T, head_dim) or (batch, T, "
                                 f"{self.op.heads}·head_dim), got {tuple(q.shape)}")
            q, k, v = (_merge_heads(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
        B, T, _ = q.shape if q.dim() == 3 else (None, None, None)
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
        res = self.op.attention(q, k, v, self.scale, pad, return_lse=return_lse, alibi=self.alibi_slopes,
                                softcap=self.softcap)
        out, lse = res if return_lse else (res, None)
        out, lse = _first_rows(out, 1, T, symbolic), _first_rows(lse, 2, T, symbolic)
        if four:
            out = out.view(B, T, self.op.heads, out.shape[2] // self.op.heads).transpose(1, 2)
        return (out, lse) if return_lse else out

    def extra_repr(self) -> str:
        op = self.op
        shape = f"q_context={op.q_ctx}, k_context={op.k_ctx}" if op.q_ctx != op.k_ctx else f"context={op.q_ctx}"
        density = op.blocks / op.layout.size
        mods = (f", alibi={list(self._slopes)}" if self._slopes else "") + \
            (f", softcap={self.softcap}" if self.softcap else "")
        return (f"heads={op.heads}, {shape}, block_size={op.block_size}, blocks={op.blocks} "
                f"({density:.1%} live), scale={self.scale}, backend={op.backend!r}{mods}")


def _merge_heads(name: str, t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected (batch, heads, T, head_dim) like q, got {got}")
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B, T, H * D)


def _first_rows(x: torch.Tensor | None, dim: int, T, symbolic: bool) -> torch.Tensor | None:
    """x's first T positions along ``dim`` (the query positions of a shorter input)."""
    if x is None or (not symbolic and T == x.shape[dim]):
        return x
    if symbolic:                                               # a gather: no slice guard (T == context)
        return x.index_select(dim, torch.arange(T, device=x.device))
    return x.narrow(dim, 0, T)
