"""bstrain.data: see README."""
