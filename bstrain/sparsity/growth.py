"""Where blocks grow: the best-scored dead blocks within the block-row and block-column limits
that the tables hold (a greedy fill, then augmenting swaps), the balanced regrowth that gives
every block row and column its count back, and the ranking with random tie-breaks."""
from __future__ import annotations

import numpy as np
import torch


def _growth_limits(old: np.ndarray) -> tuple[int, int]:
    """The longest block row and column an unbalanced update may leave: the longer of
    :func:`bstrain.layout.growth_limit` (which the kernels' private tables hold) and the longest of
    ``old``. A function of the layout alone: every rank and a resumed run draw the same."""
    from bstrain.layout import growth_limit
    nnz, (rows, cols) = int(old.sum()), old.shape
    return (max(growth_limit(rows, nnz, cols), int(old.sum(1).max(initial=0))),
            max(growth_limit(cols, nnz, rows), int(old.sum(0).max(initial=0))))


def _why_fixed_when_balanced(old: np.ndarray, pruned: int) -> str | None:
    """Why a balanced update can never move a block of layout ``old`` when it prunes at most
    ``pruned`` blocks (None: it can). Every block row and column keeps its count, so a lone
    pruned block leaves one row and one column short, and only its own place lies in both; and
    a layout whose rows' live columns nest (each row's within every longer row's: one block row
    or column, one live block per column all in one row, a full layout) is the only one with its
    counts, since a move needs two rows each live where the other is dead (Ryser's interchange)."""
    if pruned < 2:
        return (f"an update prunes {pruned} of its {int(old.sum())} live blocks, and a lone pruned block can "
                f"regrow only where it was, its block row and column keeping their counts")
    rows = old[np.argsort(-old.sum(1), kind="stable")]                 # longest block row first
    if not (rows[1:] & ~rows[:-1]).any():
        return ("its layout is the only one with its block rows' and columns' live counts: each block row's "
                "live columns lie within every longer row's")
    return None


def _fill(order: np.ndarray, room_r: np.ndarray, room_c: np.ndarray, n: int, cols: int) -> list[int]:
    """Up to ``n`` cells of ``order`` (flat indices, best first), taken in that order wherever the
    cell's row and column still have room (``room_r``, ``room_c``: counts, decremented in place).
    Cells whose row or column has filled up are dropped in bulk; the rest are walked on
    Python ints (numpy scalars cost ~10x more per cell)."""
    picked: list[int] = []
    while len(picked) < n and order.size:
        order = order[(room_r[order // cols] > 0) & (room_c[order % cols] > 0)]
        chunk = 2 * (n - len(picked)) + 64
        head, order = order[:chunk].tolist(), order[chunk:]
        lack_r, lack_c = room_r.tolist(), room_c.tolist()
        for flat in head:
            r, c = divmod(flat, cols)
            if lack_r[r] > 0 and lack_c[c] > 0:
                picked.append(flat)
                lack_r[r] -= 1
                lack_c[c] -= 1
                if len(picked) == n:
                    break
        room_r[:], room_c[:] = lack_r, lack_c
    return picked


def _grow_within(old: np.ndarray, new: np.ndarray, score: torch.Tensor, n: int, gen: torch.Generator,
                 limit_r: int, limit_c: int) -> np.ndarray:
    """Flat indices of ``n`` blocks to grow among those dead before the update, best-scored first,
    such that no block row ends longer than ``limit_r`` nor column longer than ``limit_c``
    (:func:`_growth_limits`: so the update rewrites the kernels' tables in place and a captured
    step stays valid). Where the greedy choice falls short, augmenting swaps (as in balanced
    growth) make room; only where no choice within the limits exists do the best remaining blocks
    fill the rest (the layer then takes new tables)."""
    dead, cols, free = int((~old).sum()), old.shape[1], ~old
    for k in dict.fromkeys((min(dead, 2 * n + 64), dead)):      # the best 2n first; all of them if that falls short
        room_r, room_c = limit_r - new.sum(1), limit_c - new.sum(0)
        order = _top(score, k, gen)                             # best first
        picked = _fill(order, room_r, room_c, n, cols)
        if len(picked) == n:
            return np.asarray(picked, dtype=np.int64)
    grown = np.zeros(old.shape, dtype=bool)
    grown.flat[picked] = True
    short = n - len(picked)
    while short:
        path = _augmenting_path(free, grown, room_r, room_c)
        if path is None:
            break
        for i, (r, c) in enumerate(path):                       # add, remove, add, ...: one more grown
            grown[r, c] = i % 2 == 0
        room_r[path[0][0]] -= 1
        room_c[path[-1][1]] -= 1
        short -= 1
    rest = [flat for flat in order.tolist() if not grown.flat[flat]][:short]
    return np.concatenate([np.flatnonzero(grown), np.asarray(rest, dtype=np.int64)])


def _grow_balanced(old: np.ndarray, new: np.ndarray, pruned: np.ndarray, score: torch.Tensor,
                   gen: torch.Generator) -> np.ndarray:
    """Grows blocks into ``new`` (``old`` with ``pruned`` dropped) so that every row and column of
    blocks gets its count back, with as few of the just-pruned blocks as the counts allow: first
    the best-scored blocks dead before the update whose row and column both still lack one, then
    augmenting swaps, each of the fewest just-pruned blocks (successive cheapest paths: a b-matching
    of the most blocks dead before the update). One always exists, since regrowing the pruned
    blocks closes every gap. Without the swaps, small or dense layouts often regrew exactly what
    was pruned."""
    need_r, need_c = old.sum(1) - new.sum(1), old.sum(0) - new.sum(0)      # blocks each still lacks
    free = ~new                                                            # where a block may grow
    cost = np.zeros(old.shape, dtype=np.int64)                             # a just-pruned block costs 1
    cost.flat[pruned] = 1
    grown = np.zeros(old.shape, dtype=bool)
    # the greedy fill, best first, over the blocks dead before the update whose row and column both
    # lack one (no other cell can be taken): a few percent of the layout
    order = np.flatnonzero(free & (cost == 0) & (need_r[:, None] > 0) & (need_c[None, :] > 0))
    order = order[_top(score.view(-1)[torch.as_tensor(order)], order.size, gen)]
    grown.flat[_fill(order, need_r, need_c, int(need_r.sum()), old.shape[1])] = True
    while need_r.any():
        path = _augmenting_path(free, grown, need_r, need_c, cost)
        if path is None:                    # cannot happen (the pruned blocks are a solution)
            raise RuntimeError("sparsity: no balanced regrowth found; please report this layout")
        for k, (r, c) in enumerate(path):   # add, remove, add, ..., add
            grown[r, c] = k % 2 == 0
        need_r[path[0][0]] -= 1
        need_c[path[-1][1]] -= 1
    return new | grown


def _augmenting_path(free: np.ndarray, grown: np.ndarray, need_r: np.ndarray, need_c: np.ndarray,
                     cost: np.ndarray | None = None):
    """Cells [(r0, c0), (r1, c0), (r1, c1), ...] from a row that lacks a block to a column that
    lacks one: grow the 1st, 3rd, ... (free, not grown) and drop the 2nd, 4th, ... (grown); None if
    there is none. With ``cost`` (per cell), the cheapest such path (growing a cell adds its cost,
    dropping one takes it off): from a grown set of the least cost for its size, the grown set
    then stays of the least cost for its size. Bellman-Ford over the rows and columns, a
    whole-matrix relaxation at a time (the grown set has no negative cycle)."""
    rows, cols = free.shape
    cost = np.zeros(free.shape) if cost is None else cost.astype(np.float64)
    can_grow = free & ~grown
    d_row = np.where(need_r > 0, 0.0, np.inf)       # the cheapest way to reach each row and column
    d_col = np.full(cols, np.inf)
    col_from = np.full(cols, -1)                    # the row a column was reached from (a cell grown)
    row_from = np.full(rows, -1)                    # the column a row was reached from (a cell dropped)
    for _ in range(rows + cols + 1):
        via = np.where(can_grow, d_row[:, None] + cost, np.inf)        # row -> column: grow (r, c)
        r_best = via.argmin(0)
        better = via[r_best, np.arange(cols)] < d_col
        d_col[better], col_from[better] = via[r_best, np.arange(cols)][better], r_best[better]
        via = np.where(grown, d_col[None, :] - cost, np.inf)           # column -> row: drop (r, c)
        c_best = via.argmin(1)
        better_r = via[np.arange(rows), c_best] < d_row
        d_row[better_r], row_from[better_r] = via[np.arange(rows), c_best][better_r], c_best[better_r]
        if not (better.any() or better_r.any()):
            break
    ends = np.flatnonzero((need_c > 0) & np.isfinite(d_col))
    if not ends.size:
        return None
    path, c = [], int(ends[d_col[ends].argmin()])
    while True:                                     # walk back to a row that lacks a block
        r0 = int(col_from[c])
        path.append((r0, c))
        if row_from[r0] < 0:
            return path[::-1]
        path.append((r0, int(row_from[r0])))
        c = int(row_from[r0])


def _top(score: torch.Tensor, n: int, gen: torch.Generator) -> np.ndarray:
    """Flat indices of the n highest scores of ``score`` (ties in a random order drawn from gen)."""
    flat = score.flatten()
    order = torch.randperm(flat.numel(), generator=gen)
    if n >= flat.numel():
        best = torch.argsort(flat[order], descending=True, stable=True)
    else:       # a partial selection: an update replaces a few percent of a layer's blocks
        best = torch.topk(flat[order], n).indices
    return order[best].numpy()
