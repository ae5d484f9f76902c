"""BlockSparseLinear."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch import nn

from bstrain.nn import BlockSparseLinear, sparsify
from tests.conftest import dense_weight


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
    assert "density=0.250" in repr(layer) and "realised" not in repr(layer)


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=64, out_features=64), "layout: expected a layout or a density"),
    (dict(in_features=60, out_features=64, density=0.5), "in_features: expected a positive multiple"),
    (dict(in_features=64, out_features=64, layout=np.ones((2, 3))), "out_features=64"),
    (dict(in_features=64, out_features=64, density=0.5, block_size=12), "block_size"),
    (dict(in_features=64, out_features=64, density=0.5, layout=np.ones((2, 2))), "layout, density: expected one"),
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
    # the grouped weight gradient sums the timesteps in the autocast dtype in another order (fp16/bf16 rounding)
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


def test_loading_a_state_dict_brings_its_layout_in_place():
    """Same number of live blocks: the layout is taken, and the Parameter an optimizer holds stays."""
    src = BlockSparseLinear(64, 64, False, layout=[[1, 0], [0, 1]])
    dst = BlockSparseLinear(64, 64, False, layout=[[0, 1], [1, 0]])
    opt = torch.optim.SGD(dst.parameters(), lr=0.1)
    weight = dst.weight
    dst.load_state_dict(src.state_dict())
    assert dst.weight is weight and (dst.op.layout == src.op.layout).all()
    x = torch.randn(5, 64)
    torch.testing.assert_close(dst(x), src(x))
    dst(x).sum().backward()
    opt.step()                                                        # trains the tensor the layer uses
    assert not torch.equal(dst(x), src(x))


def test_loading_a_layout_with_other_block_count_names_the_layer():
    src = nn.Sequential(BlockSparseLinear(64, 64, False, layout=[[1, 0], [0, 1]]))
    dst = nn.Sequential(BlockSparseLinear(64, 64, False, layout=[[1, 1], [1, 1]]))
    with pytest.raises(RuntimeError, match=r"0: the checkpoint's layout has 2 live blocks, this layer's 4"):
        dst.load_state_dict(src.state_dict())
    other = nn.Sequential(BlockSparseLinear(64, 128, False, layout=np.ones((2, 4))))
    with pytest.raises(RuntimeError, match=r"0: the checkpoint's layout has shape \(2, 2\)"):
        other.load_state_dict(src.state_dict())
    dst.load_state_dict(src.state_dict(), assign=True)                # the checkpoint's tensors, as asked
    x = torch.randn(3, 64)
    torch.testing.assert_close(dst(x), src(x))


def test_nn_linear_argument_order():
    layer = BlockSparseLinear(64, 32, False, block_size=16, density=0.5)
    assert layer.bias is None and layer.weight.shape[1:] == (16, 16)
    with pytest.raises(TypeError, match="bias: expected True or False"):
        BlockSparseLinear(64, 32, np.ones((4, 2)))                     # a layout where bias goes
    with pytest.raises(TypeError):
        BlockSparseLinear(64, 32, True, 16)                           # block_size is keyword-only


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_any_rank_input_and_feature_axis_0(backend):
    from tests.conftest import kernel_device
    dev = kernel_device() if backend == "triton" else "cpu"
    layer = BlockSparseLinear(64, 48, block_size=16, density=0.5).to(dev)
    layer.op.backend = backend
    x = torch.randn(2, 3, 64, device=dev)
    y = layer(x)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, x @ layer.dense_weight().t() + layer.bias, rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(0, 64, device=dev)).shape == (0, 48)
    t = BlockSparseLinear(64, 48, block_size=16, density=0.5, feature_axis=0).to(dev)
    t.op.backend = backend
    yt = t(x.permute(2, 0, 1))                                         # (C, B, T) -> (K, B, T)
    assert yt.shape == (48, 2, 3)
    torch.testing.assert_close(yt.permute(1, 2, 0), x @ t.dense_weight().t() + t.bias, rtol=1e-5, atol=1e-5)


def test_layout_follows_torch_manual_seed():
    torch.manual_seed(7)
    a = BlockSparseLinear(128, 128, block_size=16, density=0.3)
    torch.manual_seed(7)
    b = BlockSparseLinear(128, 128, block_size=16, density=0.3)
    assert (a.op.layout == b.op.layout).all()
    torch.testing.assert_close(a.weight, b.weight)
    c = BlockSparseLinear(128, 128, block_size=16, density=0.3)       # the generator moved on
    assert (a.op.layout != c.op.layout).any()


@pytest.mark.parametrize("shape, density", [((768, 3072), 0.25), ((256, 1024), 0.25), ((1024, 256), 0.2)])
def test_density_is_exact_and_balanced(shape, density):
    layer = BlockSparseLinear(*shape, block_size=32, density=density)
    lay = layer.op.layout
    assert lay.sum() == round(density * lay.size)
    cols, rows = lay.sum(0), lay.sum(1)
    assert cols.max() - cols.min() <= 1 and rows.max() - rows.min() <= 1
    assert (cols > 0).all() and (rows > 0).all(), "every output unit has inputs and every input is used"
    assert f"density={density:g} (realised {lay.mean():.3f})" in repr(layer)
    iid = BlockSparseLinear(*shape, block_size=32, density=density, balanced=False)
    assert 0 < iid.op.layout.sum() <= iid.op.layout.size


def test_reset_parameters_uses_each_units_fan_in():
    lay = np.zeros((8, 2), dtype=bool)
    lay[:, 0] = True                                                  # unit block 0: fan-in 8·16
    lay[0, 1] = True                                                  # unit block 1: fan-in 16
    layer = BlockSparseLinear(128, 32, block_size=16, layout=lay)
    assert layer.fan_in().tolist() == [128.0] * 16 + [16.0] * 16
    dense = layer.dense_weight()                                      # (K, C)
    for k, fan in ((0, 128), (20, 16)):
        live = dense[k][dense[k] != 0]
        assert live.abs().max() <= fan ** -0.5 and live.abs().max() > 0.5 * fan ** -0.5
        assert layer.bias[k].abs() <= fan ** -0.5
    x = torch.randn(4096, 128)
    var = layer(x).detach().var(0)                                    # uniform(±1/√fan): var 1/3 per unit
    # the mean over 16 units of a sum of fan squared uniforms: relative std about 5% at fan 16, so
    # rtol 0.3 fails with probability ~1e-8 (0.15 failed about once in 200 fresh seeds)
    assert torch.allclose(var[:16].mean(), torch.tensor(1 / 3 + 1 / 3 / 128), rtol=0.3)
    assert torch.allclose(var[16:].mean(), torch.tensor(1 / 3 + 1 / 3 / 16), rtol=0.3)


def test_meta_device_then_load_or_to_empty():
    src = BlockSparseLinear(64, 96, block_size=16, density=0.4)
    meta = BlockSparseLinear(64, 96, block_size=16, density=0.4, device="meta")
    assert meta.weight.is_meta and meta.layout.is_meta
    meta.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(3, 64)
    torch.testing.assert_close(meta(x), src(x))
    empty = BlockSparseLinear(64, 96, block_size=16, density=0.4, device="meta").to_empty(device="cpu")
    empty.reset_parameters()
    assert torch.equal(empty.layout, torch.as_tensor(empty.op.layout)) and torch.isfinite(empty.weight).all()
    assert empty.weight.std() > 0, "reset_parameters drew the live blocks"
    ref = x.double() @ dense_weight(empty.op.layout, empty.weight) + empty.bias.detach().double()
    torch.testing.assert_close(empty(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_dense_conversion_round_trip():
    layer = BlockSparseLinear(64, 96, block_size=16, density=0.4).double()
    linear = layer.to_dense()
    assert isinstance(linear, nn.Linear) and linear.weight.dtype == torch.float64
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(linear(x), layer(x))
    back = BlockSparseLinear.from_dense(linear, block_size=16, density=0.4)
    assert (back.op.layout == layer.op.layout).all(), "the live blocks carry all the weight"
    torch.testing.assert_close(back(x), layer(x))
    with_layout = BlockSparseLinear.from_dense(linear, block_size=16, layout=np.ones((4, 6)))
    torch.testing.assert_close(with_layout(x), layer(x))


def test_from_dense_keeps_the_largest_blocks():
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.mul_(0.01)
        linear.weight[16:, :16] = 1.0                                 # block (c=0, k=1) dominates
        linear.weight[:16, 48:] = -2.0                                # block (c=3, k=0) too
    layer = BlockSparseLinear.from_dense(linear, block_size=16, density=0.25)
    want = np.zeros((4, 2), dtype=bool)
    want[0, 1] = want[3, 0] = True
    assert (layer.op.layout == want).all()


def test_sparsify_swaps_chosen_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 10)))
    x = torch.randn(4, 64)
    dense_out = model[2][0](torch.relu(model[0](x)))
    replaced = sparsify(model, "2.0", block_size=32, density=1.0)
    assert replaced == ["2.0"] and isinstance(model[2][0], BlockSparseLinear)
    assert type(model[0]) is nn.Linear and type(model[2][1]) is nn.Linear
    torch.testing.assert_close(model[2][0](torch.relu(model[0](x))), dense_out)   # density 1 keeps everything
    with pytest.raises(ValueError, match=r"2.1: expected in/out features that are multiples of block_size=32"):
        sparsify(model, "*", block_size=32, density=0.5)
    assert type(model[0]) is nn.Linear, "nothing is replaced when a chosen layer does not fit"
    names = sparsify(model, lambda name, m: m.out_features == 128, block_size=32, density=0.5, keep_weights=False)
    assert names == ["0"] and model[0].op.layout.sum() == 4


def test_compile_and_export_on_cpu():
    from torch._dynamo.utils import counters
    from torch.export import Dim, export
    layer = BlockSparseLinear(64, 96, block_size=16, density=0.5)
    explained = torch._dynamo.explain(layer)(torch.randn(4, 64))
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    for n in (2, 3, 5, 8):
        x = torch.randn(n, 7, 64)
        torch.testing.assert_close(compiled(x), layer(x))
    assert counters["stats"]["unique_graphs"] <= 2
    fresh = BlockSparseLinear(64, 96, block_size=16, density=0.5)
    ep = export(fresh, (torch.randn(4, 64),), dynamic_shapes=({0: Dim("batch")},))
    x = torch.randn(11, 64)
    torch.testing.assert_close(ep.module()(x), fresh(x))
    assert type(fresh(x)) is torch.Tensor
