"""Capture safety of every op family: forward and backward captured by bstrain.graphed, replayed on
fresh inputs, equal the eager call (no host sync, no allocation outside the graph's pool, plans
warmed before the capture)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import bstrain
import bstrain.ops as bs
from bstrain import layout as layouts
from bstrain.nn import BlockSparseAttention, BlockSparseConv2d, BlockSparseLinear

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _fwd_bwd(fn, params=()):
    """step(*inputs) -> (output, d inputs..., d params...) through autograd.grad (no .grad fields)."""
    def step(*inputs):
        out = fn(*inputs)
        leaves = [t for t in (*inputs, *params) if t.requires_grad]
        grads = torch.autograd.grad(out.float().square().sum() if out.dtype.is_floating_point else out, leaves)
        return (out, *grads)
    return step


def _check(step, make, rtol=2e-3, atol=2e-3):
    graphed = bstrain.graphed(step, *make())
    for _ in range(2):                               # fresh inputs at every replay
        inputs = make()
        got = [t.clone() for t in graphed(*inputs)]
        want = step(*inputs)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"output {i}: {m}")


def _x(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("block,dtype", [(32, torch.bfloat16), (64, torch.float16), (16, torch.float32)])
def test_block_sparse_linear(block, dtype):
    layer = BlockSparseLinear(256, 192, block_size=block, density=0.4, seed=0, device=DEV, dtype=dtype)
    _check(_fwd_bwd(layer, list(layer.parameters())), lambda: (_x(40, 256, dtype=dtype),), rtol=2e-2, atol=2e-2)


def test_blocksparse_matmul_feature_axis_0():
    op = bs.BlocksparseMatMul(layouts.random((4, 3), 0.5, seed=1), 32, feature_axis=0)
    w = torch.randn(op.w_shape, device=DEV, dtype=torch.float16, requires_grad=True)
    _check(_fwd_bwd(lambda x: op(x, w), [w]), lambda: (_x(128, 24, dtype=torch.float16),), rtol=2e-2, atol=2e-2)


def test_grad_group_of_timesteps():
    """Grouped dW (the LSTM's): several calls of one weight, one dW launch per group."""
    layer = BlockSparseLinear(128, 128, block_size=32, density=0.5, seed=2, device=DEV, dtype=torch.float16)

    def fn(x):
        with layer.grad_group(4):
            h = x
            for _ in range(4):
                h = torch.tanh(layer(h))
        return h
    _check(_fwd_bwd(fn, [layer.weight]), lambda: (_x(16, 128, dtype=torch.float16),), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pad", [False, True])
def test_attention(pad):
    lay = np.tril(np.ones((4, 4), dtype=bool))
    attn = BlockSparseAttention(lay, block_size=64, heads=2).to(DEV)
    mask = torch.zeros(2, 256, dtype=torch.bool, device=DEV)
    mask[1, 200:] = pad

    def fn(q, k, v):
        return attn(q, k, v, key_padding_mask=mask if pad else None)
    _check(_fwd_bwd(fn), lambda: tuple(_x(2, 256, 128, dtype=torch.bfloat16) for _ in range(3)), rtol=2e-2, atol=2e-2)


def test_conv2d():
    conv = BlockSparseConv2d(64, 64, 3, padding=1, block_size=32, density=0.5, seed=0).to(DEV)
    x = lambda: (_x(4, 64, 8, 8).to(memory_format=torch.channels_last).detach().requires_grad_(),)  # noqa: E731

    def fn(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return conv(x)
    _check(_fwd_bwd(fn, list(conv.parameters())), x, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("segments,relu", [(1, False), (4, True)])
def test_layer_norm(segments, relu):
    g, b = _x(256), _x(256)
    _check(_fwd_bwd(lambda x: bs.layer_norm(x, g, b, segments=segments, relu=relu), [g, b]),
           lambda: (_x(64, 256, dtype=torch.bfloat16),), rtol=2e-2, atol=2e-2)


def test_fused_lstm_gates():
    bias = _x(4 * 128)

    def fn(c, gates):
        c2, h = bs.fused_lstm_gates(c, gates, bias=bias)
        return torch.cat([c2, h], 1)
    _check(_fwd_bwd(fn, [bias]), lambda: (_x(32, 128), _x(32, 4 * 128)))


def test_embedding_and_cross_entropy():
    emb = _x(256, 32)
    head = _x(32, 256)

    def fn(idx, labels):
        h = bs.embedding_lookup(emb, idx)
        return bs.softmax_cross_entropy(h @ head, labels).mean()
    make = lambda: (torch.randint(0, 256, (64,), device=DEV), torch.randint(0, 256, (64,), device=DEV))  # noqa: E731
    _check(_fwd_bwd(fn, [emb, head]), make)


def test_transformer_glue():
    """Residual add (with a bias) + layer norm, rotary on a qkv projection (with its bias), bias +
    GELU, and the fused cross-entropy."""
    from bstrain.ops.bias_act import bias_gelu
    from bstrain.ops.cross_entropy import cross_entropy
    from bstrain.ops.residual_norm import add_layer_norm
    from bstrain.ops.rotary import apply_rotary, rotary_tables
    w = (1 + 0.1 * torch.randn(96, device=DEV)).requires_grad_()
    b, c, qb, head = _x(96), _x(96), _x(96), _x(96, 256, dtype=torch.bfloat16)
    cos, sin = rotary_tables(64, 32, DEV)

    def fn(x, r, labels):
        y, h = add_layer_norm(x, r, w, b, residual_bias=c)
        y = apply_rotary(y.view(2, 64, 96), cos, sin, 32, rotated=2, bias=qb).view(128, 96)
        return cross_entropy(bias_gelu(y, b) @ head, labels).mean() + h.float().square().mean()
    make = lambda: (_x(128, 96, dtype=torch.bfloat16), _x(128, 96, dtype=torch.bfloat16),  # noqa: E731
                    torch.randint(0, 256, (128,), device=DEV))
    _check(_fwd_bwd(fn, [w, b, c, qb, head]), make, rtol=2e-2, atol=2e-2)


def test_elementwise_ops():
    b = _x(64)

    def fn(x):
        y = bs.bias_relu(x, b, fast_gelu=True)
        y = bs.filter_tensor(bs.float_cast(y, torch.float16), scale=0.5, zero_infs=True)
        return bs.add_n([y, y, bs.gelu(y)])
    _check(_fwd_bwd(fn, [b]), lambda: (_x(16, 64),), rtol=1e-2, atol=1e-2)


def test_dropout_draws_a_new_mask_at_every_replay():
    x = torch.ones(256, 256, device=DEV)
    graphed = bstrain.graphed(lambda x: bs.dropout(x, 0.75)[0], x)
    first, second = graphed(x).clone(), graphed(x).clone()
    assert not torch.equal(first, second), "the graph replays its RNG offsets, not one fixed mask"
    for y in (first, second):
        kept = (y != 0).float().mean().item()
        assert abs(kept - 0.75) < 0.02 and torch.allclose(y[y != 0], torch.tensor(1 / 0.75, device=DEV))
