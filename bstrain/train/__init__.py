"""bstrain.train: see README."""
