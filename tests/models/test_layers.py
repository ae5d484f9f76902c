"""BlockSparseLinear."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain.models.layers import BlockSparseLinear
from tests.kernels.test_matmul import dense_weight


@pytest.mark.parametrize("axis", (0, 1))
def test_matches_dense_equivalent(axis):
    layer = BlockSparseLinear(64, 96, density=0.5, block_size=16, feature_axis=axis, seed=0).double()
    x = torch.randn(7, 64, dtype=torch.float64, requires_grad=True)
    inp = x if axis == 1 else x.t()
    y = layer(inp)
    wd = dense_weight(layer.op.layout, layer.weight)
    ref = x @ wd + layer.bias
    torch.testing.assert_close(y if axis == 1 else y.t(), ref)
    y.sum().backward()
    assert layer.weight.grad.shape == layer.op.w_shape and layer.bias.grad.shape == (96,)


def test_explicit_layout_and_state_dict():
    lay = np.eye(4, dtype=bool)
    layer = BlockSparseLinear(32, 32, layout=lay, block_size=8, bias=False)
    assert layer.weight.shape == (4, 8, 8) and layer.bias is None
    sd = layer.state_dict()
    assert set(sd) == {"weight", "layout"}
    assert "density=0.250" in repr(layer)


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=64, out_features=64), "layout: expected a layout or a density"),
    (dict(in_features=60, out_features=64, density=0.5), "in_features: expected a positive multiple"),
    (dict(in_features=64, out_features=64, layout=np.ones((2, 3))), "out_features=64"),
    (dict(in_features=64, out_features=64, density=0.5, block_size=12), "block_size"),
])
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSparseLinear(**kwargs)
