"""Block-sparse convolution: the seed's ``BlocksparseConv`` / ``BlocksparseDeconv`` and
``cwise_linear`` on torch tensors, with autograd.

**Blocks.** ``BCK`` is a sequence of blocks, each a pair (input-channel indices, output-channel
indices). Block i connects its input channels to its output channels through a filter of shape
``f_shape(block=i) = (len(k_i), len(c_i), *TRS)`` (deconv: ``(len(c_i), len(k_i), *TRS)``, the
layout of ``conv_transpose``). Blocks may differ in size and overlap; overlapping contributions
add. C and K are one more than the largest input and output index.

**Geometry.** TRS, DHW and MPQ take 1-3 dims (the activations' spatial dims, N and C first, as in
the seed). Padding is ``"SAME"`` (TensorFlow's rule: output ceil(size / stride), the total
padding split with the extra element after, so even filters and strides pad asymmetrically),
``"VALID"``, or explicit per-dim ints (symmetric).

**How it runs** (all of it PyTorch, so autograd, ``torch.compile`` and cuDNN apply):

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
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BlocksparseConv", "BlocksparseDeconv", "cwise_linear", "conv_geometry", "conv_nd"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


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


def conv_geometry(TRS, DHW, strides, dilates, padding) -> tuple[list[int], list[tuple[int, int]]]:
    """(output size per dim, (pad before, pad after) per dim) of a convolution of DHW."""
    out, pads = [], []
    for s, w, st, dl, p in zip(TRS, DHW, strides, dilates, padding):
        eff = (s - 1) * dl + 1
        if p == "SAME":
            q = -(-w // st)
            total = max((q - 1) * st + eff - w, 0)
            pads.append((total // 2, total - total // 2))
        else:
            pads.append((p, p))
        q = (w + sum(pads[-1]) - eff) // st + 1
        if q < 1:
            raise ValueError(f"DHW: the filter ({s}, dilation {dl}) does not fit an input of {w} with padding "
                             f"{pads[-1]}")
        out.append(q)
    return out, pads


def conv_nd(x: Tensor, w: Tensor, strides, dilates, pads, groups: int = 1) -> Tensor:
    """F.conv1d/2d/3d with (before, after) padding per dim (asymmetric pads go through F.pad)."""
    n = x.dim() - 2
    if all(a == b for a, b in pads):
        return _CONV[n](x, w, None, list(strides), [a for a, _ in pads], list(dilates), groups)
    flat = [p for pair in reversed(pads) for p in pair]                      # F.pad: last dim first
    return _CONV[n](F.pad(x, flat), w, None, list(strides), 0, list(dilates), groups)


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
                 edge_bias=False, debug=False, backend: str = "auto"):
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
        hit = self.__dict__.setdefault("_dense_idx", {}).get(device)
        if hit is None:
            rows, cols = [], []
            for c, k in zip(self._c, self._k):
                a, b = (c, k) if self._transposed else (k, c)
                rows.append(np.repeat(a, len(b)))
                cols.append(np.tile(b, len(a)))
            hit = self._dense_idx[device] = (torch.as_tensor(np.concatenate(rows), device=device),
                                             torch.as_tensor(np.concatenate(cols), device=device))
        return hit

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
        """(input channel gather or None, output scatter or None), cached per device."""
        plan = getattr(self, "_plans", {}).get(device)
        if plan is None:
            cin = np.concatenate(self._c)
            kout = np.concatenate(self._k)
            gather = None if np.array_equal(cin, np.arange(self.C)) else torch.as_tensor(cin, device=device)
            if np.array_equal(kout, np.arange(self.K)):
                scatter = None
            else:
                scatter = torch.as_tensor(kout, device=device)
            plan = (gather, scatter)
            self.__dict__.setdefault("_plans", {})[device] = plan
        return plan

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
        idx = self.__dict__.setdefault("_edge_idx", {}).get(y.device)
        if idx is None:                                                   # once per device, not per call
            idx = self._edge_idx[y.device] = torch.as_tensor(self._edge_map, device=y.device)
        table = torch.cat([eb.to(y.dtype), eb.new_zeros(eb.shape[0], 1).to(y.dtype)], 1)    # column -1: no edge
        add = table[:, idx].view([1, self.K] + list(y.shape[2:]))
        return y + add

    # --- weight norm ----------------------------------------------------------------------------
    def _norm_dims(self) -> tuple[int, ...]:
        return tuple(range(1, 2 + len(self.TRS)))                          # per output channel of a block

    def l2_normalize(self, F, gain: Tensor | None = None, epsilon: float = 1e-6) -> list[Tensor]:
        """Each block's filter scaled to unit L2 norm per output channel (times ``gain``, one value
        per output channel of the blocks in order); returns per-block filters like F."""
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
            norm = f.float().square().sum(dims, keepdim=True).clamp_min(epsilon).sqrt()
            g = f.float() / norm
            if gain is not None:
                shape = [1] * f.dim()
                shape[1 if self._transposed else 0] = n
                g = g * gain.reshape(-1)[off:off + n].float().view(shape)
            off += n
            out.append(g.to(f.dtype))
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


def cwise_linear(x: Tensor, a: Tensor | None = None, b: Tensor | None = None, relu: bool = False,
                 bias_first: bool = False) -> Tensor:
    """a·x + b per channel (dim 1): a and b have C elements, as (1, C, 1, 1) or any shape of that
    size. ``bias_first``: (x + b)·a. ``relu``: max(·, 0)."""
    if a is None and b is None:
        raise ValueError("cwise_linear: expected a, b or both, got neither")
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor (N, C, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    for name, t in (("a", a), ("b", b)):
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



# --- torch.ops.bstrain.bsconv2d: the Triton kernels as custom ops ----------------------------------
# The layout travels as its index tables (int32 tensors: col_ptr, col_blk, col_in, row_ptr, row_blk,
# row_out, blk_in, blk_out of bstrain.kernels.conv.ConvLuts), so the ops need no registry.
# Traced calls (torch.compile, export) go through the custom ops; eager calls run the same bodies
# through an autograd.Function (sparse_conv2d below): the dispatcher's boxed calls into Python cost
# about 0.4 ms per op on the H200, more than the kernels of a ResNet layer.
def _wt(weight: Tensor) -> Tensor:
    """(nnz, out, in, kh, kw) -> the kernels' (nnz, kh, kw, in, out), contiguous."""
    return weight.permute(0, 3, 4, 2, 1).contiguous()


def _luts(weight: Tensor, tables: list[Tensor]):
    from bstrain.kernels.conv import ConvLuts
    return ConvLuts(weight.shape[1], *tables)


@torch.library.custom_op("bstrain::bsconv2d", mutates_args=())
def bsconv2d(x: Tensor, weight: Tensor, tables: list[Tensor], K: int, P: int, Q: int, stride: list[int],
             pads: list[int], dilation: list[int]) -> Tensor:
    """y (N, K, P, Q) of a block-sparse 2-D convolution (weight (nnz, bs, bs, kh, kw)); pads =
    (top, left). CUDA (or TRITON_INTERPRET=1): the Triton kernels."""
    return _forward(x, weight, tables, K, P, Q, stride, pads, dilation)


def _forward(x, weight, tables, K, P, Q, stride, pads, dilation, wt=None) -> Tensor:
    from bstrain.kernels.conv import conv_forward
    return conv_forward(x, _wt(weight) if wt is None else wt, _luts(weight, tables), K, P, Q, stride, pads, dilation)


@bsconv2d.register_fake
def _(x, weight, tables, K, P, Q, stride, pads, dilation):
    return _like_out((x.shape[0], K, P, Q), x)


@torch.library.custom_op("bstrain::bsconv2d_bwd", mutates_args=())
def bsconv2d_bwd(dy: Tensor, x: Tensor, weight: Tensor, tables: list[Tensor], stride: list[int], pads: list[int],
                 dilation: list[int], need_dx: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of bsconv2d; an unneeded one is an empty tensor."""
    return _backward(dy, x, weight, tables, stride, pads, dilation, need_dx, need_dw)


def _backward(dy, x, weight, tables, stride, pads, dilation, need_dx, need_dw, wt=None) -> tuple[Tensor, Tensor]:
    from bstrain.kernels.conv import conv_dw, conv_dx
    luts = _luts(weight, tables)
    if dy.stride(1) != 1 and x.stride(1) == 1 and dy.dim() == 4:      # channels-last x: gather dy's channels
        dy = dy.contiguous(memory_format=torch.channels_last)         # from contiguous rows, not strided ones
    kh, kw = weight.shape[3], weight.shape[4]
    dx = conv_dx(dy, _wt(weight) if wt is None else wt, luts, x.shape[1], x.shape[2], x.shape[3], stride, pads, dilation, x) if need_dx \
        else x.new_empty(0)
    dw = conv_dw(x, dy, luts, kh, kw, stride, pads, dilation).to(weight.dtype).contiguous() if need_dw \
        else weight.new_empty(0)
    return dx, dw


def _like_out(shape, like: Tensor) -> Tensor:
    """An empty (N, C, H, W) in the memory format the kernels' launchers give (bstrain.kernels.conv._out)."""
    N, C, H, W = shape
    if like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous():
        return like.new_empty((N, H, W, C)).permute(0, 3, 1, 2)
    return like.new_empty(shape)


@bsconv2d_bwd.register_fake
def _(dy, x, weight, tables, stride, pads, dilation, need_dx, need_dw):
    return (_like_out(tuple(x.shape), x) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else weight.new_empty(0))


def _bsconv2d_setup(ctx, inputs, output):
    x, weight, tables, _, _, _, stride, pads, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.tables, ctx.stride, ctx.pads, ctx.dilation = tables, stride, pads, dilation


def _bsconv2d_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = bsconv2d_bwd(dy, x, weight, ctx.tables, ctx.stride, ctx.pads, ctx.dilation, need_dx, need_dw)
    return (dx if need_dx else None, dw if need_dw else None, [None] * len(ctx.tables), None, None, None, None,
            None, None)


bsconv2d.register_autograd(_bsconv2d_backward, setup_context=_bsconv2d_setup)


class _SparseConv2dFn(torch.autograd.Function):
    """bsconv2d and its backward for eager calls (no dispatcher round trip)."""

    @staticmethod
    def forward(ctx, x, weight, tables, K, P, Q, stride, pads, dilation):
        wt = _wt(weight)                                  # the kernels' filter layout, reused by dX
        ctx.save_for_backward(x, weight, wt)
        ctx.tables, ctx.stride, ctx.pads, ctx.dilation = tables, stride, pads, dilation
        return _forward(x, weight, tables, K, P, Q, stride, pads, dilation, wt)

    @staticmethod
    def backward(ctx, dy):
        x, weight, wt = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = _backward(dy, x, weight, ctx.tables, ctx.stride, ctx.pads, ctx.dilation, need_dx, need_dw, wt)
        return dx if need_dx else None, dw if need_dw else None, None, None, None, None, None, None, None


def sparse_conv2d(x: Tensor, weight: Tensor, tables: list[Tensor], K: int, P: int, Q: int, stride: list[int],
                  pads: list[int], dilation: list[int]) -> Tensor:
    """bsconv2d with autograd: the custom op when traced, the lighter autograd.Function eagerly."""
    from bstrain.ops.library import eager
    if eager(x):
        return _SparseConv2dFn.apply(x, weight, tables, K, P, Q, stride, pads, dilation)
    return bsconv2d(x, weight, tables, K, P, Q, stride, pads, dilation)
