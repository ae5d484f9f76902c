"""Reusable block-sparse modules for research code, with ``torch.nn``'s conventions.

=====================  =========================================================================
``BlockSparseLinear``  ``nn.Linear`` with a block-sparse weight
``BlockSparseConv2d``  ``nn.Conv2d`` with block-sparse channel connectivity
``BlockSparseAttention``  attention over a block layout (the fused kernels on CUDA)
``LayerNorm``          ``nn.LayerNorm`` over the fused kernel (segments, fused ReLU, fp32 params)
=====================  =========================================================================

``sparsify(model, include, density=...)`` swaps a model's ``nn.Linear``, ``nn.Conv2d`` and Hugging
Face ``Conv1D`` layers for these (``register_sparsifiable`` adds a layer type);
``block_sparse_layouts(model)`` lists every layout; ``sync_layouts(model)`` has every layer take its
``layout`` buffer now (each does when it next runs); :mod:`bstrain.hf` saves and loads a sparsified
Hugging Face model. Whole models live in
:mod:`bstrain.models`.
"""
from bstrain.nn._sparse import sync_layouts
from bstrain.nn.attention import BlockSparseAttention
from bstrain.nn.conv import BlockSparseConv2d
from bstrain.nn.convert import SparsifyResult, register_sparsifiable, sparsify
from bstrain.nn.linear import BlockSparseLinear, block_sparse_layouts, set_grad_group
from bstrain.nn.norm import LayerNorm

__all__ = ["BlockSparseLinear", "BlockSparseConv2d", "BlockSparseAttention", "LayerNorm", "sparsify",
           "SparsifyResult", "register_sparsifiable", "set_grad_group", "block_sparse_layouts", "sync_layouts"]
