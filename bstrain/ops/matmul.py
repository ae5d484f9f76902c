"""Block-sparse matmul: the seed's ``BlocksparseMatMul`` on torch tensors, with autograd.

``Y = X·W`` where W is a (C, K) matrix of which only the blocks named by a (C/bs, K/bs) layout are
stored, as a (nnz, bs, bs) tensor in row-major layout order (see :mod:`bstrain.layout`).
With ``feature_axis=1`` activations are (N, C) -> (N, K); with ``feature_axis=0`` they are
(C, N) -> (K, N). The weight's meaning is the same on both axes: block i maps input features
``c_i*bs:(c_i+1)*bs`` to output features ``k_i*bs:(k_i+1)*bs``.

CUDA tensors run the Triton kernels of :mod:`bstrain.kernels.matmul`; CPU tensors run
:func:`bsmm_ref`, a pure-PyTorch path that never forms the dense C x K matrix and supports
float64 (so ``torch.autograd.gradcheck`` works). ``backend="triton"`` forces the kernels, which
on CPU tensors needs ``TRITON_INTERPRET=1`` set before triton is imported.

This file holds the seed's class; the references, layout tables, custom ops and the eager
``autograd.Function`` it calls are in :mod:`bstrain.ops._matmul_ops` (their names are importable
from here too), and the recurrent weights' gradient grouping in :mod:`bstrain.ops.grouping`.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import warnings

import numpy as np
import torch

from bstrain._tensors import INT32_MAX as _INT32_MAX
from bstrain.layout import BLOCK_SIZES, as_layout, check_block_size
from bstrain.ops._checks import BACKENDS, FLOATS
from bstrain.ops._matmul_ops import (  # noqa: F401  (MatmulTables, bsmm, bsmm_dx: importable from here, as before)
    MatmulTables, _as, _autocast_input, _bsmm, _casts_in_kernel, bsmm, bsmm_dw, bsmm_dw_ref, bsmm_dx,
    bsmm_dx_ref, bsmm_ref, compute_dtype,
)
from bstrain.ops.grouping import GradGroup, _StepMatMul
from bstrain.ops.proj import SparseProj  # noqa: F401  (the seed exports it from matmul)
from bstrain.ops.tables import eager, layout_tables, real_tensors

__all__ = ["BlocksparseMatMul", "SparseProj", "GradGroup", "bsmm_ref", "bsmm_dx_ref", "bsmm_dw_ref",
           "check_block_size", "BLOCK_SIZES"]

_TOGETHER = contextvars.ContextVar("bstrain_switching_together", default=False)   # per thread


@contextlib.contextmanager
def switching_together():
    """Inside, an op's in-place switch leaves the ops that read its tables (:meth:`BlocksparseMatMul.
    share_tables`) sharing them: they switch to the same layout next (a sparsity policy's update
    of a layer and its EMA copy). Outside, such a switch first gives each of them tables of its
    own, so that no op ever reads tables of a layout other than its own."""
    token = _TOGETHER.set(True)
    try:
        yield
    finally:
        _TOGETHER.reset(token)


def _np(a) -> np.ndarray:
    """A numpy float64 copy of a tensor or array (the seed's references)."""
    return (a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64))


def _lists(coords: list[tuple[int, int]], by: int) -> list[tuple[int, list[tuple[int, int]]]]:
    groups: dict[int, list[tuple[int, int]]] = {}
    for w, ck in enumerate(coords):
        groups.setdefault(ck[by], []).append((ck[1 - by], w))
    return sorted(groups.items())
class BlocksparseMatMul:
    """The seed's block-sparse matmul op.

    Args:
        layout: (C/bs, K/bs) 0/1 array (numpy, torch or nested lists).
        block_size: bs, one of 8, 16, 32, 64, 128.
        feature_axis: 1 for (N, C) activations, 0 for (C, N).
        backend: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "torch".

    The weight is not owned by the op: several weights of ``w_shape`` may share one layout.
    """

    def __init__(self, layout, block_size: int = 32, feature_axis: int = 1, z_order: bool = True,
                 name: str | None = None, *, backend: str = "auto"):
        if isinstance(z_order, str):           # the 4th positional argument was backend before the seed's z_order
            warnings.warn("BlocksparseMatMul: pass backend= by keyword; the 4th positional argument is now the seed's "
                          "z_order", DeprecationWarning, stacklevel=2)
            backend, z_order = z_order, True
        if not isinstance(z_order, bool):
            raise TypeError(f"z_order: expected a bool, got {z_order!r}")
        # z_order (the seed's Morton numbering of weight blocks) has no effect: bstrain numbers them row-major
        # (from_seed_order / to_seed_order convert weights); name (a TensorFlow op name) neither
        self.layout = as_layout(layout)                          # (Cb, Kb) bool
        self.block_size = check_block_size(block_size)
        if feature_axis not in (0, 1) or isinstance(feature_axis, bool):
            raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.feature_axis = feature_axis
        self.backend = backend
        self.z_order, self.name = z_order, name or "BlocksparseMatMul"
        cb, kb = self.layout.shape
        self.C, self.K = cb * self.block_size, kb * self.block_size
        # the layout's tables, shared by equal layouts; their key names the layout in torch.ops.bstrain.*
        self._tables = layout_tables("matmul", self.layout, self.block_size)
        host = self._tables.host
        self.blocks = host.blocks
        with real_tensors(torch.device("cpu")):
            self._coords = torch.stack([host.c_idx, host.k_idx])  # (2, nnz) on the CPU, row-major block order

    # --- the seed's attributes and float64 numpy references (its tests read them) ---------------
    @property
    def CB(self) -> int:
        return self.layout.shape[0]

    @property
    def KB(self) -> int:
        return self.layout.shape[1]

    @property
    def bsize(self) -> int:
        return self.block_size

    @property
    def axis(self) -> int:
        return self.feature_axis

    @property
    def sparsity(self) -> float:
        """The share of live blocks (the seed's name for the density), to 3 decimals."""
        return round(self.blocks / self.layout.size, 3)

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of one row of activations through the live blocks."""
        return self.blocks * self.block_size * self.block_size * 2

    @property
    def g_shape(self) -> tuple[int]:
        return (self.blocks,)

    @property
    def updat_list(self) -> list[tuple[int, int]]:
        """(c, k) of each weight block, in the weight's order."""
        return [tuple(map(int, ck)) for ck in self._coords.t().tolist()]

    @property
    def fprop_list(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """(k, [(c, weight block), ...]) for every output block with a live block."""
        return _lists(self.updat_list, by=1)

    @property
    def bprop_list(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """(c, [(k, weight block), ...]) for every input block with a live block."""
        return _lists(self.updat_list, by=0)

    def fprop_test(self, I, W):
        """Y = I·W in float64 numpy, block by block (the seed's reference)."""
        I, W, bs = _np(I), _np(W), self.block_size
        X = I.reshape(-1, self.CB, bs) if self.axis else I.reshape(self.CB, bs, -1)
        Y = np.zeros((X.shape[0], self.KB, bs) if self.axis else (self.KB, bs, X.shape[-1]))
        for w, (c, k) in enumerate(self.updat_list):
            if self.axis:
                Y[:, k] += X[:, c] @ W[w]
            else:
                Y[k] += W[w].T @ X[c]
        return Y.reshape(X.shape[0], -1) if self.axis else Y.reshape(self.K, -1)

    def bprop_test(self, E, W):
        """dX = E·Wᵀ in float64 numpy (the seed's reference)."""
        E, W, bs = _np(E), _np(W), self.block_size
        D = E.reshape(-1, self.KB, bs) if self.axis else E.reshape(self.KB, bs, -1)
        B = np.zeros((D.shape[0], self.CB, bs) if self.axis else (self.CB, bs, D.shape[-1]))
        for w, (c, k) in enumerate(self.updat_list):
            if self.axis:
                B[:, c] += D[:, k] @ W[w].T
            else:
                B[c] += W[w] @ D[k]
        return B.reshape(D.shape[0], -1) if self.axis else B.reshape(self.C, -1)

    def updat_test(self, I, E):
        """dW = Iᵀ·E on the live blocks, float64 numpy (the seed's reference)."""
        I, E, bs = _np(I), _np(E), self.block_size
        X = I.reshape(-1, self.CB, bs) if self.axis else I.reshape(self.CB, bs, -1)
        D = E.reshape(-1, self.KB, bs) if self.axis else E.reshape(self.KB, bs, -1)
        U = np.zeros(self.w_shape)
        for w, (c, k) in enumerate(self.updat_list):
            U[w] = X[:, c].T @ D[:, k] if self.axis else X[c] @ D[k].T
        return U

    def l2_normalize_test(self, W, epsilon: float = 1e-12):
        """W with each output unit's incoming weights at unit L2 norm, float64 numpy."""
        W = _np(W).copy()
        for _, lut in self.fprop_list:
            ws = [w for _, w in lut]
            norm = np.sqrt(np.maximum(np.square(W[ws]).sum((0, 1)), epsilon))     # (bs,) per output unit
            W[ws] /= norm
        return W

    def l2_normalize_grad_test(self, W, U, epsilon: float = 1e-12):
        """The gradient through :meth:`l2_normalize_test` of U (dL/d normalised W), float64 numpy."""
        W, U = _np(W), _np(U).copy()
        for _, lut in self.fprop_list:
            ws = [w for _, w in lut]
            W2, U2 = W[ws].reshape(-1, self.block_size), U[ws].reshape(-1, self.block_size)
            sum_sqr = np.square(W2).sum(0, keepdims=True)
            max_w = np.maximum(sum_sqr, epsilon)
            grad = (U2 + W2 * (sum_sqr >= epsilon) * (-U2 * W2 / max_w).sum(0, keepdims=True)) / np.sqrt(max_w)
            U[ws] = grad.reshape(-1, self.block_size, self.block_size)
        return U

    # --- shapes ---------------------------------------------------------------------------
    @property
    def w_shape(self) -> tuple[int, int, int]:
        return (self.blocks, self.block_size, self.block_size)

    def i_shape(self, N: int) -> tuple[int, int]:
        return (N, self.C) if self.feature_axis == 1 else (self.C, N)

    def o_shape(self, N: int) -> tuple[int, int]:
        return (N, self.K) if self.feature_axis == 1 else (self.K, N)

    def block_coord(self, block: int) -> tuple[int, int]:
        """(c, k) layout coordinates of weight block ``block`` (row-major numbering)."""
        if not -self.blocks <= block < self.blocks:
            raise IndexError(f"block: expected a block index in [0, {self.blocks}), got {block}")
        return int(self._coords[0, block]), int(self._coords[1, block])

    @property
    def coords(self) -> torch.Tensor:
        """(2, nnz) int64 on the CPU: the (c, k) layout coordinates of every weight block, in order."""
        return self._coords

    @property
    def density(self) -> float:
        return float(self.layout.mean())

    # --- initialisers ----------------------------------------------------------------------
    def identity_init(self, scale: float = 1.0, *, gpu: bool = False) -> torch.Tensor:
        """float32 (nnz, bs, bs), the seed's identity init: ``scale·eye`` in block (c, k) when
        ``c % KB == k % CB`` (CB, KB: the layout's block counts), zeros elsewhere.

        On a square layout that is the diagonal blocks (the op is ``scale`` times the identity
        when they are all live); a non-square layout gets the identity tiled across it.
        """
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale: expected a number (the seed's first argument), got {scale!r}")
        device = "cuda" if gpu else "cpu"
        cb, kb = self.layout.shape
        w = torch.zeros(self.w_shape, dtype=torch.float32, device=device)
        tiled = (self._coords[0] % kb == self._coords[1] % cb).to(device)
        w[tiled] = float(scale) * torch.eye(self.block_size, device=device)
        return w

    def to_dense(self, W: torch.Tensor) -> torch.Tensor:
        """The (C, K) dense matrix of the (nnz, bs, bs) weight W, zeros outside live blocks.

        Differentiable; ``I @ op.to_dense(W)`` equals ``op(I, W)`` for feature_axis=1.
        """
        self._check_w(W)
        cb, kb = self.layout.shape
        bs = self.block_size
        c_idx, k_idx = self._ref_coords(W.device)
        dense = W.new_zeros(cb, kb, bs, bs).index_put((c_idx, k_idx), W)    # (Cb, Kb, bs, bs)
        return dense.permute(0, 2, 1, 3).reshape(self.C, self.K)

    def from_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """The (nnz, bs, bs) live blocks of a (C, K) dense matrix, in this op's block order."""
        if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != (self.C, self.K):
            raise ValueError(f"dense: expected a ({self.C}, {self.K}) tensor, got "
                             f"{tuple(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__}")
        cb, kb = self.layout.shape
        bs = self.block_size
        blocks = dense.reshape(cb, bs, kb, bs).permute(0, 2, 1, 3)              # (Cb, Kb, bs, bs)
        c_idx, k_idx = self._ref_coords(dense.device)
        return blocks[c_idx, k_idx]

    # --- the seed's block order ---------------------------------------------------------------------
    def seed_order(self, z_order: bool = True) -> torch.Tensor:
        """(nnz,) int64: ``seed_order()[i]`` is the seed's index of our weight block i.

        Our blocks are numbered row-major (by c, then k). The seed's ``BlocksparseMatMul`` numbers
        them in Morton (z-) order of (c, k) by default (``z_order=True``), row-major otherwise.
        """
        from bstrain.layout import z_order_rank
        if not z_order:
            return torch.arange(self.blocks)
        return torch.as_tensor(z_order_rank(self._coords[0].numpy(), self._coords[1].numpy()))

    def from_seed_order(self, W_seed: torch.Tensor, z_order: bool = True) -> torch.Tensor:
        """A weight saved by the seed (blocks in its order) in this op's row-major order."""
        self._check_w(W_seed)
        return W_seed[self.seed_order(z_order).to(W_seed.device)]

    def to_seed_order(self, W: torch.Tensor, z_order: bool = True) -> torch.Tensor:
        """This op's weight with its blocks in the seed's order (the inverse of from_seed_order)."""
        self._check_w(W)
        out = torch.empty_like(W)
        out[self.seed_order(z_order).to(W.device)] = W
        return out

    def ortho_init(self, gpu: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
        """float32 (nnz, bs, bs): an independent random orthogonal matrix in each block."""
        g = torch.randn(self.w_shape, dtype=torch.float64, generator=generator)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-uniform
        return q.float().to("cuda" if gpu else "cpu")

    def l2_normalize(self, W: torch.Tensor, gain: torch.Tensor | None = None, epsilon: float = 1e-12,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """Scales each output unit's incoming weights (dense column k) to unit L2 norm, or gain[k].

        W: (nnz, bs, bs); gain: K elements of any shape, or None; epsilon: the floor of each squared
        norm (the seed's default). Differentiable; returns ``dtype`` (default: W's).
        """
        self._check_w(W)
        k_idx = self._coords[1].to(W.device)
        wf = W.to(torch.promote_types(W.dtype, torch.float32))               # fp32 math for 16-bit W
        sq = wf.square().sum(dim=1)                                          # (nnz, bs)
        col_sq = sq.new_zeros(self.K // self.block_size, self.block_size).index_add(0, k_idx, sq)
        scale = torch.rsqrt(col_sq.clamp_min(epsilon))                       # (Kb, bs)
        if gain is not None:
            if not isinstance(gain, torch.Tensor) or gain.numel() != self.K:
                raise ValueError(f"gain: expected {self.K} elements (K; any shape), got "
                                 f"{tuple(gain.shape) if isinstance(gain, torch.Tensor) else type(gain).__name__}")
            scale = scale * gain.to(wf.dtype).reshape(-1, self.block_size)
        return (wf * scale[k_idx].unsqueeze(1)).to(dtype or W.dtype)

    # --- apply -----------------------------------------------------------------------------
    def luts(self, device: torch.device | str):
        """The kernels' lookup tables on ``device`` (made once per device)."""
        return self._tables.on(device).luts

    def _ref_coords(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_idx, k_idx) on ``device`` for the PyTorch path."""
        t = self._tables.on(device)
        return t.c_idx, t.k_idx

    def _check_w(self, W) -> None:
        if not isinstance(W, torch.Tensor):
            raise TypeError(f"W: expected a torch.Tensor, got {type(W).__name__}")
        if tuple(W.shape) != self.w_shape:
            raise ValueError(f"W: expected shape w_shape={self.w_shape}, got {tuple(W.shape)}")

    def _check_call(self, I, W, dw_dtype) -> None:
        if not isinstance(I, torch.Tensor):
            raise TypeError(f"I: expected a torch.Tensor, got {type(I).__name__}")
        self._check_w(W)
        if I.dim() < 1 or I.shape[-1 if self.feature_axis == 1 else 0] != self.C:
            want = "(*, C)" if self.feature_axis == 1 else "(C, *)"
            raise ValueError(f"I: expected shape {want} with C={self.C} (feature_axis="
                             f"{self.feature_axis}), got {tuple(I.shape)}")
        if I.dtype not in FLOATS:
            raise TypeError(f"I: expected float32, float16, bfloat16 or float64, got {I.dtype}")
        dt = compute_dtype(I)                      # I's dtype, or the autocast dtype it runs in
        if W.dtype != dt and W.dtype != torch.float32:
            raise TypeError(f"W: expected dtype {dt} (the compute dtype) or float32 master weights, got {W.dtype}")
        if I.device != W.device:
            raise ValueError(f"W: expected device {I.device} (as I), got {W.device}")
        if dw_dtype not in FLOATS:
            raise TypeError(f"dw_dtype: expected a floating torch.dtype, got {dw_dtype!r}")
        if eager(I) and I.numel() > _INT32_MAX and self._use_kernels(I):     # (traced: the op checks)
            raise ValueError(f"I: the kernels take tensors of at most 2**31 - 1 elements, got {I.numel()}")

    def _use_kernels(self, I: torch.Tensor) -> bool:
        if self.backend == "torch" or I.dtype == torch.float64:
            if self.backend == "triton":
                raise TypeError("I: the Triton backend supports float32, float16 and bfloat16, got float64")
            return False
        if self.backend == "triton":
            if not I.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"I: backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, "
                                 f"got a tensor on {I.device}")
            return True
        return I.is_cuda

    def _as_2d(self, I: torch.Tensor) -> torch.Tensor:
        """(*, C) -> (N, C) with feature_axis=1; (C, *) -> (C, N) with feature_axis=0."""
        if I.dim() == 2:
            return I
        return I.reshape(-1, self.C) if self.feature_axis == 1 else I.reshape(self.C, -1)

    def _from_2d(self, Y: torch.Tensor, I: torch.Tensor) -> torch.Tensor:
        """(N, K) or (K, N) back to I's rank: (*, K) or (K, *)."""
        if I.dim() == 2:
            return Y
        return Y.reshape(*I.shape[:-1], self.K) if self.feature_axis == 1 else Y.reshape(self.K, *I.shape[1:])

    observer = None
    """None, or ``observer(I, Y)`` called after each product (``bstrain.sparsity.RigL`` records the
    inputs and output gradients of the step before a layout update through it)."""

    @property
    def key(self) -> str:
        """The key of this op's layout tables: it names the layout in ``torch.ops.bstrain.*`` calls."""
        return self._tables.key

    def make_private(self) -> None:
        """Gives this op layout tables that no other op shares (equal layouts share them by
        default), so that :meth:`set_layout` can rewrite them in place."""
        if not self._tables.private:
            self._tables = self._tables.like(self.layout, self.block_size, private=True)

    def share_tables(self, other: "BlocksparseMatMul") -> None:
        """Reads ``other``'s private tables from now on: for a copy of a layer whose layout always
        follows the layer's (an EMA model's under dynamic sparsity), so that one in-place rewrite
        serves both (:meth:`set_layout` then finds the tables at the new layout already). Needs
        private tables of this op's layout and block size (a ValueError otherwise)."""
        if not isinstance(other, BlocksparseMatMul) or not other._tables.private:
            got = "one with shared tables" if isinstance(other, BlocksparseMatMul) else type(other).__name__
            raise ValueError(f"other: expected a BlocksparseMatMul with private tables (make_private), got {got}")
        if other.block_size != self.block_size or not np.array_equal(other.layout, self.layout):
            raise ValueError(f"other: expected an op of this op's layout and block size {self.block_size}, got "
                             f"{other.layout.shape} blocks of {other.block_size} with another layout")
        self._tables.followers.discard(self)
        self._tables = other._tables
        self._tables.followers.add(self)

    def _own_tables(self, layout: np.ndarray) -> None:
        """Stops reading shared tables: private tables of this op's own, for ``layout``."""
        self._tables.followers.discard(self)
        self._tables = self._tables.like(layout, self.block_size, private=True)

    def set_layout(self, layout) -> bool:
        """Switches this op to another layout of the same shape and live-block count (so a weight of
        w_shape stays valid; its blocks are then read in the new layout's row-major order).
        ``bstrain.sparsity`` moves the weights; this only changes the op and its tables.

        With private tables (:meth:`make_private`), the tables are rewritten in place on every
        device and the op keeps its key: CUDA graphs captured before and graphs compiled before
        stay valid, and True is returned. That holds unless a block row or column outgrows what
        the kernels' tables hold (the next power of two of the longest list plus a quarter, and
        at least :func:`bstrain.layout.growth_limit`, within which dynamic sparsity grows) or
        output panels were built. Otherwise the op takes
        new tables (private if its old ones were), made at once on every GPU the old ones were on
        so that a graph traced later finds them, and False is returned."""
        new = as_layout(layout)
        if new.shape != self.layout.shape or int(new.sum()) != self.blocks:
            raise ValueError(f"layout: expected a {self.layout.shape} layout with {self.blocks} live blocks, got "
                             f"{new.shape} with {int(new.sum())}")
        tables = self._tables
        in_place = True
        if tables.private and np.array_equal(tables.host.layout, new):
            pass                        # tables this op reads, switched already by their owner
        elif self in tables.followers:  # shared tables of another layout: tables of its own
            self._own_tables(new)
            in_place = False
        elif tables.private and tables.can_rewrite(new, self.block_size):
            if not _TOGETHER.get():        # ops reading these tables keep their layout: tables of their own
                for op in list(tables.followers):
                    op._own_tables(op.layout)
            tables.rewrite(new, self.block_size)
        else:
            self._tables = tables.like(new, self.block_size)   # private if those were, made on the same GPUs
            in_place = False
        host = self._tables.host
        self.layout = host.layout
        self._coords.copy_(torch.stack([host.c_idx, host.k_idx]))
        return in_place

    def __call__(self, I: torch.Tensor, W: torch.Tensor, dw_dtype: torch.dtype = torch.float32, *, gate=None,
                 gate_grad: bool = True, dw_gated: bool = False, name: str | None = None, bench=0) -> torch.Tensor:
        """Y = I·W with autograd. I: (*, C) with feature_axis=1 ((C, *) with feature_axis=0),
        e.g. i_shape(N); W: w_shape; returns (*, K) (or (K, *)) in I's dtype.

        W may be I's dtype or float32 (master weights; cast on the fly). dw_dtype is the dtype the
        kernel writes dW in (accumulation is fp32); autograd hands it on in W's dtype. The seed's
        ``name`` and ``bench`` are accepted and ignored; its block gating (``gate``) is not provided.
        """
        if gate is not None:
            raise NotImplementedError("gate: the seed's gated block-sparse matmul is not provided; multiply W's "
                                      "blocks by the gates instead (W * gate.view(-1, 1, 1))")
        Y = self._product(I, W, dw_dtype)
        if self.observer is not None:
            self.observer(I, Y)
        return Y

    def _product(self, I: torch.Tensor, W: torch.Tensor, dw_dtype: torch.dtype) -> torch.Tensor:
        self._check_call(I, W, dw_dtype)
        dtype = compute_dtype(I)                   # I's, or the autocast dtype it runs in
        X = self._as_2d(I)
        if self._use_kernels(X):
            if dw_dtype == torch.float64:
                raise TypeError("dw_dtype: the Triton backend writes float32, float16 or bfloat16, got float64")
            if not eager(X):
                Y = torch.ops.bstrain.bsmm(X.to(dtype), W, self.key, self.feature_axis, dw_dtype)
                return self._from_2d(Y, I)
            if X.dtype != dtype and not _casts_in_kernel(X, dtype, self.feature_axis):
                X = X.to(dtype)
            if torch.is_grad_enabled() and (X.requires_grad or W.requires_grad):
                # W in the compute dtype for the kernels and the backward, made without autograd (a cast
                # of W itself would record a node the Function's own input W makes needless)
                wk = _as(W, dtype) if W.dtype == dtype else _as(W.detach(), dtype)
                Y = _bsmm(X, W, self.key, self.feature_axis, dw_dtype, luts=self.luts(X.device), wk=wk, dtype=dtype)
            else:
                from bstrain.kernels.matmul import run_forward
                Y = run_forward(X, _as(W, dtype), self.luts(X.device), self.feature_axis, dtype=dtype)
            return self._from_2d(Y, I)
        X = X.to(dtype)
        c_idx, k_idx = self._ref_coords(X.device)
        return self._from_2d(bsmm_ref(X, W.to(X.dtype), c_idx, k_idx, self.K, self.feature_axis), I)

    # --- no-autograd products (kernels on CUDA, references on CPU) -------------------------------

    def _check_raw(self, name: str, a, features: int, W=None, b=None, b_features: int = 0) -> None:
        """A 2-D activation ``a`` with ``features`` on the feature axis (and a second one ``b`` with
        ``b_features`` and a's rows), and a weight W of w_shape in a's dtype, all on a's device."""
        axis = self.feature_axis
        for n, t, f in ((name, a, features), ("dY", b, b_features)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2 or t.shape[1 - axis] != a.shape[1 - axis] or t.shape[axis] != f:
                want = f"(N, {f})" if axis == 1 else f"({f}, N)"
                raise ValueError(f"{n}: expected a 2-D {want} tensor (feature_axis={axis}), got {tuple(t.shape)}")
            if t.dtype != a.dtype or t.device != a.device:
                raise TypeError(f"{n}: expected {a.dtype} on {a.device} (as {name}), got {t.dtype} on {t.device}")
        if W is not None:
            self._check_w(W)
            if W.dtype != a.dtype or W.device != a.device:
                raise TypeError(f"W: expected {a.dtype} on {a.device} (as {name}), got {W.dtype} on {W.device}")
        if eager(a) and max(a.numel(), b.numel() if b is not None else 0) > _INT32_MAX and self._use_kernels(a):
            raise ValueError(f"{name}: the kernels take tensors of at most 2**31 - 1 elements, got {a.numel()}")

    def forward_raw(self, I: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """Y = I·W without autograd. I: (N, C) (or (C, N)); W in I's dtype."""
        self._check_raw("I", I, self.C, W)
        return self._forward_raw(I, W)

    def dx(self, dY: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """dX = dY·Wᵀ without autograd. dY: (N, K) (or (K, N)); W in dY's dtype."""
        self._check_raw("dY", dY, self.K, W)
        return self._dx(dY, W)

    def dw(self, I: torch.Tensor, dY: torch.Tensor, dw_dtype: torch.dtype | None = None) -> torch.Tensor:
        """dW = Iᵀ·dY on live blocks, without autograd: (nnz, bs, bs) in dw_dtype (default: fp32,
        or fp64 for fp64 inputs)."""
        self._check_raw("I", I, self.C, b=dY, b_features=self.K)
        if dw_dtype is not None and dw_dtype not in FLOATS:
            raise TypeError(f"dw_dtype: expected a floating torch.dtype, got {dw_dtype!r}")
        return self._dw(I, dY, dw_dtype)

    # the same without checks: the grouped path's inner calls, on arguments checked at its boundary
    def _forward_raw(self, I: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        if self._use_kernels(I):
            if not eager(I):
                return torch.ops.bstrain.bsmm(I, W, self.key, self.feature_axis, W.dtype)
            from bstrain.kernels import matmul as kernels
            return kernels.run_forward(I, _as(W, I.dtype), self.luts(I.device), self.feature_axis)
        c_idx, k_idx = self._ref_coords(I.device)
        return bsmm_ref(I, W, c_idx, k_idx, self.K, self.feature_axis)

    def _dx(self, dY: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        if self._use_kernels(dY):
            if not eager(dY):
                return torch.ops.bstrain.bsmm_dx(dY, W, self.key, self.feature_axis)
            from bstrain.kernels import matmul as kernels
            return kernels.run_dx(dY, _as(W, dY.dtype), self.luts(dY.device), self.feature_axis)
        c_idx, k_idx = self._ref_coords(dY.device)
        return bsmm_dx_ref(dY, W, c_idx, k_idx, self.C, self.feature_axis)

    def _dw(self, I: torch.Tensor, dY: torch.Tensor, dw_dtype: torch.dtype | None = None) -> torch.Tensor:
        dw_dtype = dw_dtype or (torch.float64 if I.dtype == torch.float64 else torch.float32)
        if self._use_kernels(I):
            if not eager(I):
                return torch.ops.bstrain.bsmm_dw(I, dY, self.key, self.feature_axis, dw_dtype)
            from bstrain.kernels import matmul as kernels
            return kernels.run_dw(I, dY if dY.dtype == I.dtype else dY.to(I.dtype), self.luts(I.device), self.feature_axis, dw_dtype)
        c_idx, k_idx = self._ref_coords(I.device)
        return bsmm_dw_ref(I, dY, c_idx, k_idx, self.block_size, self.feature_axis).to(dw_dtype)

    # --- gradient grouping ---------------------------------------------------------------------
    def grad_group(self, group_size: int = 8, dw_dtype: torch.dtype | None = None) -> "GradGroup":
        """A group for one weight over one sequence: see :meth:`grouped`."""
        return GradGroup(self, group_size, dw_dtype)

    def group_weight(self, W: torch.Tensor, group: "GradGroup", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Call once per sequence; pass the result to :meth:`grouped` at every timestep.

        ``dtype``: the activations' dtype (default: the autocast dtype under autocast, else W's).
        W is cast to it here, once, rather than at every timestep.
        """
        self._check_w(W)
        if dtype is None:
            dev = W.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else W.dtype
        if not eager(W.detach()):                  # traced: no deferred dW; autograd sums the steps
            return W.to(dtype)
        return group.weight(W, dtype)

    def grouped(self, I: torch.Tensor, W_grouped: torch.Tensor, group: "GradGroup") -> torch.Tensor:
        """Y = I·W for one timestep, with dW deferred to ``group`` (the seed's group_param_grads).

        dX is computed at once in backward; dW is computed for up to group.group_size timesteps
        per launch and handed to W when the backward pass reaches the weight.
        """
        if not eager(I):
            return self(I, W_grouped)
        self._check_call(I, W_grouped, torch.float32)
        I = _autocast_input(I)
        return self._from_2d(_StepMatMul.apply(self._as_2d(I), W_grouped, group), I)

    def __repr__(self) -> str:
        return (f"BlocksparseMatMul(C={self.C}, K={self.K}, block_size={self.block_size}, "
                f"blocks={self.blocks}, density={self.density:.3f}, feature_axis={self.feature_axis})")
