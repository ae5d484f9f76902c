"""BlockSparseConv2d (against a masked dense conv) and the sparse ResNet (shapes, layouts, errors,
torch.compile, training through the trainer with an exact resume)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from bstrain.nn import BlockSparseConv2d
from bstrain.models.convnet import SparseResNet
from bstrain.nn import block_sparse_layouts
from bstrain.train.trainer import train
from tests.conftest import assert_close, fresh_seed, killed_then_resumed


def masked_dense(conv: BlockSparseConv2d) -> torch.Tensor:
    """(K, C, kh, kw) float64 weight: every live block at its place, zeros elsewhere."""
    bs = conv.block_size
    w = torch.zeros(conv.out_channels, conv.in_channels, *conv.kernel_size, dtype=torch.float64)
    for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
        w[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs] = conv.weight[n].detach().double()
    return w


@pytest.mark.parametrize("backend", ["grouped", "dense"])
@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, "same"), (3, 2, "same"), (1, 1, "valid"), (3, 1, 2)])
def test_conv2d_matches_the_masked_dense_conv(backend, kernel, stride, padding):
    torch.manual_seed(fresh_seed())
    conv = BlockSparseConv2d(16, 24, kernel, stride, padding, block_size=4, density=0.4, backend=backend).double()
    x = torch.randn(2, 16, 9, 8, dtype=torch.float64, requires_grad=True)
    y = conv(x)
    w = masked_dense(conv).requires_grad_()
    xr = x.detach().requires_grad_()
    if padding == "same":                    # TensorFlow's SAME: output ceil(size / stride), extra pad after
        pads = []
        for n in (8, 9):
            out = -(-n // stride)
            total = max((out - 1) * stride + kernel - n, 0)
            pads += [total // 2, total - total // 2]
        ref = F.conv2d(F.pad(xr, pads), w, stride=stride)
    else:
        ref = F.conv2d(xr, w, stride=stride, padding=0 if padding == "valid" else padding)
    ref = ref + conv.bias.detach().double().view(1, -1, 1, 1)
    assert_close(y, ref, None, torch.float64, "out")
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(y, [x, conv.weight], g)
    rx, rw = torch.autograd.grad(ref, [xr, w], g)
    assert_close(dx, rx, None, torch.float64, "dx")
    bs = conv.block_size
    for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
        assert_close(dw[n], rw[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs], None, torch.float64, f"dW[{n}]")


def test_conv2d_state_dict_meta_init_and_layouts():
    a = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.5, seed=1)
    b = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.5, seed=2)
    assert (a.block_layout() != b.block_layout()).any()
    b.load_state_dict(a.state_dict())                     # same block count: b adopts a's layout
    x = torch.randn(2, 16, 6, 6)
    torch.testing.assert_close(b(x), a(x))
    c = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.25, seed=1)
    with pytest.raises(RuntimeError, match="the checkpoint's layout has shape"):
        c.load_state_dict(a.state_dict())
    m = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.5, seed=1, device="meta")
    assert m._rows.is_meta and m._gather.is_meta                  # every table where the layer was built
    m.to_empty(device="cpu")
    m.reset_parameters()                                          # tables and layout rebuilt, not garbage
    bound = 1 / (m.fan_in()[0] ** 0.5)
    assert m.weight.abs().max() <= bound and m.weight.std() > bound / 4
    assert (m.layout.numpy() == m.block_layout()).all()
    m.load_state_dict(a.state_dict())
    torch.testing.assert_close(m(x), a(x))
    loaded = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.5, seed=1, device="meta")
    loaded.to_empty(device="cpu")                                 # garbage tables, then a load without reset
    loaded.load_state_dict(a.state_dict())
    torch.testing.assert_close(loaded(x), a(x))
    assigned = BlockSparseConv2d(16, 16, 3, block_size=4, density=0.5, seed=1, device="meta")
    assigned.load_state_dict(a.state_dict(), assign=True)
    torch.testing.assert_close(assigned(x), a(x))
    assert dict(block_sparse_layouts(torch.nn.Sequential(a)))["0"] is a.block_layout()
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockSparseConv2d(15, 16, 3, block_size=4, density=0.5)
    with pytest.raises(ValueError, match="padding: expected 'same'"):
        BlockSparseConv2d(16, 16, 3, padding="full", block_size=4, density=0.5)
    with pytest.raises(ValueError, match=r"x: expected \(N, 16, H, W\)"):
        a(torch.randn(2, 8, 6, 6))


def test_compile_fullgraph_through_a_sparse_resnet():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = SparseResNet(widths="16,32", density=0.5, block_size=8, classes=5).eval()
    x = torch.randn(2, 3, 16, 16)
    explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 0
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), m(x))


@pytest.mark.parametrize("layout", ["balanced", "grouped"])
def test_resnet_shapes_layouts_and_parameters(layout):
    torch.manual_seed(0)
    sparse = SparseResNet(widths="32,64", density=0.25, block_size=8, layout=layout, classes=7)
    dense = SparseResNet(widths="32,64", density=1, classes=7)
    x = torch.randn(3, 3, 16, 16)
    assert sparse(x).shape == dense(x).shape == (3, 7)
    lays = dict(block_sparse_layouts(sparse))
    assert len(lays) == 5 and all(abs(lay.mean() - 0.25) < 0.05 for lay in lays.values())
    if layout == "grouped":
        first = lays["stages.0.conv1"]
        assert (first == np.kron(np.eye(4, dtype=bool), np.ones((1, 1), bool))).all()
    conv_params = lambda m: sum(p.numel() for n, p in m.named_parameters() if "conv" in n or "short.0" in n)  # noqa
    assert conv_params(sparse) == pytest.approx(0.25 * conv_params(dense), rel=0.01)


@pytest.mark.parametrize("kwargs,match", [
    (dict(widths="32,x"), "model.widths: expected comma-separated"),
    (dict(widths="30,64", density=0.5, block_size=8), "multiples of block_size=8"),
    (dict(density=0), "model.density"),
    (dict(layout="ring"), "model.layout"),
    (dict(widths="32,64", density=0.25, block_size=16, layout="grouped"), "x 4 groups"),
    (dict(widths="32,64", density=0.4, block_size=8, layout="grouped"), "layout=grouped takes 1/groups"),
    (dict(widths="32,64", density=0.9, block_size=8, layout="grouped"), "layout=grouped takes 1/groups"),
])
def test_resnet_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseResNet(**kwargs)


def _cfg(tmp_path, run, **over):
    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["config=convnet_tiny"])
    with open_dict(cfg):
        cfg.model.update(widths="16,32", block_size=8, density=0.5)
        cfg.data.update(batch_size=16, synthetic_size=200)
        cfg.trainer.update(max_steps=8, eval_every=4, ckpt_every=4, eval_batches=2, log_every=2, progress=False,
                           run_dir=str(tmp_path / run), device="cpu")
        cfg.optim.warmup_steps = 2
        for k, v in over.items():
            cfg.trainer[k] = v
    return cfg


def test_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """convnet_tiny, shrunk: the loss falls, and a run killed after its step-4 checkpoint resumes
    onto the same loss curve."""
    full = train(_cfg(tmp_path, "full"))
    hist = dict(full["history"])
    assert hist[8] < hist[2]
    second = killed_then_resumed(monkeypatch, lambda resume: _cfg(tmp_path, "split", **({"resume": True} if resume
                                                                                           else {})), kill_at=4)
    got = dict(second["history"])
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(hist[step], rel=1e-5), step


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv2d_on_cuda_against_float64(backend, dtype, channels_last, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)      # fp32 is compared as fp32, not TF32
    torch.manual_seed(fresh_seed())
    conv = BlockSparseConv2d(64, 96, 3, 1, "same", block_size=16, density=0.3, backend=backend)
    x = torch.randn(4, 64, 12, 12)
    w64, b64 = masked_dense(conv), conv.bias.detach().double()
    ref = F.conv2d(x.double(), w64, padding=1) + b64.view(1, -1, 1, 1)
    conv = conv.to(device="cuda", dtype=dtype)
    xc = x.to("cuda", dtype)
    if channels_last:
        xc = xc.to(memory_format=torch.channels_last)
    xc.requires_grad_()
    y = conv(xc)
    assert_close(y, ref, None, dtype, "out")
    g = torch.randn_like(ref)
    dx, = torch.autograd.grad(y, [xc], g.to("cuda", dtype))
    xr = x.double().requires_grad_()
    rdx, = torch.autograd.grad(F.conv2d(xr, w64, padding=1), [xr], g)
    assert_close(dx, rdx, None, dtype, "dx")


def test_shuffle_keeps_channels_last():
    from bstrain.models.convnet import _Shuffle
    x = torch.randn(2, 12, 3, 5)
    want = _Shuffle(3)(x)
    got = _Shuffle(3)(x.to(memory_format=torch.channels_last))
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_resnet_under_bf16_autocast_takes_the_kernels(monkeypatch):
    """On CUDA the ResNet runs channels-last, and under bf16 autocast its stride-1 sparse convs
    with blocks of 64 take the Triton kernels; the loss matches the fp32 NCHW model's."""
    import bstrain.nn.conv as conv_mod
    calls = []
    real = conv_mod.sparse_conv2d
    monkeypatch.setattr(conv_mod, "sparse_conv2d", lambda *a: calls.append(a[0].dtype) or real(*a))
    torch.manual_seed(fresh_seed())
    model = SparseResNet(widths="64,128", depth=1, density=0.25, block_size=64, classes=10).cuda()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), labels)
    loss.backward()
    assert calls and set(calls) == {torch.bfloat16}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    calls.clear()
    with torch.no_grad():
        ref = F.cross_entropy(model(x), labels)                 # fp32: the masked dense filter
    assert not calls
    assert abs(loss.item() - ref.item()) < 0.05 * max(1.0, ref.item())
