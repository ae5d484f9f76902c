"""Deprecated: ``BlockSparseConv2d`` moved to :mod:`bstrain.nn` (``from bstrain.nn import BlockSparseConv2d``)."""
from bstrain._deprecated import moved

__getattr__ = moved(__name__, "bstrain.nn", ("BlockSparseConv2d",))
