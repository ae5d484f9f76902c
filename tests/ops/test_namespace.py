"""``import bstrain.ops as bs`` against the seed's flat namespace (blocksparse/__init__.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import bstrain.ops as bs

# Every name the seed's blocksparse/__init__.py exports.
SEED_NAMES = """
entropy_size get_entropy set_entropy reset_scalar_constants scalar_constant ceil_div reduce_mul bst_conv_layout
bst_deconv_layout dw_matmul_large_n ConvEdgeBias conv_edge_bias_init deconv_edge_bias_init cwise_linear
embedding_lookup add multiply subtract divide maximum minimum negative reciprocal square sqrt exp log sigmoid tanh
relu elu gelu swish fast_gelu filter_tensor filter_tensor_op scale_tensor float_cast dropout concrete_gate
concrete_gate_infer add_n8 add_n replace_add_n restore_add_n bias_relu fancy_gather reduce_max assign_add gradients
recomputable fused_lstm_gates split4 concat4 sparse_relu FusedBasicLSTMCell grouped_lstm group_lstm_grads
BlocksparseMatMul SparseProj block_reduced_full_dw group_param_grads get_bsmm_dx_ops layer_norm batch_norm Ema
AdamOptimizer AdafactorOptimizer blocksparse_l2_decay blocksparse_norm blocksparse_prune clip_by_global_norm
global_norm adafactor2d_op adafactor1d_op adam_op blocksparse_adam_op QuantizeSpec quantize log_stats
BlocksparseTransformer softmax masked_softmax softmax_cross_entropy transpose_2d transpose_0213 top_k
rectified_top_k clear_bst_constants
""".split()

# Seed names bstrain does not provide; docs/seed.md says what to use instead.
NOT_PROVIDED = """
entropy_size get_entropy set_entropy reset_scalar_constants scalar_constant bst_conv_layout bst_deconv_layout
dw_matmul_large_n ConvEdgeBias conv_edge_bias_init deconv_edge_bias_init filter_tensor_op
concrete_gate concrete_gate_infer replace_add_n restore_add_n fancy_gather reduce_max assign_add gradients
recomputable sparse_relu FusedBasicLSTMCell grouped_lstm group_lstm_grads block_reduced_full_dw group_param_grads
get_bsmm_dx_ops Ema AdamOptimizer AdafactorOptimizer blocksparse_l2_decay blocksparse_norm blocksparse_prune
clip_by_global_norm global_norm adafactor2d_op adafactor1d_op adam_op blocksparse_adam_op QuantizeSpec quantize
log_stats softmax masked_softmax transpose_2d transpose_0213 top_k rectified_top_k
clear_bst_constants
""".split()


def test_every_seed_name_is_provided_or_documented():
    seed_doc = (Path(__file__).resolve().parents[2] / "docs" / "seed.md").read_text()
    for name in SEED_NAMES:
        if name in NOT_PROVIDED:
            assert f"`{name}`" in seed_doc, f"{name}: not provided, and docs/seed.md does not say so"
        else:
            assert callable(getattr(bs, name, None)), f"bstrain.ops.{name} is missing"
            assert name in bs.__all__


def test_submodules_stay_importable():
    from bstrain.ops import embed, ew, matmul, norms, proj  # noqa: F401
    assert bs.norms.layer_norm is bs.layer_norm and bs.ew.dropout is bs.dropout


def test_seed_style_calls():
    """Calls as the seed's examples and tests write them."""
    layout = np.random.randint(2, size=(8, 8))
    layout[0, 0] = 1
    bsmm = bs.BlocksparseMatMul(layout, block_size=16)
    w = torch.randn(bsmm.w_shape)
    x = torch.randn(4, 128)
    y = bsmm(x, w)
    g, b = torch.ones(1, 128), torch.zeros(128, 1)
    h = bs.layer_norm(y.view(2, 2, 128), g, b, axis=-1)                     # the seed's transformer call
    assert h.shape == (2, 2, 128)
    assert torch.equal(bs.bias_relu(y, b), y + b.view(-1))                  # default: no activation
    z, mask = bs.dropout(h, 0.8, mask_shape=[2, 1, 128])
    assert z.shape == h.shape and mask.dtype == torch.uint8
    loss = bs.softmax_cross_entropy(h, torch.randint(0, 128, (2, 2)).to(torch.uint8))
    assert loss.shape == (2, 2)
    assert bs.ceil_div(7, 2) == 4 and bs.reduce_mul([2, 3, 4]) == 24
    # the seed's own tests pass its tuning switches; they are accepted and change nothing
    torch.testing.assert_close(bs.bias_relu(y, b, axis=1, fast_gelu=True, atomics=False, bench=0),
                               bs.bias_relu(y, b, axis=1, fast_gelu=True))
    torch.testing.assert_close(bs.layer_norm(y, g, b, 1, 1, 1e-6, False, True, 0), bs.layer_norm(y, g, b))
    assert bs.embedding_lookup(torch.randn(5, 3), torch.tensor([1, 4]), True, 0).shape == (2, 3)
    wn = bsmm.l2_normalize(w, dtype=torch.float16)                           # the seed's dtype argument
    assert wn.dtype == torch.float16


def test_filter_tensor_and_its_gradient():
    x = torch.tensor([1.0, float("inf"), float("nan"), -5.0, 0.5], requires_grad=True)
    y = bs.filter_tensor(x, 2.0, saturate=3.0, zero_infs=True, zero_nans=True)
    torch.testing.assert_close(y, torch.tensor([2.0, 0.0, 0.0, -3.0, 1.0]))
    y.backward(torch.tensor([1.0, 1.0, float("nan"), 4.0, float("inf")]))
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 2.0, 0.0, 3.0, 0.0]))
    torch.testing.assert_close(bs.scale_tensor(torch.ones(3), 0.5), torch.full((3,), 0.5))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        bs.filter_tensor([1.0])
