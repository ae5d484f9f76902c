"""Block-sparse attention below the seed's class (:mod:`bstrain.ops.transformer`, which re-exports
the public names): the layout tables (one :mod:`bstrain.ops.tables` family), the reference
(:func:`attention_ref` and the PyTorch path), and the kernel pair, from which
:func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops ``torch.ops.bstrain.bst_attention`` and
``bst_attention_bwd`` (fake, autograd) and the eager ``autograd.Function`` (in that order in this
file). Shapes and score layout: :mod:`bstrain.ops.transformer`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from bstrain.ops._dispatch import kernel_op
from bstrain.ops.tables import family, lookup

__all__ = ["AttentionTables", "attention_ref", "alibi_slopes", "attention_torch", "attention_torch_backward",
           "bst_attention", "bst_attention_bwd"]

_LOG2E = 1.4426950408889634


# --- layout tables --------------------------------------------------------------------------------
@dataclass(eq=False)
class AttentionTables:
    """One layout's tables on one device. Live blocks are numbered head-major, row-major within
    a head. The element masks are stored once per distinct tile: ``tiles[tile_of[n]]`` is block
    n's (``tiles[0]`` is all True, for full blocks)."""
    heads: int
    q_blocks: int
    k_blocks: int
    block_size: int
    h: Tensor          # (nnz,) int64: head of each live block
    i: Tensor          # (nnz,) int64: query block
    j: Tensor          # (nnz,) int64: key block
    row: Tensor        # (nnz,) int64: h·q_blocks + i, the block's query row
    tiles: Tensor      # (distinct + 1, bs, bs) bool element masks
    tile_of: Tensor    # (nnz,) int64
    host: tuple | None  # (h, i, j, partial_idx, partial_masks) numpy: the kernels' tables are cut from them
    _luts: object = None
    _distance: dict = field(default_factory=dict, repr=False)     # ALiBi's k_pos − q_pos per dtype (PyTorch path)

    def kernel_luts(self):
        """The kernels' :class:`~bstrain.kernels.attention.AttnLuts` on this device (made on first
        use: importing the kernels imports Triton; their tile lists are cut per tile shape)."""
        luts = self._luts
        if luts is None:
            from bstrain.kernels.attention import make_luts
            h, i, j, partial_idx, pmasks = self.host
            luts = self._luts = make_luts(h, i, j, partial_idx, pmasks, self.heads, self.q_blocks, self.k_blocks,
                                          self.block_size, self.h.device)
        return luts


@family("attention")
def _attention_tables(layout: np.ndarray, block_size: int, partial_idx: np.ndarray, pmasks: np.ndarray, *,
                      device: torch.device) -> AttentionTables:
    """layout (H, nq, nk) bool; partial_idx (nnz,) int64, -1 for a full block, else a row of
    pmasks (distinct (bs, bs) bool masks)."""
    H, nq, nk = layout.shape
    h, i, j = np.nonzero(layout)
    idx = torch.as_tensor(np.stack([h, i, j, h * nq + i, partial_idx + 1]), dtype=torch.int64, device=device)
    full = np.ones((1, block_size, block_size), dtype=bool)
    tiles = torch.as_tensor(np.concatenate([full, pmasks]), device=device)
    return AttentionTables(H, nq, nk, block_size, idx[0], idx[1], idx[2], idx[3], tiles, idx[4],
                           (h, i, j, partial_idx, pmasks))


@torch.compiler.assume_constant_result
def _device_tensors(key: str, device: torch.device) -> tuple[Tensor, ...]:
    """(h, i, j, row, tiles, tile_of) of the tables named ``key`` on ``device``. torch.compile runs
    this rather than tracing it (a first device copy built in the trace would break the graph on
    the builder's numpy) and takes the result as constants of the graph: copies of their own (no
    views, so no storage offsets) with every size static, else ``dynamic=True`` would give them
    symbolic sizes, whose guards name a constant that no frame holds."""
    t = lookup(key).on(device)
    tensors = tuple(x.clone() for x in (t.h, t.i, t.j, t.row, t.tiles, t.tile_of))
    for x in tensors:       # what torch._dynamo.mark_static(x) records, a no-op while compiling
        x._dynamo_static_indices = set(range(x.dim()))
    return tensors


def _tables_on(tables, device: torch.device) -> AttentionTables:
    """``tables.on(device)``, also while torch.compile traces a call (see :func:`_device_tensors`)."""
    if not torch.compiler.is_compiling():
        return tables.on(device)
    host = tables.host
    return AttentionTables(host.heads, host.q_blocks, host.k_blocks, host.block_size,
                           *_device_tensors(tables.key, device), None)        # the PyTorch path needs no host data


# --- reference: dense attention (the tests' oracle) and the PyTorch path -----------------------------
def attention_ref(q, k, v, mask: Tensor, scale: float, *, alibi=None, softcap: float | None = None,
                  return_lse: bool = False):
    """Dense masked attention, the tests' reference. q (B, Tq, H·D); k (B, Tk, Hk·D) and v
    (B, Tk, Hk·Dv) with Hk dividing H (grouped-query); mask (H, Tq, Tk) or (B, H, Tq, Tk) bool.
    Scores s = scale·q·kᵀ, then ``softcap·tanh(s/softcap)``, then ``+ alibi[h]·(k_pos − q_pos)``
    (alibi: H slopes). Returns O (B, Tq, H·Dv), rows with no kept key giving zeros, and with
    ``return_lse`` the row log-sum-exp (B, H, Tq), natural log, −inf for such rows."""
    B, Tq, HD = q.shape
    H, Tk = mask.shape[-3], k.shape[1]
    D = HD // H
    Hk = k.shape[2] // D
    qh = q.view(B, Tq, H, D).transpose(1, 2)                                         # (B, H, Tq, D)
    kh, vh = (t.view(B, Tk, Hk, t.shape[2] // Hk).transpose(1, 2).repeat_interleave(H // Hk, 1) for t in (k, v))
    s = (qh @ kh.transpose(-1, -2)) * scale                                          # (B, H, Tq, Tk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        distance = torch.arange(Tk, device=s.device) - torch.arange(Tq, device=s.device)[:, None]
        s = s + torch.as_tensor(alibi, dtype=s.dtype, device=s.device).view(H, 1, 1) * distance
    live = mask.any(-1, keepdim=True)                                                # a kept key in the row
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.where(live, torch.softmax(s, -1), 0.0)
    out = (p @ vh).transpose(1, 2).reshape(B, Tq, H * vh.shape[-1])
    if not return_lse:
        return out
    lse = torch.logsumexp(s.masked_fill(~live, 0.0), -1)                            # no -inf row: no NaN grad
    return out, torch.where(live[..., 0], lse, float("-inf"))


def _blocks(x: Tensor, t: AttentionTables, head_dim: int, which: str) -> Tensor:
    """(B, T, Hx·D) -> (B, nnz, bs, D): the query (or key) block of every live block. x may have
    fewer heads than the layout (k, v of grouped-query attention)."""
    B, T, HD = x.shape
    bs, Hx = t.block_size, HD // head_dim
    xb = x.reshape(B, T // bs, bs, Hx, head_dim).permute(0, 3, 1, 2, 4)          # (B, Hx, n, bs, D)
    h = t.h if Hx == t.heads else torch.div(t.h, t.heads // Hx, rounding_mode="floor")
    return xb[:, h, t.i if which == "q" else t.j]


def _keep(t: AttentionTables, pad: Tensor | None) -> Tensor:
    """(1 or B, nnz, bs, bs) bool: the element masks, and keys not padded (pad: (B, k_ctx), True =
    padding, as nn.MultiheadAttention)."""
    keep = t.tiles[t.tile_of].unsqueeze(0)
    if pad is not None:
        keep = keep & ~pad.view(pad.shape[0], t.k_blocks, t.block_size)[:, t.j].unsqueeze(2)
    return keep


def _check_dtype(name: str, dtype) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{name}: expected a floating torch.dtype or None, got {dtype!r}")


def _distance(t: AttentionTables, dtype: torch.dtype) -> Tensor:
    """(nnz, bs, bs) k_pos − q_pos of every live block's elements (positions in the layout's
    context): made once per tables and dtype (a traced call's tables are made per trace)."""
    hit = t._distance.get(dtype)
    if hit is None:
        r = torch.arange(t.block_size, device=t.i.device)
        k_pos, q_pos = t.j[:, None] * t.block_size + r, t.i[:, None] * t.block_size + r         # (nnz, bs)
        hit = (k_pos[:, None, :] - q_pos[:, :, None]).to(dtype)
        if not torch.compiler.is_compiling():
            with torch.inference_mode(False):
                hit = t._distance[dtype] = hit.clone()
    return hit


def _score_mod(w: Tensor, scale: float, t: AttentionTables, alibi: Tensor | None = None,
               softcap: float = 0.0) -> Tensor:
    """(B, nnz, bs, bs) scores in natural units, fp32 (fp64 for fp64 w): scale·w, soft-capped to
    softcap·tanh(·/softcap) (0: off), plus ALiBi's slope[h]·(k_pos − q_pos) (alibi: (H,) slopes)."""
    x = w.to(torch.promote_types(w.dtype, torch.float32)) * scale
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    if alibi is not None:
        x = x + alibi.to(x.dtype)[t.h].view(-1, 1, 1) * _distance(t, x.dtype)
    return x


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's standard slopes (Press et al., 2022): 2**(-8(h+1)/H) for H a power of two; else
    those of the power of two n below H, then every other slope of 2n (h = 0, 2, 4, ...) up to H."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads: expected a positive int, got {heads!r}")
    n = 1 << (heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    return slopes + [2.0 ** (-8.0 * (h + 1) / (2 * n)) for h in range(0, 2 * n, 2)][:heads - n]


def _softmax(w: Tensor, scale: float, keep: Tensor, t: AttentionTables, dtype: torch.dtype | None = None,
             alibi: Tensor | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """(P in ``dtype`` (default w's), row LSE (batch, heads·q_ctx) base 2, +inf for a row with no
    live key) of the scores :func:`_score_mod` makes. Math, and the LSE, in fp32 (fp64 for fp64
    w); both differentiable (the row maximum cancels out of the LSE's gradient)."""
    x = _score_mod(w, scale, t, alibi, softcap).masked_fill(~keep, float("-inf"))
    B, bs, row = w.shape[0], t.block_size, t.row
    blk_max = x.detach().amax(-1)                                                  # (B, nnz, bs)
    row_max = blk_max.new_full((B, t.heads * t.q_blocks, bs), float("-inf"))
    row_max = row_max.scatter_reduce(1, row[None, :, None].expand_as(blk_max), blk_max, "amax")
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    e = torch.exp(x - row_max[:, row].unsqueeze(-1))                               # masked: exp(-inf) = 0
    den = e.new_zeros(B, t.heads * t.q_blocks, bs).index_add(1, row, e.sum(-1))
    live = den > 0
    den = torch.where(live, den, 1.0)                                              # log(0)'s gradient: NaN
    lse = torch.where(live, (row_max + torch.log(den)) * _LOG2E, float("inf"))
    lse = lse.reshape(B, t.heads * t.q_blocks * bs)                                # not -1: B may be 0
    return (e / den[:, row].unsqueeze(-1)).to(dtype or w.dtype), lse


def _scatter_rows(part: Tensor, t: AttentionTables, heads: int, n_blocks: int, index: Tensor) -> Tensor:
    """Σ of (B, nnz, bs, D) block rows into (B, n_blocks·bs, heads·D) at head-major ``index``."""
    B, _, bs, D = part.shape
    out = part.new_zeros(B, heads * n_blocks, bs, D).index_add(1, index, part)
    return out.view(B, heads, n_blocks, bs, D).permute(0, 2, 3, 1, 4).reshape(B, n_blocks * bs, heads * D)


def _head_dims(q: Tensor, k: Tensor, v: Tensor, heads: int) -> tuple[int, int, int]:
    """(D, kv_heads, Dv) of q (B, Tq, H·D), k (B, Tk, Hk·D), v (B, Tk, Hk·Dv)."""
    D = q.shape[2] // heads
    Hk = k.shape[2] // D
    return D, Hk, v.shape[2] // Hk


def attention_torch(q: Tensor, k: Tensor, v: Tensor, t: AttentionTables, scale: float, pad: Tensor | None = None,
                    alibi: Tensor | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """(O (B, Tq, H·Dv) in q's dtype, LSE (B, H·q_ctx) base 2, fp32 (fp64 for fp64 q)) on the
    PyTorch path, differentiable (through the LSE too)."""
    D, _, Dv = _head_dims(q, k, v, t.heads)
    w = torch.einsum("bnid,bnjd->bnij", _blocks(q, t, D, "q"), _blocks(k, t, D, "k"))   # (B, nnz, bs, bs)
    p, lse = _softmax(w, scale, _keep(t, pad), t, alibi=alibi, softcap=softcap)
    part = torch.einsum("bnij,bnjd->bnid", p.to(v.dtype), _blocks(v, t, Dv, "k"))      # (B, nnz, bs, Dv)
    return _scatter_rows(part, t, t.heads, t.q_blocks, t.row), lse


def attention_torch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, t: AttentionTables,
                             scale: float, pad: Tensor | None = None, alibi: Tensor | None = None,
                             softcap: float = 0.0, dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) on the PyTorch path, by the formulas (no autograd: the custom op's CPU backward
    runs below the autograd dispatch key). dlse: None or the (B, H·q_ctx) gradient of the
    natural-log LSE, which adds dlse_i·P_ij to dS_ij (Δ_i = rowsum(dO∘O) − dlse_i)."""
    work = torch.promote_types(q.dtype, torch.float32)
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, do, o = (x.to(work) for x in (q, k, v, do, o))
    B, Tq, _ = q.shape
    H, bs = t.heads, t.block_size
    D, Hk, Dv = _head_dims(q, k, v, H)
    qb, kb, vb, dob = _blocks(q, t, D, "q"), _blocks(k, t, D, "k"), _blocks(v, t, Dv, "k"), _blocks(do, t, Dv, "q")
    w = torch.einsum("bnid,bnjd->bnij", qb, kb)                                            # (B, nnz, bs, bs)
    p, _ = _softmax(w, scale, _keep(t, pad), t, alibi=alibi, softcap=softcap)
    delta = (do * o).view(B, Tq // bs, bs, H, Dv).sum(-1).permute(0, 3, 1, 2)              # (B, H, nq, bs)
    if dlse is not None:
        delta = delta - dlse.to(work).view(B, H, Tq // bs, bs)
    ds = p * (torch.einsum("bnid,bnjd->bnij", dob, vb) - delta[:, t.h, t.i].unsqueeze(-1))
    if softcap:                                                 # d(c·tanh(x/c))/dx = 1 − tanh²(x/c)
        ds = ds * (1 - torch.tanh(w * (scale / softcap)).square())
    kv_row = torch.div(t.h, H // Hk, rounding_mode="floor") * t.k_blocks + t.j
    dq = _scatter_rows(torch.einsum("bnij,bnjd->bnid", ds, kb) * scale, t, H, t.q_blocks, t.row)
    dk = _scatter_rows(torch.einsum("bnij,bnid->bnjd", ds, qb) * scale, t, Hk, t.k_blocks, kv_row)
    dv = _scatter_rows(torch.einsum("bnij,bnid->bnjd", p, dob), t, Hk, t.k_blocks, kv_row)
    return tuple(x.to(dt) for x, dt in zip((dq, dk, dv), dtypes))


def _attn_ref(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, layout: str, scale: float,
              alibi: Tensor | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    o, lse = attention_torch(q, k, v, lookup(layout).on(q.device), scale, key_padding_mask, alibi, softcap)
    return o.contiguous(), lse


def _attn_bwd_ref(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, key_padding_mask: Tensor | None,
                  layout: str, scale: float, alibi: Tensor | None = None, softcap: float = 0.0,
                  dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return attention_torch_backward(do, q, k, v, o, lookup(layout).on(q.device), scale, key_padding_mask, alibi,
                                    softcap, dlse)


# --- kernel pair: torch.ops.bstrain.bst_attention and bst_attention_bwd, and their eager Function --------
_KERNELS = []


def _kernels():
    """bstrain.kernels.attention, imported on first use (it imports Triton)."""
    if not _KERNELS:
        from bstrain.kernels import attention
        _KERNELS.append(attention)
    return _KERNELS[0]


def _attn_forward(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, layout: str, scale: float,
                  alibi: Tensor | None = None, softcap: float = 0.0, *, luts=None) -> tuple[Tensor, Tensor]:
    """(O (B, Tq, H·Dv) in q's dtype, row LSE (B, H·Tq) base 2 of the modified scores, +inf for a
    row with no live key; fp32, fp64 for fp64 q): the fused kernels. ``layout`` is the key of the
    op's layout tables (:func:`bstrain.ops.tables.lookup`); alibi None or (H,) slopes on q's device
    (fp32 for the kernels); softcap 0.0 = off. ``luts``: the kernels' tables, where the caller has
    them (eager calls: no key lookup)."""
    K = _kernels()
    luts = lookup(layout).on(q.device).kernel_luts() if luts is None else luts
    return K.attention_forward(*K.kernel_inputs(q, k, v), luts, scale, key_padding_mask, alibi=alibi, softcap=softcap)


def _attn_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   key_padding_mask: Tensor | None, layout: str, scale: float, alibi: Tensor | None = None,
                   softcap: float = 0.0, dlse: Tensor | None = None, *, luts=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of bst_attention; dlse None or the (B, H·Tq) gradient of the natural-log LSE."""
    K = _kernels()
    luts = lookup(layout).on(q.device).kernel_luts() if luts is None else luts
    return K.attention_backward(do, *K.kernel_inputs(q, k, v), o, lse, luts, scale, key_padding_mask, dlse=dlse,
                                alibi=alibi, softcap=softcap)


def _attn_fake(q, k, v, key_padding_mask, layout, scale, alibi=None, softcap=0.0):
    heads = lookup(layout).host.heads
    B, Tq, _ = q.shape
    _, _, Dv = _head_dims(q, k, v, heads)
    return q.new_empty((B, Tq, heads * Dv)), \
        q.new_empty((B, heads * Tq), dtype=torch.promote_types(q.dtype, torch.float32))


def _output_grads(do: Tensor | None, dlse2: Tensor | None, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor | None]:
    """(dO, the natural-log LSE's gradient or None) from the gradients of O and of the base-2 LSE
    (either None when unused: grads are not materialised). An empty row's (+inf) gets 0, never NaN."""
    if do is None:
        do = torch.zeros_like(o)
    if dlse2 is None:
        return do, None
    return do, torch.where(torch.isinf(lse), 0.0, dlse2 * _LOG2E)             # lse2 = lse·log2(e)


def _attn_setup(ctx, inputs, output):
    q, k, v, pad, layout, scale, alibi, softcap = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], pad, alibi)
    ctx.layout, ctx.scale, ctx.softcap = layout, scale, softcap
    ctx.set_materialize_grads(False)                   # an unused LSE's gradient stays None: no dlse pass


def _attn_grads(ctx, bwd, do, dlse2):
    """dQ, dK, dV, through the LSE too."""
    q, k, v, o, lse, pad, alibi = ctx.saved_tensors
    do, dlse = _output_grads(do, dlse2, o, lse)
    dq, dk, dv = bwd(do, q, k, v, o, lse, pad, ctx.layout, ctx.scale, alibi, ctx.softcap, dlse,
                     luts=ctx.hints.get("luts"))
    return dq, dk, dv, None, None, None, None, None


_bst_attention_bwd = kernel_op(
    "bstrain::bst_attention_bwd", _attn_backward, ref=_attn_bwd_ref,
    fake=lambda do, q, k, v, o, lse, key_padding_mask, layout, scale, alibi=None, softcap=0.0, dlse=None: tuple(
        torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)))
_bst_attention = kernel_op("bstrain::bst_attention", _attn_forward, ref=_attn_ref, fake=_attn_fake,
                           setup=_attn_setup, backward=_attn_grads, bwd=_bst_attention_bwd)
bst_attention, bst_attention_bwd = _bst_attention.op, _bst_attention_bwd.op     # (importable, as before)
