"""Layout builders and validation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain import layout as L


def test_random_density_and_seed():
    a = L.random((64, 64), 0.2, seed=1)
    assert a.dtype == bool and a.shape == (64, 64)
    assert abs(a.mean() - 0.2) < 0.03
    assert (a == L.random((64, 64), 0.2, seed=1)).all()
    assert L.random((4, 4), 1e-9, seed=0).sum() == 1, "a random layout always keeps one block"


@pytest.mark.parametrize("build", [
    lambda: L.random((16, 16), 0.3), lambda: L.balanced((16, 24), 0.3),
    lambda: L.barabasi_albert(30, 2), lambda: L.watts_strogatz(30, 4, 0.3)], ids=["random", "balanced", "ba", "ws"])
def test_unseeded_builders_follow_torch_manual_seed(build):
    torch.manual_seed(11)
    a = build()
    torch.manual_seed(11)
    assert (build() == a).all()


@pytest.mark.parametrize("shape, density", [((16, 16), 0.25), ((10, 7), 0.3), ((7, 40), 0.2), ((40, 3), 0.5),
                                            ((5, 5), 1.0), ((3, 50), 0.1)])
def test_balanced_is_exact_and_even(shape, density):
    lay = L.balanced(shape, density)
    n = round(density * shape[0] * shape[1])
    assert lay.sum() == n
    for sums, parts in ((lay.sum(0), shape[1]), (lay.sum(1), shape[0])):
        assert set(np.unique(sums)) <= {n // parts, -(-n // parts)}, "each column and row gets floor or ceil"
    assert (L.balanced(shape, density, seed=3) == L.balanced(shape, density, seed=3)).all()


def test_balanced_draws_differ_and_cover_all_positions():
    hits = sum(L.balanced((8, 8), 0.25, seed=s).astype(int) for s in range(200))
    assert (hits > 0).all() and hits.std() < 0.3 * hits.mean(), "no position is favoured"


def test_z_order_rank_is_morton_order():
    c, k = np.array([0, 0, 1, 1, 2, 3]), np.array([0, 1, 0, 1, 0, 3])
    # Morton keys (bit i of c at 2i, of k at 2i+1): 0, 2, 1, 3, 4, 15
    assert L.z_order_rank(c, k).tolist() == [0, 2, 1, 3, 4, 5]


def test_dense_and_block_diagonal():
    assert L.dense((3, 5)).all()
    bd = L.block_diagonal(6, group=2)
    assert bd.sum() == 12 and bd[0, 1] and not bd[0, 2]


def test_barabasi_albert_has_hubs():
    a = L.barabasi_albert(200, 3, seed=0)
    assert (a == a.T).all() and a.diagonal().all()
    deg = a.sum(1) - 1
    assert deg.min() >= 3
    assert deg.max() > 4 * np.median(deg), "preferential attachment grows hubs"
    assert not L.barabasi_albert(20, 2, seed=0, self_loops=False).diagonal().any()


def test_watts_strogatz_ring_and_rewiring():
    ring = L.watts_strogatz(50, 4, 0.0, seed=0)
    assert (ring.sum(1) == 5).all() and (ring == ring.T).all()
    rewired = L.watts_strogatz(50, 4, 0.5, seed=0)
    assert rewired.sum() == ring.sum(), "rewiring keeps the edge count"
    assert (rewired != ring).any()


@pytest.mark.parametrize("src", [np.eye(3), torch.eye(3), np.eye(3).tolist(), np.eye(3, dtype=np.int8)])
def test_as_layout_accepts_array_likes(src):
    assert (L.from_array(src) == np.eye(3, dtype=bool)).all()


@pytest.mark.parametrize("bad, exc, match", [
    (np.ones(3), ValueError, "2-D"),
    (np.full((2, 2), 0.5), ValueError, "0/1"),
    (np.zeros((2, 3)), ValueError, "at least one live block"),
    ([[1, 0], [1]], TypeError, "layout"),
])
def test_as_layout_rejects(bad, exc, match):
    with pytest.raises(exc, match=match):
        L.as_layout(bad)


def test_validate_shape_against_features():
    lay = np.ones((2, 3))
    assert L.validate(lay, 64, 96, 32).shape == (2, 3)
    with pytest.raises(ValueError, match="in_features=96"):
        L.validate(lay, 96, 96, 32)
    with pytest.raises(ValueError, match="out_features=64"):
        L.validate(lay, 64, 64, 32)


@pytest.mark.parametrize("call, match", [
    (lambda: L.random((2, 2), 0.0), "density"),
    (lambda: L.balanced((2, 2), 1.5), "density"),
    (lambda: L.barabasi_albert(5, 5), "m < n"),
    (lambda: L.watts_strogatz(10, 3, 0.1), "even"),
    (lambda: L.block_diagonal(0), "n >= 1"),
])
def test_builders_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
