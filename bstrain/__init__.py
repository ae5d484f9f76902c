"""bstrain: block-sparse training toolkit for PyTorch + Triton."""
__version__ = "0.1.0"

__all__ = ["graphed", "sparsity"]


def __getattr__(name):
    if name == "graphed":                       # bstrain.graphed(step, *example_args): a step in one CUDA graph
        from bstrain.train.graphs import graphed
        return graphed
    if name == "sparsity":                      # bstrain.sparsity.RigL(model, optimizer, ...): dynamic sparsity
        import importlib
        return importlib.import_module("bstrain.sparsity")
    raise AttributeError(f"module 'bstrain' has no attribute {name!r}")
