"""bstrain.configs: see README."""
