"""PyTorch conventions the modules and ops keep (found by probing them as researchers use
nn.Linear and nn.Conv2d): memory formats, the layout buffer as the layout, dtype checks that name
the input, empty batches, float64 everywhere, meta-device models, numpy sizes, Python scalars."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import bstrain.ops as bs
from bstrain.models.convnet import SparseResNet
from bstrain.models.lstm import SparseLSTM
from bstrain.nn import BlockSparseConv2d, BlockSparseLinear, LayerNorm, sparsify


def test_a_convnet_takes_channels_last_as_a_whole():
    """model.to(memory_format=torch.channels_last) applies to every 4-D tensor; a sparse conv's
    5-D weight keeps its own layout (and its values), and the model computes the same."""
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5)
    x = torch.randn(2, 32, 8, 8)
    want = conv(x)
    conv = conv.to(torch.float64, memory_format=torch.channels_last)
    assert conv.weight.dtype == torch.float64 and conv.weight.is_contiguous()
    torch.testing.assert_close(conv(x.double().to(memory_format=torch.channels_last)).float(), want)
    net = SparseResNet(widths="32,64", density=0.5).eval()
    img = torch.randn(2, 3, 16, 16)
    want = net(img)
    net = net.to(memory_format=torch.channels_last)
    torch.testing.assert_close(net(img.to(memory_format=torch.channels_last)), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda seed: BlockSparseLinear(64, 64, block_size=16, density=0.5, seed=seed),
    lambda seed: BlockSparseConv2d(64, 64, 3, block_size=16, density=0.5, seed=seed)], ids=["linear", "conv"])
def test_the_state_dict_holds_the_layout_the_module_computes_with(make):
    """The layout buffer is the layout: a write into it changes the computation, the state dict
    hands out the buffer itself (it once aliased the host layout and corrupted the tables' spec:
    the host layout stays as it was), and load_state_dict takes another layout."""
    a = make(0)
    b = next(m for m in map(make, range(1, 20)) if not np.array_equal(m.block_layout(), a.block_layout()))
    x = torch.randn(3, 64) if isinstance(a, BlockSparseLinear) else torch.randn(2, 64, 6, 6)
    want, mine = a(x), a.block_layout().copy()
    host = a._op_layout()
    with torch.no_grad():
        a.layout.copy_(b.layout)
    assert not torch.equal(a(x), want)
    assert np.array_equal(host, mine) and np.array_equal(a.block_layout(), b.block_layout())
    assert a.state_dict()["layout"].data_ptr() == a.layout.data_ptr()
    c = make(5)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c(x), a(x))
    c.load_state_dict(b.state_dict())
    assert torch.equal(c(x), b(x))


def test_an_input_of_another_dtype_is_named():
    layer = BlockSparseLinear(64, 64, block_size=16, density=0.5)
    with pytest.raises(TypeError, match=r"x: expected torch.float32 .*got torch.float64"):
        layer(torch.randn(2, 64, dtype=torch.float64))
    assert layer(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16     # fp32 master weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 64)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"x: expected torch.float64"):
        layer.double()(torch.randn(2, 64))


def test_empty_batches_on_the_pytorch_path():
    g, b = torch.randn(64), torch.randn(64)
    for kw in (dict(relu=True), dict(segments=4), dict(axis=0)):
        x = torch.randn(0, 64) if kw.get("axis", 1) == 1 else torch.randn(64, 0)
        assert bs.layer_norm(x, g, b, **kw).shape == x.shape
    assert LayerNorm(64, segments=4)(torch.randn(0, 64)).shape == (0, 64)
    model = SparseLSTM(hidden=64, embed=16, block_size=16, density=0.5)
    logits, (c, h) = model(torch.randint(0, 256, (0, 5)))
    assert logits.shape == (0, 5, 256) and c.shape == (0, 64)


def test_softmax_cross_entropy_keeps_float64():
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 2, 3])
    assert bs.softmax_cross_entropy(logits, labels).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda t: bs.softmax_cross_entropy(t, labels), (logits,))


def test_sparsify_on_the_meta_device():
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    with pytest.raises(ValueError, match="keep_weights: a model on the meta device"):
        sparsify(mlp, "*", block_size=16, density=0.5)
    assert sparsify(mlp, "*", block_size=16, density=0.5, keep_weights=False) == ["0", "2"]
    assert mlp[0].weight.is_meta


def test_sizes_and_bias_as_nn_linear_takes_them():
    layer = BlockSparseLinear(np.int64(64), np.int32(32), 0, block_size=16, density=0.5)
    assert layer.in_features == 64 and type(layer.out_features) is int and layer.bias is None
    conv = BlockSparseConv2d(np.int64(32), 32, 3, bias=np.bool_(False), block_size=np.int64(16), density=0.5)
    assert conv.bias is None and conv.in_channels == 32 and (conv.groups, conv.padding_mode) == (1, "zeros")
    with pytest.raises(TypeError, match="bias: expected True or False"):
        BlockSparseLinear(64, 64, 32, density=0.5)                # a block size in bias's place
    with pytest.raises(ValueError, match="in_features: expected a positive multiple of block_size=16"):
        BlockSparseLinear(np.int64(40), 64, block_size=16, density=0.5)


@pytest.mark.parametrize("op, ref", [(bs.add, torch.add), (bs.subtract, torch.sub), (bs.multiply, torch.mul),
                                     (bs.divide, torch.div), (bs.maximum, torch.clamp_min),
                                     (bs.minimum, torch.clamp_max)], ids=lambda f: getattr(f, "__name__", ""))
def test_binary_ops_take_python_numbers(op, ref):
    x = torch.randn(4, 3)
    for y in (2, 0.5):
        torch.testing.assert_close(op(x, y), ref(x, y))
    assert op(x.half(), 0.5).dtype == torch.float16
    if op not in (bs.maximum, bs.minimum):                                # (1e5 is past fp16's range there)
        small = torch.tensor([1e-4, 3.0], dtype=torch.float16)          # as torch: the number is not rounded first
        torch.testing.assert_close(op(small, 1e5), ref(small, 1e5))


def test_lstm_input_errors_name_the_argument():
    model = SparseLSTM(hidden=64, embed=16, block_size=16, density=0.5)
    with pytest.raises(ValueError, match=r"x: expected a \(batch, time\) tensor of byte ids, got \(5,\)"):
        model(torch.randint(0, 256, (5,)))
    with pytest.raises(ValueError, match=r"state: expected \(c, h\), each \(2, 64\)"):
        model(torch.randint(0, 256, (2, 5)), (torch.zeros(3, 64), torch.zeros(3, 64)))


def test_sparse_proj_built_under_a_meta_default_device():
    with torch.device("meta"):
        proj = bs.SparseProj(16, 4)
    x = torch.randn(16, 3)
    torch.testing.assert_close(proj.gather(x), x[proj.gather_lut])


@pytest.mark.parametrize("make, x", [
    (lambda: BlockSparseLinear(64, 64, block_size=16, density=0.5), lambda: torch.randn(2, 64)),
    (lambda: BlockSparseConv2d(32, 32, 3, block_size=16, density=0.5), lambda: torch.randn(1, 32, 5, 5))],
    ids=["linear", "conv"])
def test_built_and_run_under_inference_mode(make, x):
    """A module built under torch.inference_mode (its buffers are inference tensors, which keep
    no version counter) runs there and outside it; a normal one runs under it."""
    with torch.inference_mode():
        built = make()
        want = built(x())
    assert built(x()).shape == want.shape
    normal = make()
    with torch.inference_mode():
        assert normal(x()).shape == want.shape


def test_export_with_any_length_up_to_the_context():
    """torch.export with a dynamic sequence length whose range reaches the context: one program
    for every length (the attention pads by zero rows at the context itself)."""
    from torch.export import Dim, export

    from bstrain.models.transformer import SparseTransformer
    model = SparseTransformer(d_model=32, n_layer=1, n_head=2, context=64, block_size=16, window=16, summary=4).eval()
    program = export(model, (torch.randint(0, 256, (2, 64)),), dynamic_shapes=({1: Dim("T", min=2, max=64)},))
    for t in (64, 40, 7):
        x = torch.randint(0, 256, (2, t))
        got, want = program.module()(x), model(x)
        got, want = (r[0] if isinstance(r, tuple) else r for r in (got, want))
        torch.testing.assert_close(got, want)


@pytest.mark.triton
def test_an_exported_program_outlives_its_module():
    """The kernel path (the interpreter here, CUDA by default) names the layout by key: the
    tables a traced graph names stay alive after the module that made them is gone."""
    import gc

    from bstrain.ops import BlocksparseMatMul
    layout = np.random.default_rng(int(torch.randint(1 << 30, ()))).random((2, 3)) < 0.6
    layout[0, 0] = True
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = BlockSparseLinear(32, 48, block_size=16, layout=layout).to(dev)
    layer.op = BlocksparseMatMul(layout, 16, backend="triton")
    x = torch.randn(5, 32, device=dev)
    want = layer(x).detach()
    program = torch.export.export(layer, (x,))
    del layer
    gc.collect()
    torch.testing.assert_close(program.module()(x), want)
