"""BlockSparseConv2d: against a float64 masked dense conv (PyTorch paths), as an nn.Conv2d drop-in
(padding, unbatched inputs, dense conversion, dtype errors), its layout tables and state dicts,
meta/inference/export/copies, and the Conv2d half of sparsify. The Triton kernels' own checks
are in tests/kernels/test_conv.py."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bstrain.nn import BlockSparseConv2d, block_sparse_layouts
from bstrain.nn.conv import sparsify_conv2d_candidates
from bstrain.ops.tables import layout_tables
from tests.conftest import assert_close, fresh_seed, kernel_device


def masked_dense(conv: BlockSparseConv2d) -> torch.Tensor:
    """(K, C, kh, kw) float64 weight: every live block at its place, zeros elsewhere."""
    bs = conv.block_size
    w = torch.zeros(conv.out_channels, conv.in_channels, *conv.kernel_size, dtype=torch.float64)
    for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
        w[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs] = conv.weight[n].detach().double().cpu()
    return w


def tf_same(n: int, k: int, stride: int, dilation: int = 1) -> list[int]:
    """TensorFlow's SAME padding of one dim: (before, after), the extra element after."""
    out = -(-n // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - n, 0)
    return [total // 2, total - total // 2]


@pytest.mark.parametrize("backend", ["grouped", "dense"])
@pytest.mark.parametrize("kernel,stride,dilation,padding", [
    (3, 1, 1, "same"), (3, 2, 1, "same"), (4, 1, 2, "same"), (1, 1, 1, "valid"), (3, 1, 1, 2), (3, 2, 2, (1, 2)),
    (2, 1, 1, 0)], ids=str)
def test_matches_the_masked_dense_conv(backend, kernel, stride, dilation, padding):
    """float64, ragged 9 x 8 images, gradients of x and every live block."""
    torch.manual_seed(fresh_seed())
    conv = BlockSparseConv2d(16, 24, kernel, stride, padding, dilation, block_size=4, density=0.4,
                             backend=backend).double()
    x = torch.randn(2, 16, 9, 8, dtype=torch.float64, requires_grad=True)
    y = conv(x)
    w = masked_dense(conv).requires_grad_()
    xr = x.detach().requires_grad_()
    if padding == "same":
        ref = F.conv2d(F.pad(xr, tf_same(8, kernel, stride, dilation) + tf_same(9, kernel, stride, dilation)), w,
                       stride=stride, dilation=dilation)
    else:
        ref = F.conv2d(xr, w, stride=stride, dilation=dilation, padding=padding)
    ref = ref + conv.bias.detach().view(1, -1, 1, 1)
    assert_close(y, ref, None, torch.float64, "out")
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(y, [x, conv.weight], g)
    rx, rw = torch.autograd.grad(ref, [xr, w], g)
    assert_close(dx, rx, None, torch.float64, "dx")
    bs = conv.block_size
    for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
        assert_close(dw[n], rw[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs], None, torch.float64, f"dW[{n}]")


def test_padding_defaults_to_zero_like_nn_conv2d():
    conv = BlockSparseConv2d(16, 16, 3, block_size=8, density=0.5)
    dense = nn.Conv2d(16, 16, 3)
    assert conv.padding == dense.padding == (0, 0)
    x = torch.randn(2, 16, 9, 7)
    assert conv(x).shape == dense(x).shape == (2, 16, 7, 5)


@pytest.mark.parametrize("kernel,dilation", [(2, 1), (3, 1), (4, 1), (3, 2), (4, 3)])
def test_same_padding_at_stride_1_is_nn_conv2ds(kernel, dilation):
    """Even and dilated filters pad asymmetrically: TF's SAME and torch's "same" put the extra
    element after, alike."""
    conv = BlockSparseConv2d(16, 16, kernel, 1, "same", dilation, block_size=8, density=0.5).double()
    dense = nn.Conv2d(16, 16, kernel, 1, "same", dilation).double()
    with torch.no_grad():
        dense.weight.copy_(conv.dense_weight())
        dense.bias.copy_(conv.bias)
    x = torch.randn(2, 16, 9, 6, dtype=torch.float64)
    torch.testing.assert_close(conv(x), dense(x))
    assert conv.to_dense().padding == "same"


def test_tuple_padding_and_unbatched_input():
    conv = BlockSparseConv2d(16, 24, (3, 2), 1, (1, 2), block_size=8, density=0.5).double()
    dense = conv.to_dense()
    assert dense.padding == (1, 2)
    x = torch.randn(16, 7, 5, dtype=torch.float64, requires_grad=True)
    y = conv(x)
    assert y.shape == dense(x).shape == (24, 7, 8)
    torch.testing.assert_close(y, conv(x[None])[0])
    torch.testing.assert_close(y, dense(x))
    dx, = torch.autograd.grad(y.square().sum(), [x])
    torch.testing.assert_close(dx, torch.autograd.grad(dense(x).square().sum(), [x])[0])
    with pytest.raises(ValueError, match=r"x: expected \(N, 16, H, W\) or \(16, H, W\), got \(7, 5\)"):
        conv(torch.randn(7, 5))
    with pytest.raises(ValueError, match="padding: expected 'same', 'valid', an int >= 0 or a pair"):
        BlockSparseConv2d(16, 16, 3, padding=(1, -1), block_size=8, density=0.5)


def test_dense_weight_is_differentiable_and_to_dense_computes_the_same():
    conv = BlockSparseConv2d(32, 16, 3, 2, 1, block_size=8, density=0.5).double()
    dense_w = conv.dense_weight()
    assert dense_w.shape == (16, 32, 3, 3)
    torch.testing.assert_close(dense_w, masked_dense(conv))
    g = torch.randn_like(dense_w)
    (dense_w * g).sum().backward()
    bs = 8
    for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
        torch.testing.assert_close(conv.weight.grad[n], g[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs])
    dense = conv.to_dense()
    assert isinstance(dense, nn.Conv2d) and dense.weight.dtype == torch.float64 and dense.stride == (2, 2)
    x = torch.randn(2, 32, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(dense(x), conv(x))
    with pytest.raises(ValueError, match="to_dense: padding='same' at stride"):
        BlockSparseConv2d(16, 16, 3, 2, "same", block_size=8, density=0.5).to_dense()


def test_from_dense_keeps_the_largest_blocks():
    dense = nn.Conv2d(32, 16, 3, padding=1, dilation=1).double()
    with torch.no_grad():
        dense.weight.mul_(0.01)
        dense.weight[8:, :8] = 1.0                                  # block (c=0, k=1) dominates
        dense.weight[:8, 24:] = -2.0                                # block (c=3, k=0) too
    conv = BlockSparseConv2d.from_dense(dense, block_size=8, density=0.25)
    want = np.zeros((4, 2), dtype=bool)
    want[0, 1] = want[3, 0] = True
    assert (conv.block_layout() == want).all() and conv.padding == (1, 1) and conv.weight.dtype == torch.float64
    x = torch.randn(2, 32, 6, 5, dtype=torch.float64)
    torch.testing.assert_close(conv(x), F.conv2d(x, masked_dense(conv), dense.bias, padding=1))
    full = BlockSparseConv2d.from_dense(dense, block_size=8, layout=np.ones((4, 2)))
    torch.testing.assert_close(full(x), dense(x))
    torch.testing.assert_close(BlockSparseConv2d.from_dense(full.to_dense(), block_size=8, density=1.0)(x), dense(x))
    with pytest.raises(ValueError, match="conv: expected groups=1"):
        BlockSparseConv2d.from_dense(nn.Conv2d(16, 16, 3, groups=2), block_size=8, density=0.5)
    with pytest.raises(ValueError, match="multiples of block_size=8, got 12 and 16"):
        BlockSparseConv2d.from_dense(nn.Conv2d(12, 16, 3), block_size=8, density=0.5)


def test_a_dtype_mismatch_names_x():
    conv = BlockSparseConv2d(16, 16, 3, block_size=8, density=0.5)
    with pytest.raises(TypeError, match=r"x: expected torch.float32 \(the weight's dtype\), got torch.float64"):
        conv(torch.randn(1, 16, 5, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x: expected torch.float32 \(the weight's dtype\), got torch.float16"):
        conv(torch.randn(1, 16, 5, 5, dtype=torch.float16))
    with torch.autocast("cpu", dtype=torch.bfloat16):              # autocast casts both: no error
        assert conv(torch.randn(1, 16, 5, 5, dtype=torch.float16)).dtype == torch.bfloat16


def test_tables_are_shared_layout_tables_not_buffers():
    a = BlockSparseConv2d(32, 32, 3, block_size=16, density=0.5, seed=1)
    b = BlockSparseConv2d(32, 32, 1, block_size=16, layout=a.block_layout())
    assert a._tables is b._tables is layout_tables("conv", a.block_layout(), 16)
    assert set(a.state_dict()) == {"weight", "bias", "layout"}
    assert [name for name, _ in a.named_buffers()] == ["layout"]
    host = a._tables.host
    assert host.rows.device.type == "cpu" and host.luts.col_ptr.dtype == torch.int32
    m = BlockSparseConv2d(32, 32, 3, block_size=16, density=0.5, seed=1, device="meta").to_empty(device="cpu")
    assert m._tables is a._tables and torch.equal(m.layout, a.layout)      # nothing of the layout to garble


def test_loading_layouts_follows_block_layout_module_rules():
    src = nn.Sequential(BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, layout=[[1, 0], [0, 1]]))
    dst = nn.Sequential(BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, layout=[[0, 1], [1, 0]]))
    weight = dst[0].weight
    dst.load_state_dict(src.state_dict())                          # same count: adopted, Parameter kept
    assert dst[0].weight is weight and (dst[0].block_layout() == src[0].block_layout()).all()
    assert dst[0]._tables is src[0]._tables
    x = torch.randn(2, 32, 5, 4)
    torch.testing.assert_close(dst(x), src(x))
    more = nn.Sequential(BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, layout=np.ones((2, 2))))
    with pytest.raises(RuntimeError, match=r"0: the checkpoint's layout has 2 live blocks, this layer's 4; build the "
                                           r"layer with the checkpoint's layout .* or load with assign=True"):
        more.load_state_dict(src.state_dict())
    other = nn.Sequential(BlockSparseConv2d(32, 64, 3, padding=1, block_size=16, density=0.5))
    with pytest.raises(RuntimeError, match=r"0: the checkpoint's layout has shape \(2, 2\), this layer's \(2, 4\)"):
        other.load_state_dict(src.state_dict())
    more.load_state_dict(src.state_dict(), assign=True)           # the checkpoint's tensors, as asked
    torch.testing.assert_close(more(x), src(x))


def test_meta_context_construction_then_to_empty_and_load():
    src = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, seed=3)
    with torch.device("meta"):
        m = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, seed=3)
    assert m.weight.is_meta and m.layout.is_meta
    assert (m.block_layout() == src.block_layout()).all(), "the layout is drawn on the CPU generator"
    assert m._tables.host.rows.device.type == "cpu"
    assert m(torch.empty(2, 32, 5, 5, device="meta")).shape == (2, 32, 5, 5)        # shapes on meta
    m.to_empty(device="cpu")
    m.load_state_dict(src.state_dict())
    x = torch.randn(2, 32, 5, 5)
    torch.testing.assert_close(m(x), src(x))
    assigned = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, seed=3, device="meta")
    assigned.load_state_dict(src.state_dict(), assign=True)
    torch.testing.assert_close(assigned(x), src(x))
    fresh = BlockSparseConv2d(32, 32, 3, block_size=16, density=0.5, device="meta").to_empty(device="cpu")
    fresh.reset_parameters()
    bound = 1 / (fresh.fan_in()[0] ** 0.5)
    assert fresh.weight.abs().max() <= bound and fresh.weight.std() > bound / 4


@pytest.mark.parametrize("backend", ["dense", "triton"])
def test_inference_mode_first_then_training(backend):
    dev = kernel_device()
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, backend=backend).to(dev)
    x = torch.randn(2, 32, 4, 5, device=dev)
    twin = copy.deepcopy(conv)                          # never called under inference mode
    with torch.inference_mode():
        first = conv(x)
    xg = x.clone().requires_grad_()
    y = conv(xg)
    torch.testing.assert_close(y, first)
    y.square().sum().backward()
    x64 = x.double().cpu().requires_grad_()
    ref = F.conv2d(x64, masked_dense(conv), conv.bias.detach().double().cpu(), padding=1)
    assert_close(y, ref, None, torch.float32, "out")
    ref.square().sum().backward()
    assert_close(xg.grad, x64.grad, None, torch.float32, "dx")
    twin(x).square().sum().backward()
    torch.testing.assert_close(conv.weight.grad, twin.weight.grad)


@pytest.mark.parametrize("backend", ["dense", "triton"])
def test_export_then_eager_and_copies(backend):
    dev = kernel_device() if backend == "triton" else "cpu"
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, backend=backend).to(dev)
    x = torch.randn(2, 32, 4, 4, device=dev)
    want = conv(x)
    ep = torch.export.export(conv, (x,), strict=False)
    torch.testing.assert_close(ep.module()(x), want)
    y = conv(x)                                           # eager after export: real tensors, same values
    assert type(y) is torch.Tensor and torch.equal(y, want)
    t = conv._tables.host
    assert all(type(v) is torch.Tensor for v in (t.rows, t.cols, t.luts.col_ptr))
    for other in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
        assert other._tables is conv._tables
        torch.testing.assert_close(other(x), want)


def test_sparsify_conv2d_helpers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1),
                                                                                   nn.Conv2d(32, 16, 1)))
    x = torch.randn(2, 3, 8, 8)
    h = torch.relu(model[0](x))
    with pytest.raises(ValueError, match=r"^0: expected in/out channels that are multiples of block_size=8"):
        sparsify_conv2d_candidates(model, "*", block_size=8)
    chosen = sparsify_conv2d_candidates(model, "2.*", block_size=8)
    assert [name for name, _ in chosen] == ["2.0", "2.1"]
    want = model[2](h)
    for name, conv in chosen:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, BlockSparseConv2d.sparsified(conv, block_size=8, density=1.0))
    torch.testing.assert_close(model[2](h), want)                  # density 1 keeps every weight
    fresh = BlockSparseConv2d.sparsified(nn.Conv2d(16, 32, 3, 2, 1), block_size=8, density=0.5, keep_weights=False)
    assert fresh.stride == (2, 2) and fresh.padding == (1, 1) and fresh.block_layout().sum() == 4
    assert [n for n, _ in block_sparse_layouts(model)] == ["2.0", "2.1"]
    assert sparsify_conv2d_candidates(model, lambda name, m: name != "0", block_size=8) == [], "only nn.Conv2d"


@pytest.mark.gpu
def test_second_eager_call_launches_directly():
    """The kernels launch through cached plans: a second eager fwd+bwd at the same shape adds no
    plan and takes the direct launch path for every kernel."""
    from bstrain.kernels import launch
    conv = BlockSparseConv2d(128, 128, 3, padding=1, block_size=64, density=0.5, backend="triton").cuda().half()
    x = torch.randn(4, 128, 8, 8, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    plans = conv._tables.on(x.device).luts.plans
    for channels_last in (True, False):
        xi = (x if channels_last else x.contiguous()).requires_grad_()
        conv(xi).sum().backward()                                   # compiles and plans
        count, direct = len(plans), launch.stats["direct"]
        conv(xi).sum().backward()
        torch.cuda.synchronize()
        assert len(plans) == count
        assert launch.stats["direct"] >= direct + 3, "fwd, dx and dw launched directly"


@pytest.mark.gpu
def test_direct_launches_from_a_fresh_thread():
    """A thread that has made no CUDA call yet (autograd's backward thread can be one) launches the
    planned TMA kernels directly: the launchers make the context current first."""
    import threading
    from bstrain.kernels.conv import conv_dx
    from bstrain.ops.conv import _wt
    conv = BlockSparseConv2d(128, 128, 3, padding=1, block_size=64, density=0.5, backend="triton").cuda().half()
    x = torch.randn(2, 128, 8, 8, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    luts, wt = conv._tables.on(x.device).luts, _wt(conv.weight.detach(), x.dtype)
    with torch.no_grad():
        want = conv(x)
    want_dx = conv_dx(x, wt, luts, 128, 8, 8, (1, 1), (1, 1), (1, 1), x)       # plans made on this thread
    got, errors = [], []

    def work():
        try:
            with torch.no_grad():
                got.extend([conv(x), conv_dx(x, wt, luts, 128, 8, 8, (1, 1), (1, 1), (1, 1), x)])
        except Exception as exc:                                   # reported below, not lost in the thread
            errors.append(exc)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    torch.testing.assert_close(got[1], want_dx, rtol=0, atol=0)
