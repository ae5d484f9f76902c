"""The sparse ResNet: shapes, layouts, errors, torch.compile, training through the trainer with an
exact resume. BlockSparseConv2d's own tests are in tests/nn/test_conv.py."""
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
from tests.nn.test_conv import masked_dense


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
