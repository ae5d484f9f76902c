"""Block-sparse attention: the seed's ``BlocksparseTransformer`` on torch tensors, with autograd.

Activations are the seed's: q (batch, q_ctx, heads·head_dim), k and v (batch, k_ctx,
heads·head_dim); outputs have q's shape. A layout (q_ctx/bs, k_ctx/bs) is shared by all heads
(``heads=`` required), or (heads, q_ctx/bs, k_ctx/bs) gives each head its own; heads may have
different numbers of live blocks. ``mask_callback`` refines live blocks element by element, as
in the seed (:func:`bstrain.layout.attention_layout` builds both from one mask function).

**The block-sparse score tensor** of the unfused methods holds the live blocks of every head,
head by head and, within a head, in row-major (query block, key block) order:
``(batch, blocks, bs, bs)``, ``blocks = layout.sum()``. When every head has the same number of
blocks, ``w.view(batch, heads, blocks // heads, bs, bs)`` is the seed's shape.

The unfused methods run PyTorch (every device, fp16/bf16/fp32/fp64). ``attention`` runs the
flash-style kernels of :mod:`bstrain.kernels.attention`, which never store the scores, on CUDA
tensors of fp16/bf16/fp32 with head dims up to 128 (``backend="auto"``, the default), and PyTorch
otherwise, which materialises the scores of live blocks only. ``backend="torch"`` always takes
PyTorch; ``backend="triton"`` always takes the kernels (on CPU through Triton's interpreter,
``TRITON_INTERPRET=1``) and refuses inputs they do not take.
"""
from __future__ import annotations

import math
import os
import weakref

import numpy as np
import torch
from torch import Tensor

from bstrain.ops.library import eager

__all__ = ["BlocksparseTransformer", "attention_ref"]

_OPS: "dict[str, weakref.WeakSet]" = {}      # layout key -> the live ops with that layout (copies included)

BLOCK_SIZES = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_block_size(bs) -> int:
    if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or int(bs) not in BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {BLOCK_SIZES}, got {bs!r}")
    return int(bs)


class BlocksparseTransformer:
    """The seed's block-sparse attention op.

    Args:
        layout: (q_blocks, k_blocks) 0/1 array shared by all heads (then ``heads`` is required),
            or (heads, q_blocks, k_blocks).
        block_size: 16, 32, 64 or 128.
        heads: the number of heads, for a 2-D layout (or equal to a 3-D layout's first axis).
        mask_callback: ``(blk_shape, head_idx, qry_idx, key_idx, blk_idx) -> (bs, bs) bool``, called
            once per live block when the op is built; False elements are masked out.
    """

    def __init__(self, layout, block_size: int = 64, heads: int | None = None, mask_callback=None,
                 backend: str = "auto"):
        lay = np.asarray(layout.detach().cpu() if isinstance(layout, torch.Tensor) else layout)
        if lay.ndim not in (2, 3) or lay.size == 0 or not np.isin(lay, (0, 1)).all():
            raise ValueError(f"layout: expected a non-empty 2-D (q_blocks, k_blocks) or 3-D (heads, q_blocks, "
                             f"k_blocks) 0/1 array, got shape {lay.shape}")
        self.block_size = bs = _check_block_size(block_size)
        if lay.ndim == 2:
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise ValueError(f"heads: expected a positive int with a 2-D layout, got {heads!r}")
            lay = np.broadcast_to(lay, (heads,) + lay.shape)
        elif heads is not None and heads != lay.shape[0]:
            raise ValueError(f"heads: expected {lay.shape[0]} (the layout's first axis) or None, got {heads!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
        self.backend = backend
        if mask_callback is not None and not callable(mask_callback):
            raise TypeError(f"mask_callback: expected a function or None, got {type(mask_callback).__name__}")
        self.layout = np.ascontiguousarray(lay, dtype=bool)              # (H, nq, nk)
        self.heads, self.q_blocks, self.k_blocks = self.layout.shape
        h_idx, q_idx, k_idx = np.nonzero(self.layout)                    # head-major, row-major within a head
        self.blocks = int(h_idx.size)
        self._idx = torch.as_tensor(np.stack([h_idx, q_idx, k_idx]), dtype=torch.int64)   # (3, nnz)
        # element masks of partial blocks only, each distinct tile stored once: partial_idx[n]
        # indexes them, -1 for a full block
        partial_idx = np.full(self.blocks, -1, dtype=np.int64)
        partial, seen = [], {}
        if mask_callback is not None:
            for n, (h, i, j) in enumerate(zip(h_idx.tolist(), q_idx.tolist(), k_idx.tolist())):
                m = np.asarray(mask_callback((bs, bs), h, i, j, n))
                if m.shape != (bs, bs):
                    raise ValueError(f"mask_callback: expected a ({bs}, {bs}) array for block (head {h}, query "
                                     f"{i}, key {j}), got shape {m.shape}")
                if not m.all():
                    m = m.astype(bool)
                    key = np.packbits(m).tobytes()
                    if key not in seen:
                        seen[key] = len(partial)
                        partial.append(m)
                    partial_idx[n] = seen[key]
        self._partial_idx = partial_idx
        self._pmasks = np.stack(partial) if partial else np.zeros((0, bs, bs), dtype=bool)
        self._dev: dict = {}
        self._luts: dict = {}
        self._register()

    # --- shapes -----------------------------------------------------------------------------------
    @property
    def q_ctx(self) -> int:
        return self.q_blocks * self.block_size

    @property
    def k_ctx(self) -> int:
        return self.k_blocks * self.block_size

    def w_shape(self, batch: int) -> tuple[int, int, int, int]:
        """The score tensor's shape: (batch, blocks, bs, bs)."""
        return (batch, self.blocks, self.block_size, self.block_size)

    @property
    def _masks(self) -> torch.Tensor:
        """(nnz, bs, bs) bool element masks of every live block (the reference path's form)."""
        bs = self.block_size
        m = torch.ones(self.blocks, bs, bs, dtype=torch.bool)
        sel = np.nonzero(self._partial_idx >= 0)[0]
        m[torch.as_tensor(sel)] = torch.from_numpy(self._pmasks[self._partial_idx[sel]])
        return m

    def _tables(self, device: torch.device):
        t = self._dev.get(device)
        if t is None:
            h, i, j = (x.to(device) for x in self._idx)
            t = self._dev[device] = (h, i, j, h * self.q_blocks + i, self._masks.to(device))
        return t

    def luts(self, device: torch.device):
        """The kernels' row and column lists on ``device``, built on first use."""
        luts = self._luts.get(device)
        if luts is None:
            from bstrain.kernels.attention import make_luts
            h, i, j = (x.numpy() for x in self._idx)
            luts = self._luts[device] = make_luts(h, i, j, self._partial_idx, self._pmasks, self.heads,
                                                  self.q_blocks, self.k_blocks, self.block_size, device)
        return luts

    def _use_kernels(self, q: torch.Tensor, head_dim: int) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "auto":
            return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and head_dim <= 128
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"q: the Triton backend takes float16, bfloat16 or float32, got {q.dtype}")
        if head_dim > 128:
            raise ValueError(f"q: the Triton backend takes head dims up to 128, got {head_dim}")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"q: backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a tensor on "
                             f"{q.device}")
        return True

    # --- checks -------------------------------------------------------------------------------------
    def _check_act(self, name: str, x, ctx: int, like=None) -> int:
        """x: (batch, ctx, heads·head_dim); returns head_dim."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.dim() != 3 or x.shape[1] != ctx or x.shape[2] % self.heads or x.shape[2] == 0:
            raise ValueError(f"{name}: expected (batch, {ctx}, heads·head_dim) with heads={self.heads}, got "
                             f"{tuple(x.shape)}")
        if like is not None:
            if x.shape[0] != like.shape[0] or x.dtype != like.dtype or x.device != like.device:
                raise ValueError(f"{name}: expected batch {like.shape[0]}, {like.dtype} on {like.device} (as q), got "
                                 f"batch {x.shape[0]}, {x.dtype} on {x.device}")
        return x.shape[2] // self.heads

    def _check_w(self, w, batch: int | None = None) -> None:
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or tuple(w.shape[1:]) != self.w_shape(1)[1:] \
                or (batch is not None and w.shape[0] != batch):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"w: expected the score tensor (batch, {self.blocks}, {self.block_size}, "
                             f"{self.block_size}), got {got}")
        if w.dtype not in _FLOATS:
            raise TypeError(f"w: expected a floating tensor, got {w.dtype}")

    # --- block views ----------------------------------------------------------------------------------
    def _blocks_of(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """(batch, ctx, H·D) -> (batch, nnz, bs, D): the query (or key) block of every live block."""
        B, T, HD = x.shape
        bs, H = self.block_size, self.heads
        xb = x.reshape(B, T // bs, bs, H, HD // H).permute(0, 3, 1, 2, 4)   # (B, H, n, bs, D)
        h, i, j, _, _ = self._tables(x.device)
        return xb[:, h, i if which == "q" else j]

    # --- the seed's unfused methods ---------------------------------------------------------------------
    def query_key_op(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Scores q·kᵀ of the live blocks: (batch, blocks, bs, bs) (see the module docstring)."""
        self._check_act("q", q, self.q_ctx)
        self._check_act("k", k, self.k_ctx, like=q)
        return torch.einsum("bnid,bnjd->bnij", self._blocks_of(q, "q"), self._blocks_of(k, "k"))

    def masked_softmax(self, w: torch.Tensor, scale: float = 1.0, autoregress_at_key: int | None = None,
                       key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax of ``scale·w`` over each query's live keys (all its blocks in the layout), with
        the element masks applied. ``autoregress_at_key``: keys after this position are masked too
        (the seed's incremental decoding: a key before this position is seen by every query, a later
        one only by queries at or after it). A query with no live key gets zeros. Math in fp32
        (fp64 for fp64 w); returns w's dtype."""
        self._check_w(w)
        h, i, j, row, masks = self._tables(w.device)
        keep = masks.unsqueeze(0)                                         # (1, nnz, bs, bs)
        if autoregress_at_key is not None:
            a = autoregress_at_key
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < self.k_ctx:
                raise ValueError(f"autoregress_at_key: expected an int key position in [0, {self.k_ctx}), got {a!r}")
            r = torch.arange(self.block_size, device=w.device)
            kpos = (j[:, None] * self.block_size + r)[None, :, None, :]                   # (1, nnz, 1, bs)
            qpos = (i[:, None] * self.block_size + r)[None, :, :, None]                   # (1, nnz, bs, 1)
            keep = keep & ((kpos < a) | (kpos <= qpos))
        if key_padding_mask is not None:
            keep = keep & self._key_keep(key_padding_mask, w.shape[0], w.device)
        return self._softmax(w, scale, keep)[0]

    def _softmax(self, w, scale, keep):
        """(P in w's dtype, row LSE (batch, heads·q_ctx) base 2, +inf for a row with no live key)."""
        row = self._tables(w.device)[3]
        work = torch.promote_types(w.dtype, torch.float32)
        x = w.to(work) * scale
        x = x.masked_fill(~keep, float("-inf"))
        B, n_rows = w.shape[0], self.heads * self.q_blocks
        blk_max = x.detach().amax(-1)                                     # (B, nnz, bs)
        row_max = blk_max.new_full((B, n_rows, self.block_size), float("-inf"))
        row_max = row_max.scatter_reduce(1, row[None, :, None].expand_as(blk_max), blk_max, "amax")
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        e = torch.exp(x - row_max[:, row].unsqueeze(-1))                  # masked: exp(-inf) = 0
        den = e.new_zeros(B, n_rows, self.block_size).index_add(1, row, e.sum(-1))
        lse = torch.where(den > 0, (row_max + torch.log(den)) * _LOG2E, float("inf")).reshape(B, -1)
        den = torch.where(den > 0, den, 1.0)
        return (e / den[:, row].unsqueeze(-1)).to(w.dtype), lse.float()

    def _key_keep(self, key_padding_mask, batch: int, device) -> torch.Tensor:
        """(batch, k_ctx) bool, True = padding (ignored, as nn.MultiheadAttention) -> keep (B, nnz, 1, bs)."""
        self._check_pad(key_padding_mask, batch, device)
        _, _, j, _, _ = self._tables(device)
        pad = key_padding_mask.view(batch, self.k_blocks, self.block_size)[:, j]     # (B, nnz, bs)
        return ~pad.unsqueeze(2)

    def _check_pad(self, key_padding_mask, batch: int, device) -> None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool \
                or tuple(key_padding_mask.shape) != (batch, self.k_ctx):
            got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}"
                   if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask: expected a bool ({batch}, {self.k_ctx}) tensor (True = padding), "
                             f"got {got}")
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask: expected device {device}, got {key_padding_mask.device}")

    def weight_value_op(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Σ over live blocks of w·v: (batch, q_ctx, heads·head_dim) in v's dtype."""
        D = self._check_act("v", v, self.k_ctx)
        self._check_w(w, v.shape[0])
        h, i, j, row, _ = self._tables(v.device)
        B, bs = v.shape[0], self.block_size
        part = torch.einsum("bnij,bnjd->bnid", w.to(v.dtype), self._blocks_of(v, "k"))   # (B, nnz, bs, D)
        out = part.new_zeros(B, self.heads * self.q_blocks, bs, D).index_add(1, row, part)
        out = out.view(B, self.heads, self.q_blocks, bs, D).permute(0, 2, 3, 1, 4)
        return out.reshape(B, self.q_ctx, self.heads * D)

    # --- fused ---------------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q·kᵀ·scale, masked)·v on the live blocks. q: (batch, q_ctx, H·D); k, v:
        (batch, k_ctx, H·D); scale defaults to 1/sqrt(D); key_padding_mask: (batch, k_ctx) bool,
        True = padding. Returns (batch, q_ctx, H·D) in q's dtype; a query with no live key gives 0."""
        D = self._check_act("q", q, self.q_ctx)
        self._check_act("k", k, self.k_ctx, like=q)
        self._check_act("v", v, self.k_ctx, like=q)
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        if self._use_kernels(q, D):
            if key_padding_mask is not None:
                self._check_pad(key_padding_mask, q.shape[0], q.device)
            if eager(q):
                return _AttentionFn.apply(q, k, v, key_padding_mask, self.luts(q.device), scale)
            return torch.ops.bstrain.bst_attention(q, k, v, key_padding_mask, self.key, scale)[0]
        return self._attention_torch(q, k, v, scale, key_padding_mask)[0]

    def _attention_torch(self, q, k, v, scale: float, key_padding_mask=None):
        """(O, LSE) on the PyTorch path."""
        w = self.query_key_op(q, k)
        keep = self._tables(q.device)[4].unsqueeze(0)
        if key_padding_mask is not None:
            keep = keep & self._key_keep(key_padding_mask, q.shape[0], q.device)
        p, lse = self._softmax(w, scale, keep)
        return self.weight_value_op(p, v), lse

    def _attention_backward_torch(self, do, q, k, v, o, scale: float, key_padding_mask=None):
        """(dq, dk, dv) on the PyTorch path, by the formulas (no autograd: the custom op's CPU
        backward runs below the autograd dispatch key)."""
        work = torch.promote_types(q.dtype, torch.float32)
        dtypes = (q.dtype, k.dtype, v.dtype)
        q, k, v, do, o = (t.to(work) for t in (q, k, v, do, o))
        B, Tq, HD = q.shape
        H, bs = self.heads, self.block_size
        D = HD // H
        h, i, j, row, masks = self._tables(q.device)
        keep = masks.unsqueeze(0)
        if key_padding_mask is not None:
            keep = keep & self._key_keep(key_padding_mask, B, q.device)
        p, _ = self._softmax(self.query_key_op(q, k), scale, keep)                   # (B, nnz, bs, bs)
        qb, kb, vb = self._blocks_of(q, "q"), self._blocks_of(k, "k"), self._blocks_of(v, "k")   # (B, nnz, bs, D)
        dob = self._blocks_of(do, "q")
        delta = (do * o).view(B, Tq // bs, bs, H, D).sum(-1).permute(0, 3, 1, 2)  # (B, H, nq, bs)
        ds = p * (torch.einsum("bnid,bnjd->bnij", dob, vb) - delta[:, h, i].unsqueeze(-1))

        def scatter(part, n_blocks, idx):                                         # (B, nnz, bs, D) -> (B, T, HD)
            out = part.new_zeros(B, H * n_blocks, bs, D).index_add(1, h * n_blocks + idx, part)
            return out.view(B, H, n_blocks, bs, D).permute(0, 2, 3, 1, 4).reshape(B, n_blocks * bs, HD)
        dq = scatter(torch.einsum("bnij,bnjd->bnid", ds, kb) * scale, self.q_blocks, i)
        dk = scatter(torch.einsum("bnij,bnid->bnjd", ds, qb) * scale, self.k_blocks, j)
        dv = scatter(torch.einsum("bnij,bnid->bnjd", p, dob), self.k_blocks, j)
        return tuple(t.to(dt) for t, dt in zip((dq, dk, dv), dtypes))

    # --- registration for torch.ops.bstrain.bst_attention ----------------------------------------------
    def _register(self) -> None:
        import hashlib
        h = hashlib.blake2b(digest_size=12)
        for a in (np.asarray(self.layout.shape), np.packbits(self.layout), self._partial_idx,
                  np.packbits(self._pmasks)):
            h.update(np.ascontiguousarray(a).tobytes())
        self.key = f"attn-bs{self.block_size}-{h.hexdigest()}"
        _OPS.setdefault(self.key, weakref.WeakSet()).add(self)

    def __setstate__(self, state):            # copies and unpickled ops name live tables too
        self.__dict__.update(state)
        self._register()

    def __repr__(self) -> str:
        return (f"BlocksparseTransformer(heads={self.heads}, q_blocks={self.q_blocks}, k_blocks={self.k_blocks}, "
                f"block_size={self.block_size}, blocks={self.blocks})")


class _AttentionFn(torch.autograd.Function):
    """The fused kernels: O and the row statistics forward; dQ, dK, dV backward."""

    @staticmethod
    def forward(ctx, q, k, v, pad, luts, scale):
        from bstrain.kernels.attention import attention_forward
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = attention_forward(q, k, v, luts, scale, pad)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.pad, ctx.luts, ctx.scale = pad, luts, scale
        return o

    @staticmethod
    def backward(ctx, do):
        from bstrain.kernels.attention import attention_backward
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.luts, ctx.scale, ctx.pad)
        return dq, dk, dv, None, None, None


def attention_ref(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense masked attention, the tests' reference: mask (heads, q_ctx, k_ctx) or (batch, heads,
    q_ctx, k_ctx) bool; rows with no kept key give zeros."""
    B, Tq, HD = q.shape
    H = mask.shape[-3]
    D = HD // H
    qh, kh, vh = (t.view(B, t.shape[1], H, D).transpose(1, 2) for t in (q, k, v))
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    p = torch.where(mask.any(-1, keepdim=True), p, 0.0)
    return (p @ vh).transpose(1, 2).reshape(B, Tq, HD)


# --- torch.ops.bstrain.bst_attention: the fused kernels as a custom op (traced calls) --------------
def _op_of(key: str) -> BlocksparseTransformer:
    for op in _OPS.get(key, ()):
        return op
    raise RuntimeError(f"layout: no BlocksparseTransformer is registered under {key!r}; build it in this "
                       f"process before running a graph that uses it")


@torch.library.custom_op("bstrain::bst_attention", mutates_args=())
def bst_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, layout: str,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(O like q, row LSE (batch, heads·q_ctx) fp32, base 2). CUDA: the fused kernels; CPU: PyTorch."""
    op = _op_of(layout)
    if q.is_cuda:
        from bstrain.kernels.attention import attention_forward
        return attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), op.luts(q.device), scale,
                                 key_padding_mask)
    o, lse = op._attention_torch(q, k, v, scale, key_padding_mask)
    return o.contiguous(), lse


@bst_attention.register_fake
def _(q, k, v, key_padding_mask, layout, scale):
    op = _op_of(layout)
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((q.shape[0], op.heads * q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("bstrain::bst_attention_bwd", mutates_args=())
def bst_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                      key_padding_mask: Tensor | None, layout: str, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of bst_attention."""
    op = _op_of(layout)
    if q.is_cuda:
        from bstrain.kernels.attention import attention_backward
        return attention_backward(do, q.contiguous(), k.contiguous(), v.contiguous(), o, lse, op.luts(q.device),
                                  scale, key_padding_mask)
    return op._attention_backward_torch(do, q, k, v, o, scale, key_padding_mask)


@bst_attention_bwd.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, layout, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attn_setup(ctx, inputs, output):
    q, k, v, pad, layout, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], pad)
    ctx.layout, ctx.scale = layout, scale
    ctx.mark_non_differentiable(output[1])


def _attn_backward(ctx, do, _dlse):
    q, k, v, o, lse, pad = ctx.saved_tensors
    dq, dk, dv = bst_attention_bwd(do, q, k, v, o, lse, pad, ctx.layout, ctx.scale)
    return dq, dk, dv, None, None, None


bst_attention.register_autograd(_attn_backward, setup_context=_attn_setup)
