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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_grad_group_matches_ungrouped(backend, group_size):
    """A weight applied at 7 timesteps: grouped dW (in launches of up to group_size steps) == per-step dW."""
    from tests.conftest import kernel_device
    dev = kernel_device() if backend == "triton" else "cpu"
    dtype = torch.float32 if backend == "triton" else torch.float64
    layer = BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=1).to(dev, dtype)
    layer.op.backend = backend
    xs = [torch.randn(5, 64, device=dev, dtype=dtype) for _ in range(7)]

    def run(grouped):
        layer.zero_grad()
        h = torch.zeros(5, 64, device=dev, dtype=dtype)
        with layer.grad_group(group_size if grouped else 1) as group:
            for x in xs:
                h = torch.tanh(layer(h) + x)                  # recurrent use: dX flows between steps
        h.square().sum().backward()
        return layer.weight.grad.clone(), layer.bias.grad.clone(), group

    w_ref, b_ref, _ = run(False)
    w_grp, b_grp, group = run(True)
    torch.testing.assert_close(w_grp, w_ref, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=1e-5 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(b_grp, b_ref)
    if group_size > 1:
        assert group.launches == -(-7 // group_size), "one dW launch per group of timesteps"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grad_group_under_autocast_with_fp32_activations(backend):
    """Under autocast, fp32 activations (CUDA's autocast layer norm returns fp32) meet the grouped
    weight, which is cast to the autocast dtype once per sequence: same output and dW as ungrouped."""
    from tests.conftest import kernel_device
    dev = kernel_device() if backend == "triton" else "cpu"
    dtype = torch.float16 if dev != "cpu" or backend == "triton" else torch.bfloat16
    layer = BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=2, bias=False).to(dev)
    layer.op.backend = backend
    xs = [torch.randn(4, 64, device=dev) for _ in range(5)]

    def run(group_size):
        layer.zero_grad()
        h, outs = torch.zeros(4, 64, device=dev), []
        with torch.autocast(torch.device(dev).type, dtype=dtype), layer.grad_group(group_size):
            for x in xs:
                y = layer(h.float())                        # fp32 in, autocast dtype out
                assert y.dtype == dtype
                h = torch.tanh(y.float() + x)
                outs.append(h)
        torch.stack(outs).square().sum().backward()
        return torch.stack(outs), layer.weight.grad.clone()

    h_ref, w_ref = run(1)
    h_grp, w_grp = run(4)
    torch.testing.assert_close(h_grp, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(w_grp, w_ref, rtol=2e-2, atol=2e-2)
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_without_autograd_the_context_casts_the_weight_once(backend):
    """Evaluation: inside grad_group (any size) the weight is cast to the autocast dtype once and
    reused by every call, with the same outputs as calls outside the context."""
    from tests.conftest import kernel_device
    dev = kernel_device() if backend == "triton" else "cpu"
    dtype = torch.float16 if dev != "cpu" or backend == "triton" else torch.bfloat16
    layer = BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=3).to(dev)
    layer.op.backend = backend
    xs = [torch.randn(4, 64, device=dev) for _ in range(3)]
    with torch.no_grad(), torch.autocast(torch.device(dev).type, dtype=dtype):
        want = [layer(x) for x in xs]
        for size in (1, 8):
            with layer.grad_group(size) as group:
                assert group is None
                got = [layer(x) for x in xs]                 # fp32 activations meet the cached weight
                assert layer._group[1].dtype == dtype         # the weight, cast once for the context
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert layer._group is None


def test_grad_group_survives_an_inputs_only_backward_pass():
    """autograd.grad w.r.t. inputs only must not leave stale dW behind for the next backward."""
    layer = BlockSparseLinear(32, 32, layout=[[1, 1], [0, 1]], block_size=16, bias=False).double()
    h0 = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)

    def loss(grouped):
        h = h0
        with layer.grad_group(4 if grouped else 1):
            for _ in range(6):
                h = torch.tanh(layer(h))
        return h.square().sum()
    layer.zero_grad()
    loss(False).backward()
    want = layer.weight.grad.clone()
    layer.zero_grad()
    grouped = loss(True)
    torch.autograd.grad(grouped, h0, retain_graph=True)
    grouped.backward()
    torch.testing.assert_close(layer.weight.grad, want)


def test_loading_a_state_dict_brings_its_layout():
    src = BlockSparseLinear(64, 64, layout=[[1, 0], [0, 1]], bias=False)
    dst = BlockSparseLinear(64, 64, layout=[[0, 1], [1, 0]], bias=False)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(5, 64)
    torch.testing.assert_close(dst(x), src(x))
    bigger = BlockSparseLinear(64, 64, layout=[[1, 1], [1, 1]], bias=False)
    bigger.load_state_dict(src.state_dict())
    torch.testing.assert_close(bigger(x), src(x))
