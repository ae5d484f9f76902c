"""bstrain: block-sparse training toolkit for PyTorch + Triton."""
__version__ = "0.1.0"
