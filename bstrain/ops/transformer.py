"""Block-sparse attention: the seed's ``BlocksparseTransformer`` on torch tensors, with autograd.

Activations are the seed's: q (batch, q_ctx, heads·head_dim), k (batch, k_ctx,
kv_heads·head_dim) and v (batch, k_ctx, kv_heads·v_head_dim); outputs are (batch, q_ctx,
heads·v_head_dim), q's shape when v's head dim is q's (as usual; SDPA allows another).
``kv_heads`` divides ``heads`` (grouped-query attention, as
``F.scaled_dot_product_attention(..., enable_gqa=True)``: query head h reads k/v head
``h // (heads / kv_heads)``); usually it equals ``heads``. ``attention`` also returns the rows'
log-sum-exp on request and takes FlexAttention's ALiBi and tanh soft-capping score_mods. A layout (q_ctx/bs, k_ctx/bs)
is shared by all heads (``heads=`` required), or (heads, q_ctx/bs, k_ctx/bs) gives each head its
own; heads may have different numbers of live blocks. ``mask_callback`` refines live blocks
element by element, as in the seed (:func:`bstrain.layout.attention_layout` builds both from one
mask function).

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

This file holds the seed's class and its argument checks. The layout tables, the reference
(:func:`attention_ref` and the PyTorch path) and the custom ops ``torch.ops.bstrain.bst_attention``
and ``bst_attention_bwd`` with their eager ``autograd.Function`` are in
:mod:`bstrain.ops._attention_ops`; their public names are importable from here too.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import warnings

import numpy as np
import torch
from torch import Tensor

from bstrain.layout import BLOCK_SIZES, KERNEL_BLOCK_SIZES, check_block_size  # noqa: F401  (BLOCK_SIZES: importable here)
from bstrain.ops._attention_ops import (  # noqa: F401  (the public names: importable from here, as before)
    AttentionTables, _blocks, _bst_attention, _check_dtype, _keep, _kernels, _scatter_rows, _softmax, _tables_on,
    alibi_slopes, attention_ref, attention_torch, attention_torch_backward, bst_attention, bst_attention_bwd,
)
from bstrain.ops._checks import FLOATS, KERNEL_FLOATS
from bstrain.ops.tables import eager, layout_tables

__all__ = ["BlocksparseTransformer", "attention_ref", "alibi_slopes", "AttentionTables"]

_LN2 = math.log(2.0)


# --- the seed's API ------------------------------------------------------------------------------------
class BlocksparseTransformer:
    """The seed's block-sparse attention op.

    Args:
        layout: (q_blocks, k_blocks) 0/1 array shared by all heads (then ``heads`` is required),
            or (heads, q_blocks, k_blocks).
        block_size: 16, 32, 64 or 128.
        heads: the number of heads, for a 2-D layout (or equal to a 3-D layout's first axis).
        mask_callback: ``(blk_shape, head_idx, qry_idx, key_idx, blk_idx) -> (bs, bs) bool``, called
            once per live block when the op is built (blk_idx counts a head's blocks from 0; a 2-D
            layout is asked once, as head 0, for every head); False elements are masked out.
        backend: "auto", "torch" or "triton" (see the module docstring).
    """

    def __init__(self, layout, block_size: int = 64, heads: int | None = None, mask_callback=None,
                 name: str | None = None, backend: str = "auto"):
        if name in ("auto", "torch", "triton") and backend == "auto":   # backend was the 5th positional argument
            warnings.warn("BlocksparseTransformer: pass backend= by keyword; the 5th positional argument is now the "
                          "seed's name", DeprecationWarning, stacklevel=2)
            backend, name = name, None
        lay = np.asarray(layout.detach().cpu() if isinstance(layout, torch.Tensor) else layout)
        if lay.ndim not in (2, 3) or lay.size == 0 or not np.isin(lay, (0, 1)).all():
            raise ValueError(f"layout: expected a non-empty 2-D (q_blocks, k_blocks) or 3-D (heads, q_blocks, "
                             f"k_blocks) 0/1 array, got shape {lay.shape}")
        self.block_size = bs = check_block_size(block_size)
        shared = lay.ndim == 2
        if shared:
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise ValueError(f"heads: expected a positive int with a 2-D layout, got {heads!r}")
            lay = np.broadcast_to(lay, (heads,) + lay.shape)
        elif heads is not None and heads != lay.shape[0]:
            raise ValueError(f"heads: expected {lay.shape[0]} (the layout's first axis) or None, got {heads!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
        if mask_callback is not None and not callable(mask_callback):
            raise TypeError(f"mask_callback: expected a function or None, got {type(mask_callback).__name__}")
        self.backend = backend
        self.layout = np.ascontiguousarray(lay, dtype=bool)              # (H, nq, nk)
        self.heads, self.q_blocks, self.k_blocks = self.layout.shape
        self.q_ctx, self.k_ctx = self.q_blocks * bs, self.k_blocks * bs   # positions
        self.blocks = int(self.layout.sum())
        # the seed's attribute names
        self.name, self.blk_size, self.ctx_blks_q, self.ctx_blks_k = name, bs, self.q_blocks, self.k_blocks
        self.lut_heads = 1 if shared else self.heads
        self._partial_idx, self._pmasks = _element_masks(self.layout, bs, mask_callback, shared)
        # shared by equal layouts; real CPU tensors now, one copy per device (bstrain.ops.tables)
        self._tables = layout_tables("attention", self.layout, bs, self._partial_idx, self._pmasks)
        self.key = self._tables.key                                     # names the layout in bst_attention calls

    # --- shapes -----------------------------------------------------------------------------------
    def w_shape(self, batch: int) -> tuple[int, int, int, int]:
        """The score tensor's shape: (batch, blocks, bs, bs)."""
        return (batch, self.blocks, self.block_size, self.block_size)

    def dense_mask(self) -> Tensor:
        """(heads, q_ctx, k_ctx) bool on the CPU: the layout with each live block's element mask."""
        t, bs = self._tables.host, self.block_size
        m = torch.zeros(self.heads, self.q_blocks, self.k_blocks, bs, bs, dtype=torch.bool, device="cpu")
        m[t.h, t.i, t.j] = t.tiles[t.tile_of]
        return m.transpose(2, 3).reshape(self.heads, self.q_ctx, self.k_ctx)

    def luts(self, device: torch.device | str):
        """The kernels' row and column lists on ``device``."""
        return self._tables.on(device).kernel_luts()

    def _use_kernels(self, q: Tensor, D: int, Dv: int) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "auto":
            return q.is_cuda and q.dtype in KERNEL_FLOATS and max(D, Dv) <= 128 \
                and self.block_size in KERNEL_BLOCK_SIZES
        if self.block_size not in KERNEL_BLOCK_SIZES:
            raise ValueError(f"block_size: the Triton backend takes blocks of {KERNEL_BLOCK_SIZES}, got "
                             f"{self.block_size} (backend='auto' runs it on the PyTorch path)")
        if q.dtype not in KERNEL_FLOATS:
            raise TypeError(f"q: the Triton backend takes float16, bfloat16 or float32, got {q.dtype}")
        for name, d in (("q", D), ("v", Dv)):
            if d > 128:
                raise ValueError(f"{name}: the Triton backend takes head dims up to 128, got {d}")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"q: backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a tensor on "
                             f"{q.device}")
        return True

    # --- checks -------------------------------------------------------------------------------------
    def _check_act(self, name: str, x, ctx: int, like=None) -> int:
        """x: (batch, ctx, heads·head_dim); returns head_dim."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOATS:
            raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.dim() != 3 or x.shape[1] != ctx or x.shape[2] % self.heads or x.shape[2] == 0:
            raise ValueError(f"{name}: expected (batch, {ctx}, heads·head_dim) with heads={self.heads}, got "
                             f"{tuple(x.shape)}")
        if like is not None:
            self._check_like(name, x, like)
        return x.shape[2] // self.heads

    @staticmethod
    def _check_like(name: str, x, like) -> None:
        if x.shape[0] != like.shape[0] or x.dtype != like.dtype or x.device != like.device:
            raise ValueError(f"{name}: expected batch {like.shape[0]}, {like.dtype} on {like.device} (as q), got "
                             f"batch {x.shape[0]}, {x.dtype} on {x.device}")

    def _check_qkv(self, q, k, v) -> tuple[int, int]:
        """q (batch, q_ctx, heads·D); k (batch, k_ctx, kv_heads·D), kv_heads dividing heads; v
        (batch, k_ctx, kv_heads·Dv), any value head dim Dv; one dtype and device. Returns (D, Dv).
        Valid arguments cost a few integer comparisons (an eager call's host time is the point);
        anything else goes through :meth:`_explain_qkv`, which names the argument at fault."""
        try:
            if torch.compiler.is_compiling():       # dynamic shapes: the widths (head dims) are constants of
                for x in (q, k, v):                 # the graph, as for the kernels; the batch is what varies
                    if isinstance(x, Tensor) and x.dim() == 3:
                        torch._dynamo.mark_static(x, 2)
            B, T, HD = q.shape
            Bk, Tk, HDk = k.shape
            Bv, Tv, HDv = v.shape
            D = HD // self.heads
            Hk = HDk // D
            if T == self.q_ctx and Tk == self.k_ctx and B == Bk == Bv and Tv == Tk and HD == D * self.heads \
                    and HDk == Hk * D and self.heads % Hk == 0 and HDv % Hk == 0 and HDv > 0 \
                    and q.dtype in FLOATS and k.dtype is q.dtype and v.dtype is q.dtype \
                    and q.get_device() == k.get_device() == v.get_device():
                return D, HDv // Hk
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            pass
        return self._explain_qkv(q, k, v)

    def _explain_qkv(self, q, k, v) -> tuple[int, int]:
        D = self._check_act("q", q, self.q_ctx)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dtype not in FLOATS:
                got = x.dtype if isinstance(x, Tensor) else type(x).__name__
                raise TypeError(f"{name}: expected a float16, bfloat16, float32 or float64 tensor, got {got}")
        if k.dim() != 3 or k.shape[1] != self.k_ctx or k.shape[2] % D or k.shape[2] == 0 \
                or self.heads % (k.shape[2] // D):
            raise ValueError(f"k: expected (batch, {self.k_ctx}, kv_heads·{D}) with kv_heads dividing "
                             f"heads={self.heads}, got {tuple(k.shape)}")
        Hk = k.shape[2] // D
        if v.dim() != 3 or v.shape[1] != self.k_ctx or v.shape[2] % Hk or v.shape[2] == 0:
            raise ValueError(f"v: expected (batch, {self.k_ctx}, {Hk}·Dv) (k's {Hk} kv heads; any value head "
                             f"dim Dv), got {tuple(v.shape)}")
        for name, x in (("k", k), ("v", v)):
            self._check_like(name, x, q)
        return D, v.shape[2] // Hk

    def _check_w(self, w, batch: int | None = None) -> None:
        if not isinstance(w, Tensor) or w.dim() != 4 or tuple(w.shape[1:]) != self.w_shape(1)[1:] \
                or (batch is not None and w.shape[0] != batch):
            got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(f"w: expected the score tensor (batch, {self.blocks}, {self.block_size}, "
                             f"{self.block_size}), got {got}")
        if w.dtype not in FLOATS:
            raise TypeError(f"w: expected a floating tensor, got {w.dtype}")

    def _check_pad(self, key_padding_mask, batch: int, device) -> None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
                or key_padding_mask.shape != (batch, self.k_ctx):
            got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}"
                   if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask: expected a bool ({batch}, {self.k_ctx}) tensor (True = padding), "
                             f"got {got}")
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask: expected device {device}, got {key_padding_mask.device}")

    # --- the seed's unfused methods ---------------------------------------------------------------------
    def query_key_op(self, q: Tensor, k: Tensor, name: str | None = None, bench=0) -> Tensor:
        """Scores q·kᵀ of the live blocks: (batch, blocks, bs, bs) (see the module docstring). The
        seed's ``name`` and ``bench`` are accepted and ignored."""
        D, _ = self._check_qkv(q, k, k)
        t = _tables_on(self._tables, q.device)
        return torch.einsum("bnid,bnjd->bnij", _blocks(q, t, D, "q"), _blocks(k, t, D, "k"))

    def softmax(self, w: Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> Tensor:
        """Softmax of ``scale·w`` over each query's live blocks, without the element masks of
        ``mask_callback`` (the seed's unmasked softmax). Math in fp32; returns ``dtype`` (default
        w's)."""
        self._check_w(w)
        _check_dtype("dtype", dtype)
        t = _tables_on(self._tables, w.device)
        keep = torch.ones((1,) + tuple(w.shape[1:]), dtype=torch.bool, device=w.device)
        return _softmax(w, scale, keep, t, dtype)[0]

    def masked_softmax(self, w: Tensor, scale: float = 1.0, autoregress_at_key: int | None = None,
                       dtype: torch.dtype | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        """Softmax of ``scale·w`` over each query's live keys (all its blocks in the layout), with
        the element masks applied. ``autoregress_at_key``: keys after this position are masked too
        (the seed's incremental decoding: a key before this position is seen by every query, a later
        one only by queries at or after it). A query with no live key gets zeros. Math in fp32
        (fp64 for fp64 w); returns ``dtype`` (default w's)."""
        self._check_w(w)
        _check_dtype("dtype", dtype)
        t = _tables_on(self._tables, w.device)
        if key_padding_mask is not None:
            self._check_pad(key_padding_mask, w.shape[0], w.device)
        keep = _keep(t, key_padding_mask)
        if autoregress_at_key is not None:
            a = autoregress_at_key
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < self.k_ctx:
                raise ValueError(f"autoregress_at_key: expected an int key position in [0, {self.k_ctx}), got {a!r}")
            r = torch.arange(self.block_size, device=w.device)
            kpos = (t.j[:, None] * self.block_size + r)[None, :, None, :]                 # (1, nnz, 1, bs)
            qpos = (t.i[:, None] * self.block_size + r)[None, :, :, None]                 # (1, nnz, bs, 1)
            keep = keep & ((kpos < a) | (kpos <= qpos))
        return _softmax(w, scale, keep, t, dtype)[0]

    def weight_value_op(self, w: Tensor, v: Tensor, name: str | None = None, bench=0) -> Tensor:
        """Σ over live blocks of w·v: (batch, q_ctx, heads·head_dim) in v's dtype. The seed's
        ``name`` and ``bench`` are accepted and ignored."""
        D = self._check_act("v", v, self.k_ctx)
        self._check_w(w, v.shape[0])
        t = _tables_on(self._tables, v.device)
        part = torch.einsum("bnij,bnjd->bnid", w.to(v.dtype), _blocks(v, t, D, "k"))     # (B, nnz, bs, D)
        return _scatter_rows(part, t, self.heads, self.q_blocks, t.row)

    # --- fused ---------------------------------------------------------------------------------------
    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                  key_padding_mask: Tensor | None = None, *, return_lse: bool = False, alibi=None,
                  softcap: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """softmax(s, masked)·v on the live blocks, s the scores q·kᵀ·scale, soft-capped to
        ``softcap·tanh(s/softcap)``, plus ALiBi's ``slope[h]·(k_pos − q_pos)`` (FlexAttention's
        score_mod examples; positions count from the layout's first).

        Args:
            q: (batch, q_ctx, H·D); k: (batch, k_ctx, Hk·D), Hk dividing H (grouped-query);
                v: (batch, k_ctx, Hk·Dv), Dv any value head dim.
            scale: defaults to 1/sqrt(D).
            key_padding_mask: (batch, k_ctx) bool, True = padding.
            return_lse: also return the row log-sum-exp (batch, H, q_ctx), natural log, −inf for a
                query with no live key; fp32 (fp64 for fp64 q); differentiable.
            alibi: None, True (the standard slopes of H heads, :func:`alibi_slopes`) or H slopes
                (a sequence, or an (H,) tensor, best on q's device; one on a GPU is not checked for
                finiteness: that would sync the host). The slopes get no gradient.
            softcap: None (off) or a positive number.

        Returns (batch, q_ctx, H·Dv) in q's dtype (a query with no live key gives 0), or (out, lse).
        """
        D, Dv = self._check_qkv(q, k, v)
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        if key_padding_mask is not None:
            self._check_pad(key_padding_mask, q.shape[0], q.device)
        slopes, cap = _check_alibi(alibi, self.heads, q.device, q.dtype), _check_softcap(softcap)
        o, lse = self._attend(q, k, v, scale, key_padding_mask, slopes, cap, self._use_kernels(q, D, Dv))
        return (o, _natural_lse(lse, self.heads)) if return_lse else o

    def _attend(self, q, k, v, scale, pad, alibi, softcap, kernels: bool) -> tuple[Tensor, Tensor]:
        """(O, LSE (B, H·q_ctx) base 2): eager kernels, the custom op (traced) or PyTorch."""
        if not kernels:
            return attention_torch(q, k, v, _tables_on(self._tables, q.device), scale, pad, alibi, softcap)
        if eager(q):          # the kernels' inputs and tables now: the Function saves them, the backward reuses them
            q, k, v = _kernels().kernel_inputs(q, k, v)      # views of a fused qkv projection stay views
            luts = self._tables.on(q.device).kernel_luts()
            return _bst_attention(q, k, v, pad, self.key, scale, alibi, softcap, luts=luts)
        return _bst_attention(q, k, v, pad, self.key, scale, alibi, softcap)

    def __repr__(self) -> str:
        return (f"BlocksparseTransformer(heads={self.heads}, q_blocks={self.q_blocks}, k_blocks={self.k_blocks}, "
                f"block_size={self.block_size}, blocks={self.blocks}, backend={self.backend!r})")


def _element_masks(layout: np.ndarray, bs: int, mask_callback, shared: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(partial_idx (nnz,) int64, -1 for a full block; masks (distinct, bs, bs) bool): each live
    block's element mask from the seed's ``mask_callback``, each distinct partial tile stored once.
    As in the seed, the callback's ``blk_idx`` counts a head's blocks from 0, and a layout shared by
    every head (``shared``) is asked once, as head 0, for all of them."""
    h_idx, q_idx, k_idx = np.nonzero(layout)                           # head-major, row-major within a head
    first = np.searchsorted(h_idx, np.arange(layout.shape[0]))          # each head's first block
    partial_idx = np.full(h_idx.size, -1, dtype=np.int64)
    partial, seen, asked = [], {}, {}
    if mask_callback is not None:
        for n, (h, i, j) in enumerate(zip(h_idx.tolist(), q_idx.tolist(), k_idx.tolist())):
            b = n - int(first[h])
            if shared and h > 0:
                partial_idx[n] = asked[b]
                continue
            m = np.asarray(mask_callback((bs, bs), h, i, j, b))
            if m.shape != (bs, bs):
                raise ValueError(f"mask_callback: expected a ({bs}, {bs}) array for block (head {h}, query {i}, "
                                 f"key {j}), got shape {m.shape}")
            if not m.all():
                m = m.astype(bool)
                key = np.packbits(m).tobytes()
                if key not in seen:
                    seen[key] = len(partial)
                    partial.append(m)
                partial_idx[n] = seen[key]
            asked[b] = partial_idx[n]
    return partial_idx, (np.stack(partial) if partial else np.zeros((0, bs, bs), dtype=bool))


# --- argument checks of the score modifications and the returned LSE ---------------------------------------
def _check_alibi(alibi, heads: int, device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """None, or the (H,) slopes on ``device`` in fp32 (fp64 for an fp64 ``dtype``). alibi: None,
    True (the standard slopes), or H finite numbers as a sequence or a tensor (finiteness is
    checked unless the tensor is on a GPU or traced: that check would sync the host)."""
    if alibi is None or alibi is False:
        return None
    dtype = torch.promote_types(dtype, torch.float32)
    if alibi is True:
        alibi = alibi_slopes(heads)
    if isinstance(alibi, Tensor):
        if not alibi.dtype.is_floating_point:
            raise TypeError(f"alibi: expected a floating tensor of {heads} slopes, got {alibi.dtype}")
        if tuple(alibi.shape) != (heads,):
            raise ValueError(f"alibi: expected {heads} slopes (one per head), got shape {tuple(alibi.shape)}")
        if alibi.device.type == "cpu" and eager(alibi) and not torch.isfinite(alibi).all():
            raise ValueError(f"alibi: expected finite slopes, got {alibi.tolist()}")
        return alibi.detach().to(device, dtype).contiguous()       # constants: no gradient on any backend
    if not isinstance(alibi, (list, tuple, np.ndarray)) \
            or not all(isinstance(a, numbers.Real) and not isinstance(a, bool) for a in alibi):
        raise TypeError(f"alibi: expected None, True, or {heads} slopes (a sequence of numbers or a tensor), "
                        f"got {alibi!r}")
    if len(alibi) != heads or not all(-math.inf < a < math.inf for a in alibi):     # (SymFloats too: no isfinite)
        if torch.compiler.is_compiling():           # the values may be symbolic (a SymFloat formats in no f-string)
            raise ValueError("alibi: expected finite slopes, one per head")
        raise ValueError(f"alibi: expected {heads} finite slopes (one per head), got {list(alibi)}")
    values = tuple(float(a) for a in alibi)
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _slopes_on(values, device, dtype)


@functools.lru_cache(maxsize=64)
def _slopes_on(values: tuple, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Slopes given as numbers (or ``alibi=True``), on ``device`` once: a copy at every call would
    wait for the host, and break CUDA-graph capture. A tensor on q's device is taken as it is."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def _check_softcap(softcap) -> float:
    """softcap as a float, 0.0 for None (off)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a positive number or None, got {type(softcap).__name__}")
    if not 0 < softcap < math.inf:      # (not math.isfinite: torch.compile passes a changed softcap as a SymFloat)
        raise ValueError(f"softcap: expected a positive finite number or None, got {float(softcap)!r}")
    return float(softcap)


def _natural_lse(lse2: Tensor, heads: int) -> Tensor:
    """(B, H·T) base-2 LSE, +inf for an empty row -> (B, H, T) natural log, −inf there (where()'s
    gradient there is 0, never NaN)."""
    B, n = lse2.shape
    return torch.where(torch.isinf(lse2), float("-inf"), lse2 * _LN2).view(B, heads, n // heads)
