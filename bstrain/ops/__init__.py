"""Seed-compatible ops on torch tensors: autograd Functions, functional wrappers and references."""
from bstrain.ops.matmul import BlocksparseMatMul, bsmm_ref

__all__ = ["BlocksparseMatMul", "bsmm_ref"]
