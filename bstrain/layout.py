"""Block layouts: 2-D 0/1 arrays of shape (C/bs, K/bs) that say which weight blocks are live.

A layout entry ``layout[c, k] == 1`` means the bs x bs block that maps input features
``c*bs:(c+1)*bs`` to output features ``k*bs:(k+1)*bs`` is stored and used. Live blocks are
numbered in row-major (c-major) order; that is the order of the weight tensor's first axis.

Builders return ``np.ndarray`` of dtype bool. Every op accepts numpy arrays, torch tensors or
nested lists and validates them with :func:`as_layout`.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "as_layout", "validate", "from_array", "dense", "random", "balanced", "block_diagonal",
    "barabasi_albert", "watts_strogatz", "density", "z_order_rank",
]


def _rng(seed: int | None) -> np.random.Generator:
    """numpy generator for a builder: from ``seed``, or, when None, seeded from torch's global
    RNG, so that ``torch.manual_seed`` reproduces every layout drawn without a seed."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
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
    out = arr.astype(bool)
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
