"""The flash-style block-sparse attention kernels against float64 dense attention.

On CPU they run in Triton's interpreter (fp32, fp16); on the GPU compiled, bf16 too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain import layout as L
from bstrain.ops.transformer import BlocksparseTransformer
from tests.conftest import DTYPE_IDS, fresh_seed, kernel_device, kernel_dtypes
from tests.ops.test_transformer import checked, qkv, random_layout


def _on(dev, *ts):
    return tuple(t.detach().to(dev).requires_grad_() for t in ts)


def run(op, B, D, dtype, pad=None):
    dev = kernel_device()
    q, k, v = _on(dev, *qkv(B, op.q_ctx, op.k_ctx, op.heads, D, dtype))
    return checked(op, q, k, v, dtype, pad=None if pad is None else pad.to(dev))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("bs,D", [(16, 32), (32, 48), (16, 64)])
def test_per_head_layouts_empty_rows_and_columns(dtype, bs, D):
    lay = random_layout(2, 3, 4, fresh_seed())
    lay[1, :, 3] = False                                     # a key block no query of head 1 uses
    op = BlocksparseTransformer(lay, block_size=bs, backend="triton")
    out = run(op, 2, D, dtype)
    assert (out[:, -bs:, :D] == 0).all()


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
def test_causal_partial_blocks_and_padding(dtype):
    lay, cb = L.attention_layout(L.causal_mask, 64, 64, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=2, mask_callback=cb, backend="triton")
    pad = torch.zeros(2, 64, dtype=torch.bool)
    pad[0, 40:] = True
    pad[1, 5:] = True
    run(op, 2, 32, dtype, pad=pad)


def test_strided_layout_matches_the_torch_path():
    lay, cb = L.attention_layout(L.strided_mask(32), 96, 64, 16, heads=2)
    ops = [BlocksparseTransformer(lay, block_size=16, mask_callback=cb, backend=b) for b in ("torch", "triton")]
    dev = kernel_device()
    q, k, v = (t.to(dev) for t in qkv(1, 96, 64, 2, 32, torch.float32, grad=False))
    torch.testing.assert_close(ops[1].attention(q, k, v), ops[0].attention(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,D", [(64, 64), (128, 128), (32, 96)])
def test_gpu_sizes_bf16(bs, D):
    lay, cb = L.attention_layout(L.fixed_mask(2 * bs, summary=8), 8 * bs, 8 * bs, bs, heads=2)
    op = BlocksparseTransformer(lay, block_size=bs, mask_callback=cb, backend="triton")
    run(op, 2, D, torch.bfloat16)


def test_triton_backend_input_errors():
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, backend="triton")
    q = torch.zeros(1, 32, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="the Triton backend takes float16, bfloat16 or float32"):
        op.attention(q, q, q)
    big = torch.zeros(1, 32, 256)
    with pytest.raises(ValueError, match="head dims up to 128"):
        op.attention(big, big, big)
    with pytest.raises(ValueError, match="backend: expected"):
        BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_head_with_no_live_block(backend):
    lay = random_layout(2, 2, 3, fresh_seed())
    lay[1] = False
    op = BlocksparseTransformer(lay, block_size=16, backend=backend)
    out = run(op, 1, 16, torch.float32)
    assert (out[..., 16:] == 0).all()
