"""Whole models: the sparse mLSTM, the sparse transformer LM and the sparse ResNet.

The reusable modules (``BlockSparseLinear``, ``BlockSparseConv2d``, ``BlockSparseAttention``,
``LayerNorm``) live in :mod:`bstrain.nn`; ``bstrain.models.BlockSparseLinear`` still works, with a
DeprecationWarning.
"""
from bstrain._deprecated import moved

__getattr__ = moved(__name__, "bstrain.nn", ("BlockSparseLinear",))
