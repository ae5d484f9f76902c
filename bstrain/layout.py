"""Block layouts: 2-D 0/1 arrays of shape (C/bs, K/bs) that say which weight blocks are live.

A layout entry ``layout[c, k] == 1`` means the bs x bs block that maps input features
``c*bs:(c+1)*bs`` to output features ``k*bs:(k+1)*bs`` is stored and used. Live blocks are
numbered in row-major (c-major) order; that is the order of the weight tensor's first axis.

Builders return ``np.ndarray`` of dtype bool. Every op accepts numpy arrays, torch tensors or
nested lists and validates them with :func:`as_layout`. Attention layouts (query blocks x key
blocks, optionally per head) are at the end of the module.
"""
from __future__ import annotations

import numpy as np
import torch

from bstrain._tensors import real_tensors

__all__ = [
    "as_layout", "validate", "from_array", "dense", "random", "balanced", "block_diagonal",
    "barabasi_albert", "watts_strogatz", "density", "z_order_rank",
    "causal_mask", "local_mask", "strided_mask", "fixed_mask", "longformer_mask", "bigbird_mask",
    "attention_layout", "layout_image", "BLOCK_SIZES", "KERNEL_BLOCK_SIZES", "check_block_size"]


BLOCK_SIZES = (8, 16, 32, 64, 128)           # every block size a layout of bstrain's ops may use
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)       # those of the attention and convolution Triton kernels (8: PyTorch)


def check_block_size(block_size, allowed: tuple = BLOCK_SIZES, name: str = "block_size") -> int:
    """``block_size`` as an int if it is one of ``allowed``; a ValueError naming ``name`` otherwise."""
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) \
            or int(block_size) not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {block_size!r}")
    return int(block_size)


def _rng(seed: int | None) -> np.random.Generator:
    """numpy generator for a builder: from ``seed``, or, when None, seeded from torch's global
    RNG, so that ``torch.manual_seed`` reproduces every layout drawn without a seed."""
    if seed is None:
        # layouts are host data: drawn on the CPU generator whatever the default device (meta too)
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
    return np.random.default_rng(seed)


def as_layout(layout, name: str = "layout") -> np.ndarray:
    """Converts a numpy array, torch tensor or nested list to a validated bool layout.

    Raises ValueError when the layout is not 2-D, holds values other than 0/1, or has no
    live block; TypeError when it is not array-like.
    """
    if isinstance(layout, torch.Tensor):
        arr = layout.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(layout)
        except Exception as exc:  # ragged nested lists and the like
            raise TypeError(f"{name}: expected a 2-D 0/1 array, got {type(layout).__name__}") from exc
    if arr.dtype == object or not (arr.dtype == bool or np.issubdtype(arr.dtype, np.number)):
        raise TypeError(f"{name}: expected a numeric 2-D 0/1 array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array of shape (C/bs, K/bs), got shape {arr.shape}")
    if arr.size and not np.isin(arr, (0, 1)).all():
        bad = arr[~np.isin(arr, (0, 1))].ravel()[0]
        raise ValueError(f"{name}: expected only 0/1 entries, got value {bad!r}")
    out = np.ascontiguousarray(arr, dtype=bool)                # row-major, whatever the input's order
    if not out.any():
        raise ValueError(f"{name}: expected at least one live block, got an all-zero layout of shape {arr.shape}")
    return out


def validate(layout, in_features: int | None = None, out_features: int | None = None,
             block_size: int | None = None) -> np.ndarray:
    """:func:`as_layout` plus a check that the shape matches (in_features/bs, out_features/bs)."""
    out = as_layout(layout)
    if block_size is not None:
        for feat_name, feat, dim in (("in_features", in_features, 0), ("out_features", out_features, 1)):
            if feat is None:
                continue
            if feat % block_size or feat // block_size != out.shape[dim]:
                raise ValueError(
                    f"layout: expected {feat_name}={feat} to equal layout.shape[{dim}] * block_size "
                    f"= {out.shape[dim]} * {block_size}, got layout shape {out.shape}")
    return out


def from_array(arr) -> np.ndarray:
    """A user's own 0/1 array as a validated layout."""
    return as_layout(arr)


def density(layout) -> float:
    """Fraction of live blocks."""
    lay = as_layout(layout)
    return float(lay.mean())


def dense(shape: tuple[int, int]) -> np.ndarray:
    """All blocks live."""
    return np.ones(shape, dtype=bool)


def check_density(density) -> float:
    """density as a float in (0, 1], or a ValueError naming it."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(f"density: expected a value in (0, 1], got {density!r}")
    return float(density)


def random(shape: tuple[int, int], density: float, seed: int | None = None) -> np.ndarray:
    """Each block live with probability ``density``, independently; at least one block is live.

    The realised density varies around ``density`` and some rows or columns may be empty; see
    :func:`balanced` for an exact, even draw. Without a seed the draw follows torch's RNG.
    """
    density = check_density(density)
    rng = _rng(seed)
    lay = rng.random(shape) < density
    if not lay.any():
        lay[rng.integers(shape[0]), rng.integers(shape[1])] = True
    return lay


def _spread(n: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """n items over ``parts`` bins as evenly as possible: n // parts each, one more in a random n % parts."""
    counts = np.full(parts, n // parts, dtype=np.int64)
    counts[rng.permutation(parts)[:n % parts]] += 1
    return counts


def balanced(shape: tuple[int, int], density: float, seed: int | None = None) -> np.ndarray:
    """Exactly ``round(density · Cb·Kb)`` live blocks (at least one), spread evenly and at random.

    Every output block-column gets ⌊n/Kb⌋ or ⌈n/Kb⌉ live blocks and every input block-row
    ⌊n/Cb⌋ or ⌈n/Cb⌉, so no output unit is left without inputs (and no input unused) once
    n >= max(Cb, Kb). Without a seed the draw follows torch's RNG.
    """
    density = check_density(density)
    cb, kb = shape
    n = min(cb * kb, max(1, int(round(density * cb * kb))))
    rng = _rng(seed)
    col_need, row_left = _spread(n, kb, rng), _spread(n, cb, rng)
    lay = np.zeros((cb, kb), dtype=bool)
    # Ryser's construction: fullest columns first, each into the rows with the most room left
    # (random order among equals), which always succeeds for margins this even.
    for k in sorted(rng.permutation(kb), key=lambda j: -col_need[j]):
        need = int(col_need[k])
        if need:
            rows = np.argsort(-(row_left + rng.random(cb)), kind="stable")[:need]
            lay[rows, k] = True
            row_left[rows] -= 1
    assert (row_left == 0).all() and lay.sum() == n, "balanced layout: margins not met"
    return lay


def growth_limit(n_lists: int, nnz: int, n_in: int) -> int:
    """How long dynamic sparsity may grow any one of ``n_lists`` block rows (or columns) holding
    ``nnz`` live blocks in all, each at most ``n_in`` long: twice the mean, to the next power of
    two, at least 16. The kernels' private tables hold lists this long, so updates within it are
    rewritten in place. It depends on the shape and live-block count only: every rank and a
    resumed run draw the same limit."""
    twice_mean = max(1, -(-2 * nnz // max(1, n_lists)))
    return min(max(1, n_in), max(16, 1 << (twice_mean - 1).bit_length()))


def block_diagonal(n: int, group: int = 1) -> np.ndarray:
    """(n, n) layout with square groups of ``group`` x ``group`` live blocks on the diagonal."""
    if n < 1 or group < 1:
        raise ValueError(f"block_diagonal: expected n >= 1 and group >= 1, got n={n}, group={group}")
    ids = np.arange(n) // group
    return ids[:, None] == ids[None, :]


def barabasi_albert(n: int, m: int, seed: int | None = None, self_loops: bool = True) -> np.ndarray:
    """Symmetric (n, n) adjacency of a Barabási–Albert preferential-attachment graph.

    The seed's small-world recurrent layouts: a few hub blocks with many connections.
    Starts from a star on m+1 nodes; each new node links to m distinct nodes drawn with
    probability proportional to their degree. ``self_loops`` adds the diagonal, so an
    identity init makes the op the identity.
    """
    if not 1 <= m < n:
        raise ValueError(f"barabasi_albert: expected 1 <= m < n, got m={m}, n={n}")
    rng = _rng(seed)
    adj = np.zeros((n, n), dtype=bool)
    adj[0, 1:m + 1] = adj[1:m + 1, 0] = True
    ends = [0] * m + list(range(1, m + 1))  # each node repeated once per edge end
    for node in range(m + 1, n):
        targets: set[int] = set()
        while len(targets) < m:
            targets.add(ends[rng.integers(len(ends))])
        for t in targets:
            adj[node, t] = adj[t, node] = True
            ends.extend((node, t))
    if self_loops:
        np.fill_diagonal(adj, True)
    return adj


def watts_strogatz(n: int, k: int, p: float, seed: int | None = None, self_loops: bool = True) -> np.ndarray:
    """Symmetric (n, n) adjacency of a Watts–Strogatz small-world graph.

    A ring where each node links to its k nearest neighbours (k/2 on each side); each edge is
    then rewired to a random node with probability p.
    """
    if not (k % 2 == 0 and 2 <= k < n) or not 0.0 <= p <= 1.0:
        raise ValueError(f"watts_strogatz: expected even 2 <= k < n and 0 <= p <= 1, got n={n}, k={k}, p={p}")
    rng = _rng(seed)
    adj = np.zeros((n, n), dtype=bool)
    for j in range(1, k // 2 + 1):
        idx = np.arange(n)
        adj[idx, (idx + j) % n] = adj[(idx + j) % n, idx] = True
    for j in range(1, k // 2 + 1):
        for u in range(n):
            v = (u + j) % n
            if rng.random() < p and adj[u, v]:
                free = np.flatnonzero(~adj[u] & (np.arange(n) != u))
                if free.size:
                    w = free[rng.integers(free.size)]
                    adj[u, v] = adj[v, u] = False
                    adj[u, w] = adj[w, u] = True
    if self_loops:
        np.fill_diagonal(adj, True)
    return adj


def z_order_rank(c_idx: np.ndarray, k_idx: np.ndarray) -> np.ndarray:
    """Each block's position when blocks (c, k) are sorted in Morton (z-) order, the seed's
    default weight block order: bit i of c goes to bit 2i of the key, bit i of k to bit 2i+1."""
    c, k = np.asarray(c_idx, dtype=np.int64), np.asarray(k_idx, dtype=np.int64)
    key = np.zeros_like(c)
    for bit in range(int(max(c.max(initial=0), k.max(initial=0))).bit_length()):
        key |= ((c >> bit) & 1) << (2 * bit) | ((k >> bit) & 1) << (2 * bit + 1)
    rank = np.empty_like(key)
    rank[np.argsort(key, kind="stable")] = np.arange(key.size)
    return rank


# --- attention layouts ------------------------------------------------------------------------------
# An attention layout is (q_blocks, k_blocks), shared by all heads, or (heads, q_blocks, k_blocks):
# layout[h, i, j] says whether query block i of head h attends to key block j. Element-level
# patterns are mask functions ``mask(b, h, q_idx, k_idx) -> bool`` on broadcast index tensors: the
# same function serves as FlexAttention's ``mask_mod`` (``create_block_mask``, ``flex_attention``,
# where the indices are batched by vmap and the function is traced). The built-in ones use tensor
# operators only, so they also take numpy arrays. :func:`attention_layout` evaluates one at
# block granularity, keeps the blocks it touches, and returns the seed's ``mask_callback`` for
# the partial ones.

def causal_mask(b, h, q_idx, k_idx):
    """Each position attends to itself and the past."""
    return q_idx >= k_idx


def local_mask(window: int, causal: bool = True):
    """The last ``window`` positions, itself included (or ``window - 1`` on each side, non-causal)."""
    _positive("window", window)

    def mask(b, h, q_idx, k_idx):
        d = q_idx - k_idx
        return ((d >= 0) & (d < window)) if causal else ((d < window) & (d > -window))
    return mask


def strided_mask(stride: int):
    """Sparse Transformer "strided" attention (Child et al. 2019), causal: the previous ``stride``
    positions, and every ``stride``-th one before them (the union of the paper's two heads)."""
    _positive("stride", stride)

    def mask(b, h, q_idx, k_idx):
        d = q_idx - k_idx
        return (d >= 0) & ((d < stride) | (d % stride == 0))
    return mask


def fixed_mask(stride: int, summary: int = 1):
    """Sparse Transformer "fixed" attention (Child et al. 2019), causal: the positions of the same
    ``stride``-long segment, and the last ``summary`` positions of every segment."""
    _positive("stride", stride)
    if isinstance(summary, bool) or not isinstance(summary, int) or not 1 <= summary <= stride:
        raise ValueError(f"summary: expected an int in [1, stride={stride}], got {summary!r}")

    def mask(b, h, q_idx, k_idx):
        same = (q_idx // stride) == (k_idx // stride)
        return (q_idx >= k_idx) & (same | (k_idx % stride >= stride - summary))
    return mask


def longformer_mask(window: int, global_tokens, causal: bool = False):
    """Longformer-style: a sliding window of ``window`` positions each side, plus global positions
    (an int: the first n; or a sequence of indices) that attend to all and are attended by all.
    Each run of consecutive global positions costs the mask two comparisons."""
    local = local_mask(window, causal)
    runs = _runs(_global_set(global_tokens))

    def mask(b, h, q_idx, k_idx):
        g = _in_runs(q_idx, runs) | _in_runs(k_idx, runs)
        if causal:
            g = g & (q_idx >= k_idx)
        return local(b, h, q_idx, k_idx) | g
    return mask


def bigbird_mask(block_size: int, window_blocks: int, global_blocks: int, random_blocks: int,
                 q_blocks: int, k_blocks: int, seed: int | None = None, causal: bool = False):
    """BigBird-style at block granularity: ``window_blocks`` key blocks each side of the diagonal,
    the first ``global_blocks`` blocks global (rows and columns), and ``random_blocks`` random key
    blocks per query block row (drawn once, from ``seed``). ``causal`` keeps k <= q."""
    for name, v in (("block_size", block_size), ("q_blocks", q_blocks), ("k_blocks", k_blocks)):
        _positive(name, v)
    for name, v in (("window_blocks", window_blocks), ("global_blocks", global_blocks),
                    ("random_blocks", random_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    rng = _rng(seed)
    table = np.zeros((q_blocks, k_blocks), dtype=bool)
    for i in range(q_blocks):
        pool = np.arange(min(i + 1, k_blocks) if causal else k_blocks)
        table[i, rng.choice(pool, size=min(random_blocks, pool.size), replace=False)] = True
    lookup = _BlockTable(table)

    def mask(b, h, q_idx, k_idx):
        qb, kb = q_idx // block_size, k_idx // block_size
        near = (qb - kb <= window_blocks) & (kb - qb <= window_blocks)
        glob = (qb < global_blocks) | (kb < global_blocks)
        keep = near | glob | lookup(qb, kb)
        return keep & (q_idx >= k_idx) if causal else keep
    return mask


_CHUNK = 1 << 22         # mask elements evaluated at once by attention_layout


def attention_layout(mask, q_len: int, k_len: int, block_size: int, heads: int | None = None):
    """The block layout of an element-level ``mask(b, h, q_idx, k_idx)``, and its mask_callback.

    The mask is called as FlexAttention calls a ``mask_mod``, with int64 CPU tensors: b and h 0-d,
    q_idx (rows, 1) and k_idx (1, k_len); it returns a bool tensor broadcastable to (rows, k_len).
    A block is live when the mask keeps any of its elements. Returns ``(layout,
    mask_callback)``: layout is (q_len/bs, k_len/bs) bool, or (heads, ...) when ``heads`` is given
    (the mask is then evaluated per head); mask_callback has the seed's signature ``(blk_shape,
    head_idx, qry_idx, key_idx, blk_idx) -> (bs, bs) bool`` and is None when every live block is
    full. The mask must not depend on the batch index (it is evaluated at b = 0).
    """
    if not callable(mask):
        raise TypeError(f"mask: expected a function (b, h, q_idx, k_idx) -> bool, got {type(mask).__name__}")
    for name, v in (("q_len", q_len), ("k_len", k_len), ("block_size", block_size)):
        _positive(name, v)
    if q_len % block_size or k_len % block_size:
        raise ValueError(f"q_len, k_len: expected multiples of block_size={block_size}, got {q_len} and {k_len}")
    if heads is not None:
        _positive("heads", heads)
    nq, nk, bs = q_len // block_size, k_len // block_size, block_size
    layout = np.zeros((heads or 1, nq, nk), dtype=bool)
    partial: dict[tuple[int, int, int], np.ndarray] = {}
    rows = max(1, _CHUNK // (bs * k_len))                                  # query blocks per call
    with real_tensors(torch.device("cpu")), torch.no_grad():              # also under a meta default device
        b, k_idx = torch.zeros((), dtype=torch.int64), torch.arange(k_len)[None, :]
        for h in range(heads or 1):
            hh = torch.tensor(h)
            for i0 in range(0, nq, rows):
                n = min(rows, nq - i0)
                q_idx = torch.arange(i0 * bs, (i0 + n) * bs)[:, None]
                m = torch.as_tensor(mask(b, hh, q_idx, k_idx)).to(torch.bool).broadcast_to(n * bs, k_len)
                tiles = m.numpy().reshape(n, bs, nk, bs).transpose(0, 2, 1, 3)       # (n, nk, bs, bs)
                live, full = tiles.any(axis=(2, 3)), tiles.all(axis=(2, 3))
                layout[h, i0:i0 + n] = live
                for i, j in zip(*np.nonzero(live & ~full)):
                    partial[(h, i0 + int(i), int(j))] = tiles[i, j].copy()
    shared = heads is None

    def mask_callback(blk_shape, head_idx, qry_idx, key_idx, blk_idx):
        tile = partial.get((0 if shared else head_idx, qry_idx, key_idx))
        return np.ones(blk_shape, dtype=bool) if tile is None else tile.copy()
    return (layout[0] if heads is None else layout), (mask_callback if partial else None)


def layout_image(layout, scale: int = 1, gap: int = 2) -> np.ndarray:
    """A layout as a uint8 grey image (live = 255): (q_blocks*scale, k_blocks*scale), or the heads
    of a 3-D layout side by side with ``gap`` columns between them. For docs and TensorBoard
    (``add_image(..., dataformats="HW")``)."""
    lay = np.asarray(layout.cpu() if isinstance(layout, torch.Tensor) else layout).astype(bool)
    if lay.ndim not in (2, 3):
        raise ValueError(f"layout: expected a 2-D or 3-D array, got shape {lay.shape}")
    _positive("scale", scale)
    heads = lay[None] if lay.ndim == 2 else lay
    tiles = [np.kron(h, np.ones((scale, scale), dtype=bool)).astype(np.uint8) * 255 for h in heads]
    if len(tiles) == 1:
        return tiles[0]
    pad = np.full((tiles[0].shape[0], gap), 96, dtype=np.uint8)
    out = [tiles[0]]
    for t in tiles[1:]:
        out += [pad, t]
    return np.concatenate(out, axis=1)


def _positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")


def _global_set(tokens) -> np.ndarray:
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        if tokens < 0:
            raise ValueError(f"global_tokens: expected an int >= 0 or a sequence of positions, got {tokens}")
        return np.arange(tokens)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0)):
        raise ValueError(f"global_tokens: expected an int >= 0 or a sequence of positions, got {tokens!r}")
    return arr.astype(np.int64)


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct positions as [start, end) runs of consecutive ones."""
    v = np.unique(values)
    if not v.size:
        return []
    breaks = np.nonzero(np.diff(v) != 1)[0]
    starts = np.concatenate([v[:1], v[breaks + 1]])
    ends = np.concatenate([v[breaks], v[-1:]]) + 1
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def _in_runs(idx, runs: list[tuple[int, int]]):
    """``idx`` in any run, elementwise: comparisons with Python ints only, so the expression is
    the same for numpy arrays and torch tensors on any device, batched by vmap or traced."""
    out = idx < 0                                       # False for every position
    for start, end in runs:
        out = out | ((idx >= start) & (idx < end))
    return out


class _BlockTable:
    """``table[qb, kb]`` for tensors (or numpy arrays) of block indices; out of range: False.
    Tensors index a copy of the table on their device, made once per device."""

    def __init__(self, table: np.ndarray):
        self.table = table
        self.shape = table.shape
        self.on: dict = {}

    def __call__(self, qb, kb):
        nq, nk = self.shape
        ok = (qb >= 0) & (qb < nq) & (kb >= 0) & (kb < nk)
        if not isinstance(qb, torch.Tensor):
            qb, kb = np.broadcast_arrays(qb, kb)
            return self.table[np.clip(qb, 0, nq - 1), np.clip(kb, 0, nk - 1)] & ok
        flat = self.on.get(qb.device)
        if flat is None:
            flat = self.on[qb.device] = torch.as_tensor(self.table.ravel(), device=qb.device)
        return flat[qb.clamp(0, nq - 1) * nk + kb.clamp(0, nk - 1)] & ok
