"""Block-sparse convolution: the seed's ``BlocksparseConv`` / ``BlocksparseDeconv`` and
``cwise_linear`` on torch tensors. The layout tables, the reference and the
``torch.ops.bstrain.bsconv2d`` custom ops over the Triton kernels (with their eager autograd path)
that :class:`bstrain.nn.BlockSparseConv2d` runs are in :mod:`bstrain.ops._conv_ops`; their names
are importable from here too.

**The seed's blocks.** ``BCK`` is a sequence of blocks, each a pair (input-channel indices,
output-channel indices). Block i connects its input channels to its output channels through a
filter of shape ``f_shape(block=i) = (len(k_i), len(c_i), *TRS)`` (deconv: ``(len(c_i), len(k_i),
*TRS)``, the layout of ``conv_transpose``). Blocks may differ in size and overlap; overlapping
contributions add. C and K are one more than the largest input and output index. Their index
tensors are tables too (family ``"conv_blocks"``).

**Geometry.** TRS, DHW and MPQ take 1-3 dims (the activations' spatial dims, N and C first, as in
the seed). Padding is ``"SAME"`` (TensorFlow's rule: output ceil(size / stride), the total
padding split with the extra element after, so even filters and strides pad asymmetrically),
``"VALID"``, or explicit per-dim ints (symmetric).

**How the seed ops run** (all of it PyTorch, so autograd, ``torch.compile`` and cuDNN apply):

* ``"grouped"`` (blocks of one size): gather the input channels of every block, one grouped
  convolution (``groups`` = blocks), then add each block's output into its channels. When the
  blocks' input lists are the channels in order, nothing is gathered; when the output lists are
  too, nothing is scattered.
* ``"dense"``: scatter the blocks into one dense filter (overlaps add) and run one convolution:
  the reference, and the fastest choice when the blocks cover much of the dense filter.

``backend="auto"`` takes "grouped" on CUDA when the blocks have one size and sit in channel
order (a block-diagonal layout: one grouped convolution, no gather or scatter), else "dense":
with a gather and a scatter-add, the grouped form was slower than the dense filter at every
point measured on the H200 (benchmarks/conv.md).
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._conv_ops import (  # noqa: F401  (importable from here, as before)
    ConvTables, _wt, block_tables, bsconv2d, bsconv2d_bwd, bsconv2d_ref, conv_geometry, conv_nd, conv_tables,
    dense_conv_filter, sparse_conv2d, tables_on,
)
from bstrain.ops.tables import layout_tables

__all__ = ["BlocksparseConv", "BlocksparseDeconv", "cwise_linear", "conv_geometry", "conv_nd", "ConvTables",
           "bsconv2d_ref", "dense_conv_filter", "sparse_conv2d", "tables_on"]

_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


# --- the seed's API -----------------------------------------------------------------------------------
def _dims(name: str, value, n: int, low: int) -> list[int]:
    """An int or a 1..3-sequence, broadcast/checked to n dims."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [int(value)] * n
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 3 or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name}: expected an int or a sequence of 1-3 ints, got {value!r}")
    value = [int(v) for v in value]
    if len(value) != n:
        if len(value) == 3 and all(v == 1 for v in value[:3 - n]):      # the seed's (1, 1, x) defaults
            value = value[3 - n:]
        else:
            raise ValueError(f"{name}: expected {n} value(s) (one per spatial dim of TRS), got {value!r}")
    if any(v < low for v in value):
        raise ValueError(f"{name}: expected values >= {low}, got {value!r}")
    return value


def _float_dtype(name: str, dtype) -> torch.dtype | None:
    """A torch or numpy floating dtype as a torch dtype (None stays None)."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        try:
            dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except TypeError:
            dtype = None
    if dtype is None or not dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype (torch or numpy) or None, got {dtype!r}")
    return dtype


def _padding(padding, n: int):
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"padding: expected 'SAME', 'VALID' or ints, got {padding!r}")
        return ["SAME"] * n if padding.upper() == "SAME" else [0] * n
    return _dims("padding", padding, n, 0)


def _index_list(name: str, idx) -> np.ndarray:
    arr = np.asarray(idx)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"BCK: {name} must be a non-empty sequence of channel indices, got {idx!r}")
    if arr.min() < 0:
        raise ValueError(f"BCK: {name} has a negative channel index, {int(arr.min())}")
    if len(np.unique(arr)) != arr.size:
        raise ValueError(f"BCK: {name} repeats a channel index")
    return arr.astype(np.int64)


class _Checked(list):
    """Checked per-block filters; ``stacked``: the (blocks, ...) tensor they came from, if any."""

    def __init__(self, fs, stacked):
        super().__init__(fs)
        self.stacked = stacked


class BlocksparseConv:
    """The seed's block-sparse convolution (see the module docstring).

    Args:
        BCK: ((c indices, k indices), ...) blocks.
        TRS: filter size, 1-3 dims. DHW: input size. MPQ: output size (None: computed; deconv
            uses it to resolve strided sizes).
        strides, dilates: per dim (the seed's 3-tuples of ones fit any rank).
        padding: "SAME", "VALID" or ints.
        edge_bias: also make an edge bias (``edge_bias_shape``): one value per output channel and
            per pattern of padded filter taps, added at the output positions whose filter window
            reaches into the padding, in that pattern.
        backend: "auto", "grouped" or "dense" (not in the seed).
    """

    _transposed = False

    def __init__(self, BCK, TRS, DHW, MPQ=None, strides=(1, 1, 1), dilates=(1, 1, 1), padding="SAME",
                 edge_bias=False, debug=False, deconv=False, backend: str = "auto"):
        if deconv is not self._transposed and deconv is not False:
            raise ValueError("deconv: the seed's switch to a transposed convolution; use BlocksparseDeconv(...) "
                             "with the same arguments")
        if not isinstance(TRS, (list, tuple)) or not 1 <= len(TRS) <= 3:
            raise ValueError(f"TRS: expected a sequence of 1-3 filter sizes, got {TRS!r}")
        n = len(TRS)
        self.TRS = _dims("TRS", list(TRS), n, 1)
        self.DHW = _dims("DHW", DHW, n, 1)
        self.strides = _dims("strides", strides, n, 1)
        self.dilates = _dims("dilates", dilates, n, 1)
        self.padding = _padding(padding, n)
        if backend not in ("auto", "grouped", "dense"):
            raise ValueError(f"backend: expected 'auto', 'grouped' or 'dense', got {backend!r}")
        self.backend = backend
        if isinstance(BCK, (str, bytes)) or not hasattr(BCK, "__len__") or len(BCK) == 0:
            raise ValueError(f"BCK: expected a non-empty sequence of (c indices, k indices) blocks, got {BCK!r}")
        blocks = []
        for b, pair in enumerate(BCK):
            if not hasattr(pair, "__len__") or len(pair) != 2:
                raise ValueError(f"BCK: block {b} must be a pair (c indices, k indices), got {pair!r}")
            blocks.append((_index_list(f"block {b}'s c indices", pair[0]),
                           _index_list(f"block {b}'s k indices", pair[1])))
        self.BCK = [(c.tolist(), k.tolist()) for c, k in blocks]
        self._c = [c for c, _ in blocks]
        self._k = [k for _, k in blocks]
        self.blocks = len(blocks)
        # in the convolution's own terms: "in" channels feed the filter, "out" channels receive it
        self.C = int(max(c.max() for c in self._c)) + 1
        self.K = int(max(k.max() for k in self._k)) + 1
        self.fixed_block_size = len({(len(c), len(k)) for c, k in blocks}) == 1
        if backend == "grouped" and not self.fixed_block_size:
            raise ValueError("backend: 'grouped' needs blocks of one size (len(c), len(k)); these differ, use "
                             "'dense' or 'auto'")
        self.sizeF = sum(len(c) * len(k) for c, k in blocks) * math.prod(self.TRS)
        self._geometry(MPQ)
        self.edge_bias = bool(edge_bias)
        self._edge_map = self._edge_patterns() if edge_bias else None
        self.flops = 2 * self.sizeF * math.prod(self.DHW if self._transposed else self.MPQ)
        # index tensors (dense filter, gather, scatter, edge bias), shared by equal ops, built now
        self._tables = layout_tables("conv_blocks", np.concatenate(self._c), np.concatenate(self._k),
                                     np.array([(len(c), len(k)) for c, k in blocks], dtype=np.int64),
                                     self._transposed, self._edge_map)

    # --- geometry -------------------------------------------------------------------------------
    def _geometry(self, MPQ):
        out, self._pads = conv_geometry(self.TRS, self.DHW, self.strides, self.dilates, self.padding)
        self.MPQ = out if MPQ is None else _dims("MPQ", MPQ, len(self.TRS), 1)
        if self.MPQ != out:
            raise ValueError(f"MPQ: the convolution of DHW={self.DHW} gives {out}, got {self.MPQ}")

    def _edge_patterns(self) -> np.ndarray:
        """(prod MPQ,) int64: each output position's edge pattern (-1: none), numbered in order
        of their first position (the seed's order)."""
        per_dim = []
        for q_n, w, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            x = np.arange(q_n)[:, None] * st - pb + np.arange(s)[None, :] * dl
            per_dim.append((x < 0) | (x >= w))                              # (Q, S): tap in the padding
        return self._edge_ids(per_dim, self.MPQ)

    def _edge_ids(self, per_dim: list[np.ndarray], sizes: list[int]) -> np.ndarray:
        """per_dim[d]: (sizes[d], TRS[d]) bool, tap in the padding. Returns each position's edge
        pattern id (-1: none), ids in order of first position; sets ``_n_edges``."""
        n = len(sizes)
        grids = np.meshgrid(*[np.arange(q) for q in sizes], indexing="ij")
        keys = np.zeros([math.prod(sizes)] + self.TRS, bool)
        for d in range(n):
            shape = [-1] + [1] * n
            shape[d + 1] = self.TRS[d]
            keys = keys | per_dim[d][grids[d].ravel()].reshape(shape)
        keys = keys.reshape(len(keys), -1)
        edge = np.full(len(keys), -1, np.int64)
        seen: dict[bytes, int] = {}
        for pos in np.nonzero(keys.any(1))[0]:
            edge[pos] = seen.setdefault(np.packbits(keys[pos]).tobytes(), len(seen))
        self._n_edges = len(seen)
        return edge

    # --- the seed's shapes ----------------------------------------------------------------------
    @property
    def edge_bias_shape(self) -> list[int]:
        """(K, edge patterns): the edge bias's shape (0 patterns without padding)."""
        if not self.edge_bias:
            raise ValueError("edge_bias_shape: this op was built with edge_bias=False")
        return [self.K, self._n_edges]

    def i_shape(self, N: int) -> list[int]:
        return [N, self.C] + self.DHW

    def o_shape(self, N: int) -> list[int]:
        return [N, self.K] + self.MPQ

    def f_shape(self, block: int | None = None) -> list[int]:
        """Block ``block``'s filter shape; None: (blocks, Kb, Cb, *TRS) when all blocks have one
        size, else (sizeF,)."""
        if block is None:
            if self.fixed_block_size:
                return [self.blocks] + self._fshape(0)
            return [self.sizeF]
        if not 0 <= block < self.blocks:
            raise ValueError(f"block: expected 0..{self.blocks - 1}, got {block}")
        return self._fshape(block)

    def _fshape(self, b: int) -> list[int]:
        return [len(self._k[b]), len(self._c[b])] + self.TRS

    # --- filters --------------------------------------------------------------------------------
    def _filters(self, Fs) -> "_Checked":
        """Per-block filters from a list, a stacked tensor (fixed block size) or a flat (sizeF,)
        tensor, checked; ``.stacked`` keeps the stacked tensor when there is one."""
        stacked = None
        if isinstance(Fs, Tensor):
            if self.fixed_block_size and list(Fs.shape) == self.f_shape():
                stacked, Fs = Fs, list(Fs.unbind(0))
            elif Fs.dim() == 1 and Fs.numel() == self.sizeF:
                sizes = [math.prod(self.f_shape(b)) for b in range(self.blocks)]
                Fs = [f.view(self.f_shape(b)) for b, f in enumerate(Fs.split(sizes))]
            else:
                raise ValueError(f"F: expected a list of {self.blocks} per-block filters, or a tensor of shape "
                                 f"{self.f_shape()}, got a tensor of shape {tuple(Fs.shape)}")
        Fs = list(Fs)
        if len(Fs) != self.blocks:
            raise ValueError(f"F: expected {self.blocks} per-block filters, got {len(Fs)}")
        for b, f in enumerate(Fs):
            if not isinstance(f, Tensor):
                raise TypeError(f"F[{b}]: expected a torch.Tensor, got {type(f).__name__}")
            if list(f.shape) != self.f_shape(b):
                raise ValueError(f"F[{b}]: expected shape {self.f_shape(b)}, got {list(f.shape)}")
        return _Checked(Fs, stacked)

    def dense_filter(self, F) -> Tensor:
        """The blocks summed into one dense filter (K, C, *TRS) (deconv: (C, K, *TRS)), in one
        accumulating index_put."""
        fs = F if isinstance(F, _Checked) else self._filters(F)
        rows, cols = self._dense_index(fs[0].device)
        vals = fs.stacked.flatten(0, 2) if fs.stacked is not None else \
            torch.cat([f.reshape([-1] + self.TRS) for f in fs])
        shape = ([self.C, self.K] if self._transposed else [self.K, self.C]) + self.TRS
        return vals.new_zeros(shape).index_put((rows, cols), vals, accumulate=True)

    def _dense_index(self, device):
        """(row, col) of every filter element of every block in the dense filter, block by block."""
        t = tables_on(self._tables, device)
        return t.rows, t.cols

    # --- call -----------------------------------------------------------------------------------
    def _check_input(self, I: Tensor, C: int, size: list[int]) -> Tensor:
        if not isinstance(I, Tensor):
            raise TypeError(f"I: expected a torch.Tensor, got {type(I).__name__}")
        n = len(self.TRS)
        if I.dim() != n + 2 or I.shape[1] != C or list(I.shape[2:]) != size:
            raise ValueError(f"I: expected shape (N, {C}, {', '.join(map(str, size))}), got {tuple(I.shape)}")
        if not I.is_floating_point():
            raise TypeError(f"I: expected a floating-point tensor, got {I.dtype}")
        return I

    def _use_grouped(self, I: Tensor) -> bool:
        if self.backend == "dense" or not self.fixed_block_size:
            return False
        if self.backend == "grouped":
            return True
        # H200 (benchmarks/conv.md): cuDNN's grouped conv beats the dense filter only when no
        # channel gather or scatter-add is needed (the blocks sit in channel order, block-diagonal)
        return I.is_cuda and self._gather_plan(I.device) == (None, None)

    def __call__(self, F, I: Tensor, edge_bias: Tensor | None = None) -> Tensor:
        self._check_input(I, self.C, self.DHW)
        fs = self._filters(F)
        for b, f in enumerate(fs):
            if f.dtype != I.dtype or f.device != I.device:
                raise TypeError(f"F[{b}]: expected {I.dtype} on {I.device} (as I), got {f.dtype} on {f.device}")
        y = self._grouped(fs, I) if self._use_grouped(I) else self._dense(fs, I)
        return self._add_edge_bias(y, edge_bias)

    def _conv(self, x: Tensor, w: Tensor, groups: int = 1) -> Tensor:
        """This op's convolution (the deconv overrides it with the transposed one)."""
        return conv_nd(x, w, self.strides, self.dilates, self._pads, groups)

    def _dense(self, fs: list[Tensor], I: Tensor) -> Tensor:
        return self._conv(I, self.dense_filter(fs))

    def _gather_plan(self, device):
        """(input channel gather or None, output scatter or None) on ``device``."""
        t = tables_on(self._tables, device)
        return t.gather, t.scatter

    def _grouped(self, fs: list[Tensor], I: Tensor) -> Tensor:
        gather, scatter = self._gather_plan(I.device)
        x = I if gather is None else I.index_select(1, gather)
        y = self._conv(x, fs.stacked.flatten(0, 1) if fs.stacked is not None else torch.cat(fs, 0),
                       groups=self.blocks)
        if scatter is None:
            return y
        out = y.new_zeros([y.shape[0], self.K] + list(y.shape[2:]))
        return out.index_add(1, scatter, y)

    def _add_edge_bias(self, y: Tensor, eb: Tensor | None) -> Tensor:
        if eb is None:
            return y
        if not self.edge_bias:
            raise ValueError("edge_bias: this op was built with edge_bias=False")
        if not isinstance(eb, Tensor) or list(eb.shape) != self.edge_bias_shape:
            raise ValueError(f"edge_bias: expected shape {self.edge_bias_shape}, got "
                             f"{tuple(eb.shape) if isinstance(eb, Tensor) else type(eb).__name__}")
        if eb.device != y.device:
            raise ValueError(f"edge_bias: expected a tensor on {y.device} (as I), got one on {eb.device}")
        idx = tables_on(self._tables, y.device).edge                       # (prod MPQ,)
        table = torch.cat([eb.to(y.dtype), eb.new_zeros(eb.shape[0], 1).to(y.dtype)], 1)    # column -1: no edge
        add = table[:, idx].view([1, self.K] + list(y.shape[2:]))
        return y + add

    # --- weight norm ----------------------------------------------------------------------------
    def _norm_dims(self) -> tuple[int, ...]:
        return tuple(range(1, 2 + len(self.TRS)))                          # per output channel of a block

    def l2_normalize(self, F, gain: Tensor | None = None, epsilon: float = 1e-12, dtype=None):
        """Each block's filter scaled to unit L2 norm per output channel (times ``gain``, one value
        per output channel of the blocks in order): the norm is sqrt(max(sum of squares, epsilon)),
        in fp32 (fp64 for fp64 filters). Returns F's form (per-block filters, the stacked tensor, or
        the flat (sizeF,) tensor), in ``dtype`` (a torch or numpy float dtype; default F's)."""
        out_dtype = _float_dtype("dtype", dtype)
        fs_in = list(self._filters(F))
        dims = self._norm_dims()
        out, off = [], 0
        n_out = [len(k) for k in self._k]                                   # output channels (deconv too)
        if gain is not None:
            if self._k_overlap():
                raise ValueError("gain: not supported when blocks share output channels")
            if not isinstance(gain, Tensor) or gain.numel() != sum(n_out):
                raise ValueError(f"gain: expected {sum(n_out)} values (the blocks' output channels in order), got "
                                 f"{tuple(gain.shape) if isinstance(gain, Tensor) else type(gain).__name__}")
        for f, n in zip(fs_in, n_out):
            work = f.to(torch.promote_types(f.dtype, torch.float32))
            norm = work.square().sum(dims, keepdim=True).clamp_min(epsilon).sqrt()
            g = work / norm
            if gain is not None:
                shape = [1] * f.dim()
                shape[1 if self._transposed else 0] = n
                g = g * gain.reshape(-1)[off:off + n].to(work.dtype).view(shape)
            off += n
            out.append(g.to(out_dtype or f.dtype))
        if isinstance(F, Tensor):                       # the form F came in: flat or stacked
            return torch.cat([o.reshape(-1) for o in out]) if F.dim() == 1 else torch.stack(out)
        return out

    def _k_overlap(self) -> bool:
        k = np.concatenate(self._k)
        return len(np.unique(k)) != len(k)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(blocks={self.blocks}, C={self.C}, K={self.K}, TRS={self.TRS}, "
                f"DHW={self.DHW}, MPQ={self.MPQ}, strides={self.strides}, dilates={self.dilates}, "
                f"padding={self.padding})")


class BlocksparseDeconv(BlocksparseConv):
    """The transposed convolution of :class:`BlocksparseConv`, with the seed's arguments: DHW is
    the deconv's input size and MPQ its output size (None: stride x input for "SAME", the full
    size for "VALID" and explicit padding). Block filters are (len(c_i), len(k_i), *TRS): c_i
    are the deconv's input channels, k_i its output channels."""

    _transposed = True

    def _geometry(self, MPQ):
        n = len(self.TRS)
        if MPQ is None:
            out = []
            for s, w, st, dl, p in zip(self.TRS, self.DHW, self.strides, self.dilates, self.padding):
                eff = (s - 1) * dl + 1
                out.append(w * st if p == "SAME" else (w - 1) * st + eff - 2 * p)
            MPQ = out
        self.MPQ = _dims("MPQ", MPQ, n, 1)
        # the forward convolution this one transposes: MPQ -> DHW
        try:
            fwd, self._pads = conv_geometry(self.TRS, self.MPQ, self.strides, self.dilates, self.padding)
        except ValueError as exc:
            raise ValueError(f"MPQ: the deconv's output {self.MPQ} is too small for its filter ({exc})") from None
        if fwd != self.DHW:
            raise ValueError(f"MPQ: a convolution of MPQ={self.MPQ} gives {fwd}, not the deconv's input DHW="
                             f"{self.DHW}; pass an MPQ whose convolution gives DHW")

    def _edge_patterns(self) -> np.ndarray:
        """Deconv output positions (the forward conv's inputs) by the pattern of taps whose forward
        output falls outside it (the seed's bprop rule; stride holes do not count)."""
        per_dim = []
        for x_n, q_n, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            num = np.arange(x_n)[:, None] + pb - np.arange(s)[None, :] * dl      # q * stride for tap s
            hole = num % st != 0
            q = num // st
            per_dim.append(~hole & ((q < 0) | (q >= q_n)))
        return self._edge_ids(per_dim, self.MPQ)

    def i_shape(self, N: int) -> list[int]:
        return [N, self.C] + self.DHW

    def o_shape(self, N: int) -> list[int]:
        return [N, self.K] + self.MPQ

    @property
    def edge_bias_shape(self) -> list[int]:
        if not self.edge_bias:
            raise ValueError("edge_bias_shape: this op was built with edge_bias=False")
        return [self.K, self._n_edges]

    def _fshape(self, b: int) -> list[int]:
        return [len(self._c[b]), len(self._k[b])] + self.TRS

    def _norm_dims(self) -> tuple[int, ...]:
        return (0,) + tuple(range(2, 2 + len(self.TRS)))                   # per output channel (dim 1)

    def _conv(self, x: Tensor, w: Tensor, groups: int = 1) -> Tensor:
        """This op's convolution (shared by the dense and grouped paths): conv_transpose with (in, out/groups, *TRS) weights, cropped to MPQ (asymmetric pads)."""
        n = len(self.TRS)
        extra = []
        for x_n, q_n, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            full = (q_n - 1) * st + (s - 1) * dl + 1
            extra.append(max(0, pb + x_n - full))
        outpad = [min(e, max(st, dl) - 1) for e, st, dl in zip(extra, self.strides, self.dilates)]
        y = _CONV_T[n](x, w, None, self.strides, 0, outpad, groups, self.dilates)
        sl = [slice(None), slice(None)]
        pad_after = []
        for d, (x_n, (pb, _)) in enumerate(zip(self.MPQ, self._pads)):
            have = y.shape[2 + d]
            sl.append(slice(pb, min(pb + x_n, have)))
            pad_after.append(pb + x_n - min(pb + x_n, have))
        y = y[tuple(sl)]
        if any(pad_after):
            y = F.pad(y, [p for a in reversed(pad_after) for p in (0, a)])
        return y


def cwise_linear(x: Tensor, gain: Tensor | None = None, bias: Tensor | None = None, relu: bool = False,
                 bias_first: bool = False, use_tf: bool = False, *, a: Tensor | None = None,
                 b: Tensor | None = None) -> Tensor:
    """gain·x + bias per channel (dim 1), the seed's argument names: gain and bias have C elements,
    as (1, C, 1, 1) or any shape of that size. ``bias_first``: (x + bias)·gain. ``relu``: max(·, 0).
    ``use_tf`` (the seed's TensorFlow fallback) has no effect. ``a=``, ``b=``: deprecated names of
    gain and bias."""
    if a is not None or b is not None:
        warnings.warn("cwise_linear: a= and b= are deprecated; use the seed's gain= and bias=", DeprecationWarning,
                      stacklevel=2)
        if (a is not None and gain is not None) or (b is not None and bias is not None):
            raise TypeError("cwise_linear: gain and a (or bias and b) name the same argument; pass one")
        gain = gain if a is None else a
        bias = bias if b is None else b
    a, b = gain, bias
    if a is None and b is None:
        raise ValueError("cwise_linear: expected gain, bias or both, got neither")
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor (N, C, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    for name, t in (("gain", a), ("bias", b)):
        if t is not None and (not isinstance(t, Tensor) or t.numel() != x.shape[1]):
            raise ValueError(f"{name}: expected {x.shape[1]} values (one per channel), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    a = None if a is None else a.reshape(shape).to(x.dtype)
    b = None if b is None else b.reshape(shape).to(x.dtype)
    if bias_first:
        y = x if b is None else x + b
        y = y if a is None else y * a
    else:
        y = x if a is None else x * a
        y = y if b is None else y + b
    return torch.relu(y) if relu else y
