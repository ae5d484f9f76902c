"""Seed-compatible ops on torch tensors, in one flat namespace like the seed's.

``import bstrain.ops as bs`` gives the names ``import blocksparse as bs`` gave, for the ops bstrain
provides (docs/seed.md lists the seed names it does not). The submodules stay importable:
``bstrain.ops.matmul``, ``.ew``, ``.norms``, ``.lstm_cell``, ``.grouping``, ``.embed``, ``.proj``,
``.transformer``, ``.conv``, and the transformer's fused glue: ``.residual_norm``
(``add_layer_norm``), ``.rotary`` (``apply_rotary``, ``rotary_tables``), ``.bias_act``
(``bias_gelu``) and ``.cross_entropy``.
"""
from bstrain.ops.conv import BlocksparseConv, BlocksparseDeconv, cwise_linear
from bstrain.ops.cross_entropy import cross_entropy
from bstrain.ops.embed import embedding_lookup
from bstrain.ops.ew import (
    add, add_n, add_n8, bias_relu, ceil_div, concat4, divide, dropout, elu, exp, fast_gelu, filter_tensor,
    float_cast, fused_lstm_gates, gelu, log, maximum, minimum, multiply, negative, reciprocal, reduce_mul, relu,
    scale_tensor, sigmoid, softmax_cross_entropy, split4, sqrt, square, subtract, swish, tanh,
)
from bstrain.ops.lstm_cell import fused_lstm_cell
from bstrain.ops.matmul import BlocksparseMatMul, GradGroup, SparseProj, bsmm_ref
from bstrain.ops.norms import batch_norm, batch_norm_inference, layer_norm
from bstrain.ops.bias_act import bias_gelu
from bstrain.ops.residual_norm import add_layer_norm
from bstrain.ops.rotary import apply_rotary, rotary_tables
from bstrain.ops.transformer import BlocksparseTransformer

__all__ = [
    "BlocksparseMatMul", "SparseProj", "GradGroup", "bsmm_ref", "BlocksparseTransformer",
    "BlocksparseConv", "BlocksparseDeconv", "cwise_linear",
    "add", "multiply", "subtract", "divide", "maximum", "minimum", "negative", "reciprocal", "square", "sqrt",
    "exp", "log", "sigmoid", "tanh", "relu", "elu", "gelu", "swish", "fast_gelu", "bias_relu",
    "filter_tensor", "scale_tensor", "float_cast", "dropout", "add_n8", "add_n",
    "split4", "concat4", "fused_lstm_gates", "fused_lstm_cell", "softmax_cross_entropy", "embedding_lookup",
    "layer_norm", "batch_norm", "batch_norm_inference", "ceil_div", "reduce_mul",
    "add_layer_norm", "apply_rotary", "rotary_tables", "cross_entropy", "bias_gelu",
]
