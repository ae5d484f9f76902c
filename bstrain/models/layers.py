"""Deprecated: the modules moved to :mod:`bstrain.nn` (``from bstrain.nn import BlockSparseLinear``)."""
from bstrain._deprecated import moved

__getattr__ = moved(__name__, "bstrain.nn", ("BlockSparseLinear", "block_sparse_layouts", "set_grad_group",
                                             "sparsify"))
