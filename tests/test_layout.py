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


# --- attention layouts -------------------------------------------------------------------------------
def _dense_from(layout, callback, bs, heads=None):
    """The element mask a (layout, mask_callback) pair describes: (H, Q, K) bool."""
    lay = layout[None] if layout.ndim == 2 else layout
    out = np.zeros((lay.shape[0], lay.shape[1] * bs, lay.shape[2] * bs), dtype=bool)
    for h, i, j in zip(*np.nonzero(lay)):
        tile = np.ones((bs, bs), bool) if callback is None else callback((bs, bs), int(h), int(i), int(j), 0)
        out[h, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs] = tile
    return out


def _direct(mask, q_len, k_len, heads=1):
    q, k = np.arange(q_len)[:, None], np.arange(k_len)[None, :]
    return np.stack([np.broadcast_to(mask(0, h, q, k), (q_len, k_len)) for h in range(heads)])


MASKS = {
    "causal": lambda: L.causal_mask,
    "local": lambda: L.local_mask(24),
    "local_bidir": lambda: L.local_mask(20, causal=False),
    "strided": lambda: L.strided_mask(16),
    "fixed": lambda: L.fixed_mask(32, summary=4),
    "longformer": lambda: L.longformer_mask(8, [0, 37]),
    "bigbird": lambda: L.bigbird_mask(16, 1, 1, 2, q_blocks=8, k_blocks=8, seed=3),
    "bigbird_causal": lambda: L.bigbird_mask(16, 1, 1, 2, q_blocks=8, k_blocks=8, seed=3, causal=True),
}


@pytest.mark.parametrize("kind", sorted(MASKS))
@pytest.mark.parametrize("bs,q_len,k_len", [(16, 128, 128), (32, 64, 128), (8, 128, 64)])
def test_attention_layout_reproduces_the_element_mask(kind, bs, q_len, k_len):
    """Layout plus mask_callback give back exactly the element mask; no live block is empty and
    no element the mask keeps is dropped."""
    mask = MASKS[kind]()
    lay, cb = L.attention_layout(mask, q_len, k_len, bs)
    assert lay.shape == (q_len // bs, k_len // bs) and lay.dtype == bool
    want = _direct(mask, q_len, k_len)
    np.testing.assert_array_equal(_dense_from(lay, cb, bs), want)
    tiles = want[0].reshape(q_len // bs, bs, k_len // bs, bs).any(axis=(1, 3))
    np.testing.assert_array_equal(lay, tiles)


def test_child_et_al_patterns_on_a_small_example():
    q, k = np.array([[9]]), np.arange(12)[None, :]
    kept = lambda m: set(np.nonzero(m(0, 0, q, k)[0])[0].tolist())       # noqa: E731
    assert kept(L.strided_mask(4)) == {1, 5, 6, 7, 8, 9}
    assert kept(L.fixed_mask(4, summary=1)) == {3, 7, 8, 9}
    assert kept(L.local_mask(3)) == {7, 8, 9}
    assert kept(L.longformer_mask(2, 1)) == {0, 8, 9, 10}


def test_causal_layout_and_callback():
    lay, cb = L.attention_layout(L.causal_mask, 64, 64, 16)
    np.testing.assert_array_equal(lay, np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(cb((16, 16), 0, 2, 2, 0), np.tril(np.ones((16, 16), bool)))
    assert cb((16, 16), 0, 3, 1, 0).all()
    lay, cb = L.attention_layout(L.local_mask(32), 128, 128, 32)   # block-aligned window
    assert cb is not None                                                     # the diagonal stays partial


def test_per_head_masks_and_torch_indices():
    def mask(b, h, q, k):                         # head h looks back 8 * (h + 1) positions
        d = q - k
        return (d >= 0) & (d < 8 * (h + 1))
    lay, cb = L.attention_layout(mask, 64, 64, 8, heads=3)
    assert lay.shape == (3, 8, 8) and (lay.sum(axis=(1, 2)) == [15, 21, 26]).all()   # unequal block counts
    np.testing.assert_array_equal(_dense_from(lay, cb, 8), _direct(mask, 64, 64, heads=3))
    q, k = torch.arange(64)[:, None], torch.arange(64)[None, :]
    for kind in sorted(MASKS):
        m = MASKS[kind]()
        np.testing.assert_array_equal(m(0, 0, q, k).numpy(), _direct(m, 64, 64)[0], err_msg=kind)


def test_bigbird_random_blocks_and_causality():
    m = L.bigbird_mask(16, 0, 0, 3, q_blocks=6, k_blocks=6, seed=1)
    lay, _ = L.attention_layout(m, 96, 96, 16)
    assert (lay.sum(1) >= 3).all() and not lay.all()
    mc = L.bigbird_mask(16, 0, 0, 3, q_blocks=6, k_blocks=6, seed=1, causal=True)
    lay, _ = L.attention_layout(mc, 96, 96, 16)
    assert not np.triu(lay, 1).any()
    again, _ = L.attention_layout(L.bigbird_mask(16, 0, 0, 3, 6, 6, seed=1, causal=True), 96, 96, 16)
    np.testing.assert_array_equal(lay, again)                               # the seed fixes the draw


def test_layout_image():
    img = L.layout_image(np.eye(3, dtype=bool), scale=2)
    assert img.shape == (6, 6) and img.dtype == np.uint8 and img[0, 0] == 255 and img[0, 2] == 0
    img = L.layout_image(np.ones((2, 3, 4), bool), scale=1, gap=2)
    assert img.shape == (3, 4 + 2 + 4) and (img[:, 4:6] == 96).all()


@pytest.mark.parametrize("call,match", [
    (lambda: L.attention_layout(L.causal_mask, 60, 64, 16), "multiples of block_size"),
    (lambda: L.attention_layout("causal", 64, 64, 16), "mask: expected a function"),
    (lambda: L.local_mask(0), "window: expected a positive int"),
    (lambda: L.fixed_mask(8, summary=9), "summary: expected an int in"),
    (lambda: L.longformer_mask(4, [-1]), "global_tokens"),
    (lambda: L.bigbird_mask(16, -1, 0, 0, 4, 4), "window_blocks: expected an int >= 0"),
    (lambda: L.layout_image(np.ones(3)), "expected a 2-D or 3-D"),
])
def test_attention_layout_errors(call, match):
    with pytest.raises(ValueError if "function" not in match else TypeError, match=match):
        call()


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_flex_attention_block_mask_agrees(kind):
    """The same mask function given to FlexAttention's create_block_mask gives the same blocks."""
    import warnings
    from torch.nn.attention.flex_attention import create_block_mask
    mask = MASKS[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # e.g. a missing vmap batching rule
        bm = create_block_mask(mask, B=None, H=None, Q_LEN=128, KV_LEN=128, BLOCK_SIZE=16, device="cpu")
    lay, _ = L.attention_layout(mask, 128, 128, 16)
    np.testing.assert_array_equal(bm.to_dense()[0, 0].numpy().astype(bool), lay)


def test_attention_layout_calls_the_mask_on_torch_tensors():
    """A mask written with torch functions (a FlexAttention mask_mod) works as it is, also under a
    meta default device; the built-in masks take numpy arrays too (test_per_head_masks...)."""
    def mask(b, h, q_idx, k_idx):                    # window 8 for head 0, 16 for the others
        return torch.abs(q_idx - k_idx) < torch.where(h == 0, 8, 16)
    with torch.device("meta"):
        lay, cb = L.attention_layout(mask, 64, 64, 16, heads=2)
    q, k = np.arange(64)[:, None], np.arange(64)[None, :]
    want = np.stack([np.abs(q - k) < w for w in (8, 16)])
    np.testing.assert_array_equal(_dense_from(lay, cb, 16), want)


def test_every_mask_runs_in_flex_attention():
    """flex_attention (which traces the mask_mod with dynamo even when not compiled) with each
    built-in mask agrees with BlocksparseTransformer on the same mask (longformer's global
    positions once failed there: numpy's max(initial=...) inside the mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from bstrain.ops.transformer import BlocksparseTransformer
    q = torch.randn(1, 2, 64, 16, dtype=torch.float64)
    x = q.transpose(1, 2).reshape(1, 64, 32)
    for kind in ("longformer", "bigbird_causal", "fixed"):
        mask = MASKS[kind]()
        bm = create_block_mask(mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
        lay, cb = L.attention_layout(mask, 64, 64, 16)
        op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb)
        want = op.attention(x, x, x, scale=0.25).view(1, 64, 2, 16).transpose(1, 2)
        torch.testing.assert_close(flex_attention(q, q, q, block_mask=bm, scale=0.25), want, msg=kind)
