"""nn.Modules: layers and full models."""
from bstrain.models.layers import BlockSparseLinear

__all__ = ["BlockSparseLinear"]
