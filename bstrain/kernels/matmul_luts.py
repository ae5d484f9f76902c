"""Lookup tables of the block-sparse matmul kernels (:mod:`bstrain.kernels.matmul`), built once
per (layout, device): each output block's list of (input block, weight block) entries, heaviest
first (:class:`SegmentLut`), the output panels that share one list (:class:`PanelLut`), and both
directions of one layout with dW's runs (:class:`BsmmLuts`), which dynamic sparsity rewrites in
place.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import triton

from bstrain._tensors import INT32_MAX as _INT32_MAX
from bstrain.layout import growth_limit



@dataclass
class SegmentLut:
    """Entries grouped by output block: entries ptr[j]:ptr[j+1] feed output block j.

    blk: input block of each entry; idx: weight block of each entry; order: output blocks,
    heaviest first; max_count: the longest list; cap: the longest list the launch plans hold in
    registers (the next power of two, at least 16), which an in-place rewrite must not exceed.
    """
    ptr: torch.Tensor    # (n_out + 1,) int32
    blk: torch.Tensor    # (nnz,) int32
    idx: torch.Tensor    # (nnz,) int32
    order: torch.Tensor  # (n_out,) int32
    max_count: int
    packed: torch.Tensor  # (nnz,) int32: idx * n_in + blk, one load per entry
    n_in: int
    cap: int
    plans: dict = field(default_factory=dict)    # launch plans by argument shape/layout (launch.plan)
    panels: object = field(default=False, repr=False)   # PanelLut, None (no shared lists), False (not built)

    @property
    def n_out(self) -> int:
        return self.order.numel()

    def take_entries(self, other: "SegmentLut") -> None:
        """Copies ``other``'s lists into these tensors (the same output and entry counts, no list
        longer than ``cap``: checked by :meth:`BsmmLuts.check_rewrite`)."""
        for mine, theirs in ((self.ptr, other.ptr), (self.blk, other.blk), (self.idx, other.idx),
                             (self.packed, other.packed), (self.order, other.order)):
            mine.copy_(theirs)
        self.max_count = other.max_count


@dataclass
class PanelLut:
    """Output blocks of a SegmentLut whose input-block lists are equal, in groups of up to ``nb``
    (:func:`bstrain.kernels.matmul._bsmm_panel_kernel`), and the rest (``single``, heaviest first) for the one-block
    kernels. A tiled layout (the mLSTM's four gates share one pattern) has groups of 4."""
    nb: int
    ptr: torch.Tensor     # (n_groups + 1,) int32: entries of each group
    blk: torch.Tensor     # (entries,) int32: input block of each entry
    idx: torch.Tensor     # (entries, nb) int32: weight block of each slot, -1 if none
    col: torch.Tensor     # (n_groups, nb) int32: output block of each slot, -1 if none
    order: torch.Tensor   # (n_groups,) int32: heaviest groups first
    single: SegmentLut    # the SegmentLut restricted (by its order) to the ungrouped output blocks
    share: float          # share of the entries that the groups hold
    plans: dict = field(default_factory=dict)

    @property
    def n_groups(self) -> int:
        return self.order.numel()


PANEL_WIDTH = 128        # most output columns a panel program holds (nb * bs)


def panel_lut(lut: SegmentLut, bs: int) -> PanelLut | None:
    """The panels of ``lut`` (None when no two output blocks share an input-block list)."""
    ptr = lut.ptr.cpu().numpy()
    blk, idx = lut.blk.cpu().numpy(), lut.idx.cpu().numpy()
    by_rows: dict[bytes, list[int]] = {}
    for j in range(len(ptr) - 1):
        if ptr[j + 1] > ptr[j]:
            by_rows.setdefault(blk[ptr[j]:ptr[j + 1]].tobytes(), []).append(j)
    sizes = [len(cols) for cols in by_rows.values() if len(cols) > 1]
    if not sizes or bs < 16:
        return None
    nb = min(PANEL_WIDTH // bs, triton.next_power_of_2(max(sizes)))
    if nb < 2:
        return None
    g_ptr, g_blk, g_idx, g_col, grouped = [0], [], [], [], set()
    for cols in by_rows.values():
        for i in range(0, len(cols) - 1, nb):              # a trailing single column stays single
            part = cols[i:i + nb]
            if len(part) < 2:
                continue
            first = ptr[part[0]]
            count = ptr[part[0] + 1] - first
            g_blk.extend(blk[first:first + count])
            slots = np.full((count, nb), -1, dtype=np.int64)
            for s, j in enumerate(part):
                slots[:, s] = idx[ptr[j]:ptr[j + 1]]
            g_idx.append(slots)
            g_col.append(part + [-1] * (nb - len(part)))
            g_ptr.append(g_ptr[-1] + count)
            grouped.update(part)
    dev = lut.ptr.device
    counts = np.diff(g_ptr)

    def as_t(v):
        return torch.as_tensor(np.ascontiguousarray(v), dtype=torch.int32, device=dev)
    order = lut.order.cpu().numpy()
    single = [j for j in order if j not in grouped]
    rest = SegmentLut(lut.ptr, lut.blk, lut.idx, as_t(np.asarray(single, dtype=np.int64)), lut.max_count, lut.packed,
                      lut.n_in, lut.cap)
    grouped_entries = sum(int(ptr[j + 1] - ptr[j]) for j in grouped)
    return PanelLut(nb, as_t(g_ptr), as_t(g_blk), as_t(np.concatenate(g_idx)), as_t(g_col),
                    as_t(np.argsort(-counts, kind="stable")), rest, grouped_entries / max(1, int(ptr[-1])))


@dataclass
class BsmmLuts:
    """All tables of one layout on one device. Built once per (layout, device)."""
    block_size: int
    C: int
    K: int
    nnz: int
    fwd: SegmentLut      # per output block-column k: (c, weight idx); also dW's source
    bwd: SegmentLut      # per input block-row c: (k, weight idx); dX
    _dw_items: dict = field(default_factory=dict)
    dw_plans: dict = field(default_factory=dict)

    def has_panels(self) -> bool:
        """Whether output panels (layout-dependent groupings: see kernels.matmul.PANELS) were built for these
        tables: then they are never rewritten in place."""
        return any(lut.panels not in (False, None) for lut in (self.fwd, self.bwd))

    def no_panels(self) -> None:
        """Never build output panels on these tables (a layout that changes in place), unless
        they were built already."""
        for lut in (self.fwd, self.bwd):
            if lut.panels is False:
                lut.panels = None

    def check_rewrite(self, layout: np.ndarray) -> None:
        """A ValueError unless these tables can take ``layout`` in place: the same shape and
        live-block count, no block column or row longer than the ``cap`` that launch plans were
        made for, and no output panels built. Per-row and per-column counts may change."""
        if self.has_panels():
            raise ValueError("layout: tables whose output panels are built (kernels.matmul.PANELS) group blocks by "
                             "layout and are not switched in place")
        lay = np.asarray(layout, dtype=bool)
        shape = (self.C // self.block_size, self.K // self.block_size)
        if lay.shape != shape or int(lay.sum()) != self.nnz:
            raise ValueError(f"layout: an in-place rewrite needs a {shape} layout with {self.nnz} live blocks, got "
                             f"{lay.shape} with {int(lay.sum())}")
        for counts, lut, what in ((lay.sum(0), self.fwd, "column"), (lay.sum(1), self.bwd, "row")):
            if int(counts.max(initial=0)) > lut.cap:
                raise ValueError(f"layout: a block {what} with {int(counts.max())} live blocks; these tables hold at "
                                 f"most {lut.cap} per {what} in place")

    def rewrite(self, layout: np.ndarray) -> None:
        """Switches these tables to ``layout`` in place (a ValueError first, with nothing changed,
        where :meth:`check_rewrite` refuses): plans and captured CUDA graphs that read them then run
        the new layout. Every tensor keeps its length, and every launch its grid."""
        self.check_rewrite(layout)
        new = make_luts(layout, self.block_size, "cpu")             # on the host, then one copy per table
        self.fwd.take_entries(new.fwd)
        self.bwd.take_entries(new.bwd)
        ptr = new.fwd.ptr.numpy()
        for group, tensors in self._dw_items.items():
            for mine, theirs in zip(tensors, self._dw_runs(ptr, group)):
                mine.copy_(torch.from_numpy(theirs))

    def dw_items(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(column, first entry, count) of runs of up to ``group`` entries of one column, padded with
        empty runs (count 0) to a length that no layout of this shape and live-block count exceeds:
        the dW grid stays the same when the layout changes in place."""
        if group not in self._dw_items:
            self._dw_items[group] = tuple(torch.as_tensor(v, device=self.fwd.ptr.device)
                                          for v in self._dw_runs(self.fwd.ptr.cpu().numpy(), group))
        return self._dw_items[group]

    def _dw_runs(self, ptr: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`dw_items` on the host, as int32 arrays, from the fwd lists' ``ptr``."""
        ptr = ptr.astype(np.int64)
        n_out = len(ptr) - 1
        runs = -(-np.diff(ptr) // group)                              # runs of each column
        cols = np.repeat(np.arange(n_out), runs)
        first = np.concatenate([[0], np.cumsum(runs)])[:-1]           # each column's first run
        starts = ptr[cols] + (np.arange(cols.size) - first[cols]) * group
        counts = np.minimum(group, ptr[cols + 1] - starts)
        length = min(self.nnz, (self.nnz + min(n_out, self.nnz) * (group - 1)) // group)
        out = np.zeros((3, length), dtype=np.int32)                   # padding runs: column 0, count 0
        out[:, :cols.size] = cols, starts, counts
        return out[0], out[1], out[2]


def _cap(max_count: int, n_in: int, headroom: bool, n_out: int = 1, nnz: int = 0) -> int:
    """The longest list a SegmentLut's launch plans hold: the next power of two (at least 16) of
    the longest; with headroom (tables that change in place), of a quarter more and at least the
    :func:`bstrain.layout.growth_limit` of its ``n_out`` lists of ``nnz`` entries, up to n_in's."""
    if not headroom:
        return max(16, triton.next_power_of_2(max(1, max_count)))
    want = max(16, triton.next_power_of_2(max_count + max(1, max_count // 4)), growth_limit(n_out, nnz, n_in))
    return min(want, max(16, triton.next_power_of_2(max(1, n_in))))


def _segment_lut(out_of_entry: np.ndarray, in_of_entry: np.ndarray, n_out: int, n_in: int,
                 device: torch.device, headroom: bool = False) -> SegmentLut:
    weight_idx = np.arange(out_of_entry.size)
    perm = np.lexsort((in_of_entry, out_of_entry))            # by output block, then input block
    counts = np.bincount(out_of_entry, minlength=n_out)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    order = np.argsort(-counts, kind="stable")

    def as_t(v):
        return torch.as_tensor(np.ascontiguousarray(v), dtype=torch.int32, device=device)
    n_in = max(1, n_in)                                           # the layout's, so a rewrite keeps the decoding
    packed = weight_idx[perm].astype(np.int64) * n_in + in_of_entry[perm]
    if packed.size and packed.max() > _INT32_MAX:
        raise ValueError("layout: too many blocks for 32-bit lookup tables")
    max_count = int(counts.max(initial=0))
    return SegmentLut(as_t(ptr), as_t(in_of_entry[perm]), as_t(weight_idx[perm]), as_t(order),
                      max_count, as_t(packed), n_in, _cap(max_count, n_in, headroom, n_out, int(out_of_entry.size)))


def make_luts(layout: np.ndarray, block_size: int, device: torch.device | str, headroom: bool = False) -> BsmmLuts:
    """Tables for a validated (Cb, Kb) bool layout; live blocks numbered row-major. headroom: the
    layout will change in place (dynamic sparsity), so the lists' ``cap`` leaves room to grow."""
    c_idx, k_idx = np.nonzero(layout)
    cb, kb = layout.shape
    device = torch.device(device)
    return BsmmLuts(block_size, cb * block_size, kb * block_size, int(c_idx.size),
                    fwd=_segment_lut(k_idx, c_idx, kb, cb, device, headroom),
                    bwd=_segment_lut(c_idx, k_idx, cb, kb, device, headroom))
