"""Seed code runs: the seed's argument names and the arguments that mean nothing here (name=,
bench=, z_order, use_tf) are accepted; seed defaults (l2_normalize's epsilon), seed block sizes
(attention blocks of 8) and the seed's mask_callback numbering; mixed-precision parameters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import bstrain.ops as bs
from bstrain.ops.conv import BlocksparseConv, cwise_linear
from bstrain.ops.transformer import BlocksparseTransformer
from tests.conftest import fresh_seed


def test_name_is_accepted_everywhere():
    x, y = torch.rand(3, 4) + 0.5, torch.rand(3, 4) + 0.5
    for fn in (bs.add, bs.multiply, bs.subtract, bs.divide, bs.maximum, bs.minimum):
        torch.testing.assert_close(fn(x, y, name="op"), fn(x, y))
    for fn in (bs.negative, bs.reciprocal, bs.square, bs.sqrt, bs.exp, bs.log, bs.sigmoid, bs.tanh, bs.relu,
               bs.elu, bs.gelu, bs.swish, bs.fast_gelu):
        torch.testing.assert_close(fn(x, name="op"), fn(x))
    torch.testing.assert_close(bs.add_n8([x, y], name="s"), x + y)
    torch.testing.assert_close(bs.add_n([x, y, x], name="s"), 2 * x + y)
    assert bs.float_cast(x, torch.float16, name="c").dtype == torch.float16
    gates = torch.randn(3, 16)
    c = torch.randn(3, 4)
    for got, want in zip(bs.fused_lstm_gates(c, gates, name="g"), bs.fused_lstm_gates(c, gates)):
        torch.testing.assert_close(got, want)
    op = bs.BlocksparseMatMul(np.eye(2, dtype=bool), block_size=8, feature_axis=0, name="test")
    w = torch.randn(op.w_shape)
    xi = torch.randn(op.i_shape(5))
    torch.testing.assert_close(op(xi, w, name="y", bench=10), op(xi, w))
    assert bs.SparseProj(64, nproj=32, name="p", seed=1).nproj == 32
    BlocksparseTransformer(np.ones((2, 2), bool), 16, heads=1, name="attn")


def test_blocksparse_matmul_seed_positions():
    lay = np.eye(2, dtype=bool)
    assert bs.BlocksparseMatMul(lay, 8, 0, False).feature_axis == 0        # (layout, block_size, feature_axis, z_order)
    with pytest.warns(DeprecationWarning, match="backend= by keyword"):
        assert bs.BlocksparseMatMul(lay, 8, 1, "torch").backend == "torch"
    with pytest.raises(TypeError, match="z_order: expected a bool"):
        bs.BlocksparseMatMul(lay, 8, 1, 3)
    op = bs.BlocksparseMatMul(lay, 8)
    assert op.block_coord(block=1) == (1, 1)
    with pytest.raises(NotImplementedError, match="gate"):
        op(torch.randn(4, 16), torch.randn(op.w_shape), gate=torch.ones(2))


def test_cwise_linear_takes_the_seeds_names():
    x = torch.randn(2, 3, 4, 4)
    g, b = torch.randn(1, 3, 1, 1), torch.randn(1, 3, 1, 1)
    torch.testing.assert_close(cwise_linear(x, gain=g, bias=b, relu=True, use_tf=True), torch.relu(g * x + b))
    torch.testing.assert_close(cwise_linear(x, bias=b, gain=g, bias_first=True), (x + b) * g)


def test_fp32_bias_and_gain_with_16_bit_activations():
    """The seed's bias add and gain multiply take an fp32 (1, K) parameter with fp16 x: computed in
    fp32, returned in x's dtype; other mixed dtypes are still refused."""
    x = torch.randn(8, 16).half()
    b = torch.randn(1, 16)
    for fn, ref in ((bs.add, torch.add), (bs.multiply, torch.mul)):
        got = fn(x, b)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, ref(x.float(), b).half())
    with pytest.raises(TypeError, match="y: expected dtype torch.float16"):
        bs.add(x, torch.randn(8, 16))
    with pytest.raises(TypeError, match="y: expected dtype torch.float16"):
        bs.subtract(x, b)


def test_fp16_division_gradients_are_rounded_once():
    torch.manual_seed(0)
    x = (torch.rand(64, 64) + 0.5).half().requires_grad_()
    y = (torch.rand(64, 64) + 0.5).half().requires_grad_()
    g = torch.randn(64, 64).half()
    dx, dy = torch.autograd.grad(bs.divide(x, y), (x, y), g)
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    rx, ry = torch.autograd.grad(xd / yd, (xd, yd), g.double())
    for got, want in ((dx, rx), (dy, ry)):
        assert ((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max() < 2e-3      # one fp16 rounding
    (dr,) = torch.autograd.grad(bs.reciprocal(x), (x,), g)
    (rr,) = torch.autograd.grad(1 / xd, (xd,), g.double())
    assert ((dr.double() - rr).abs() / rr.abs().clamp_min(1e-3)).max() < 2e-3


def _dense_ref(q, k, v, mask, scale):
    B, T, HD = q.shape
    H = mask.shape[0]
    D = HD // H
    qh, kh, vh = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    s = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(1, 2).reshape(B, T, HD)


@pytest.mark.parametrize("shared", [True, False], ids=["2d-layout", "3d-layout"])
def test_attention_blocks_of_8_and_the_seeds_callback_numbering(shared):
    """Blocks of 8 (the seed's smallest); mask_callback is asked per head with blk_idx from 0 in
    each head, and once (as head 0) for a layout shared by the heads."""
    rng = np.random.default_rng(fresh_seed())
    bsz, nb, H = 8, 4, 2
    lay = np.tril(np.ones((nb, nb), bool))
    layout = lay if shared else np.stack([lay, lay & (rng.random((nb, nb)) < 0.7) | np.eye(nb, dtype=bool)])
    calls = []
    blk_masks = {}

    def cb(blk_shape, head_idx, qry_idx, key_idx, blk_idx):
        calls.append((head_idx, blk_idx))
        m = np.tril(np.ones(blk_shape, bool)) if qry_idx == key_idx else rng.random(blk_shape) < 0.8
        m[:, 0] = True                                      # no query without a key
        blk_masks[(head_idx, qry_idx, key_idx)] = m
        return m
    op = BlocksparseTransformer(layout, bsz, heads=H if shared else None, mask_callback=cb, name="t")
    per_head = [int(lay.sum())] if shared else [int(h.sum()) for h in layout]
    assert calls == [(h, b) for h, n in enumerate(per_head) for b in range(n)]
    full = np.broadcast_to(layout, (H, nb, nb))
    mask = torch.zeros(H, nb * bsz, nb * bsz, dtype=torch.bool)
    for h in range(H):
        for i, j in zip(*np.nonzero(full[h])):
            m = blk_masks[(0 if shared else h, i, j)]
            mask[h, i * bsz:(i + 1) * bsz, j * bsz:(j + 1) * bsz] = torch.as_tensor(m)
    q, k, v = (torch.randn(2, nb * bsz, H * 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = _dense_ref(q, k, v, mask, 0.5)
    torch.testing.assert_close(op.attention(q, k, v, scale=0.5), want)
    w = op.query_key_op(q, k, bench=1)
    p = op.masked_softmax(w, scale=0.5, dtype=torch.float32)
    assert p.dtype == torch.float32
    torch.testing.assert_close(op.weight_value_op(p.double(), v, name="wv"), want, rtol=1e-5, atol=1e-5)
    unmasked = op.softmax(w, scale=0.5)
    block_mask = torch.as_tensor(np.kron(full, np.ones((bsz, bsz), bool)))
    torch.testing.assert_close(op.weight_value_op(unmasked, v), _dense_ref(q, k, v, block_mask, 0.5))
    with pytest.raises(ValueError, match="the Triton backend takes blocks of"):
        BlocksparseTransformer(lay, 8, heads=1, backend="triton").attention(
            *(torch.randn(1, nb * bsz, 4) for _ in range(3)))
    with pytest.raises(TypeError, match="dtype: expected a floating"):
        op.masked_softmax(w, dtype=torch.int32)


def test_conv_l2_normalize_seed_defaults():
    """epsilon 1e-12 (a tiny filter still comes out at unit norm), dtype=, F's own form back, and
    float64 kept."""
    op = BlocksparseConv([([0, 1], [0, 1]), ([1], [2])], (3,), (5,))
    flat = torch.randn(op.sizeF, dtype=torch.float64) * 1e-5
    out = op.l2_normalize(flat, dtype=np.float32)
    assert out.shape == flat.shape and out.dtype == torch.float32
    full = op.l2_normalize(flat)
    assert full.dtype == torch.float64
    for f in op._filters(full):
        torch.testing.assert_close(f.square().sum((1, 2)), torch.ones(f.shape[0], dtype=torch.float64))
    assert isinstance(op.l2_normalize(list(op._filters(flat))), list)
    with pytest.raises(ValueError, match="BlocksparseDeconv"):
        BlocksparseConv([([0], [0])], (3,), (5,), deconv=True)
    with pytest.raises(TypeError, match="dtype: expected a floating"):
        op.l2_normalize(flat, dtype=np.int32)


def test_batch_norm_inference_seed_names():
    x = torch.randn(2, 3, 4, 4)
    g, b, m, v = torch.rand(3) + 0.5, torch.randn(3), torch.randn(3), torch.rand(3) + 0.5
    want = torch.nn.functional.batch_norm(x, m, v, g, b, training=False, eps=1e-6)
    torch.testing.assert_close(bs.batch_norm_inference(x, g, b, m=m, v=v), want)
    with pytest.warns(DeprecationWarning, match="m= and v="):
        torch.testing.assert_close(bs.batch_norm_inference(x, g, b, mean=m, var=v), want)
    with pytest.raises(TypeError, match="expected the statistics"):
        bs.batch_norm_inference(x, g, b)


def test_sparse_proj_follows_torch_manual_seed():
    torch.manual_seed(3)
    a = bs.SparseProj(256, nproj=64).gather_lut
    torch.manual_seed(3)
    b = bs.SparseProj(256, nproj=64).gather_lut
    assert torch.equal(a, b)


@pytest.mark.parametrize("axis", [0, 1])
def test_blocksparse_matmul_seed_references(axis):
    """The seed's attributes and float64 numpy references (fprop/bprop/updat/l2_normalize _test),
    which its tests read, agree with the op and its gradients."""
    from bstrain.layout import random
    op = bs.BlocksparseMatMul(random((3, 4), 0.5, seed=fresh_seed()), 8, axis)
    assert (op.CB, op.KB, op.bsize, op.axis) == (3, 4, 8, axis)
    assert op.sparsity == round(op.blocks / 12, 3) and op.flops == op.blocks * 128
    assert op.updat_list == [op.block_coord(i) for i in range(op.blocks)]
    assert sorted(w for _, lut in op.fprop_list for _, w in lut) == list(range(op.blocks))
    x = torch.randn(op.i_shape(5), dtype=torch.float64, requires_grad=True)
    w = torch.randn(op.w_shape, dtype=torch.float64, requires_grad=True)
    y = op(x, w)
    e = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), e)
    np.testing.assert_allclose(op.fprop_test(x, w), y.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(op.bprop_test(e, w), dx.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(op.updat_test(x, e), dw.numpy(), rtol=1e-10, atol=1e-10)
    wn = op.l2_normalize(w)
    np.testing.assert_allclose(op.l2_normalize_test(w), wn.detach().numpy(), rtol=1e-10, atol=1e-10)
    u = torch.randn_like(wn)
    (g,) = torch.autograd.grad(wn, w, u)
    np.testing.assert_allclose(op.l2_normalize_grad_test(w, u), g.numpy(), rtol=1e-8, atol=1e-10)


def test_mixed_precision_params_broadcast_into_x():
    """A batch of one (or zero) rows takes an fp32 bias like a bigger one; y that does not
    broadcast into x's shape is not a parameter."""
    for rows in (1, 0, 3):
        x = torch.randn(rows, 8).half()
        b = torch.randn(8)
        torch.testing.assert_close(bs.add(x, b), (x.float() + b).half())
    with pytest.raises(TypeError, match="y: expected dtype torch.float16"):
        bs.add(torch.randn(4, 1).half(), torch.randn(1, 3))


def test_softmax_dtype_is_rounded_once():
    """fp16 scores, dtype=float32: the probabilities are the fp32 ones, not fp16 ones cast up."""
    op = BlocksparseTransformer(np.tril(np.ones((2, 2), bool)), 16, heads=1)
    q, k = (torch.randn(2, 32, 8) for _ in range(2))
    w = op.query_key_op(q, k).half()
    want = op.masked_softmax(w.float(), scale=0.3)
    torch.testing.assert_close(op.masked_softmax(w, scale=0.3, dtype=torch.float32), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(op.softmax(w, scale=0.3, dtype=torch.float32), want, rtol=1e-6, atol=1e-6)


def test_positional_backend_of_the_attention_op_still_works():
    with pytest.warns(DeprecationWarning, match="backend= by keyword"):
        op = BlocksparseTransformer(np.ones((2, 2), bool), 16, 1, None, "torch")
    assert op.backend == "torch" and op.name is None


def test_sparse_proj_builds_under_a_meta_default_device():
    with torch.device("meta"):
        assert bs.SparseProj(64, nproj=32).nproj == 32
