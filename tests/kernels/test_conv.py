"""The implicit-GEMM block-sparse convolution kernels (BlockSparseConv2d(backend="triton")) against
a float64 masked dense convolution: output, dx and dW. On CPU in Triton's interpreter (fp32,
fp16), compiled on the GPU (bf16 too)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bstrain.nn import BlockSparseConv2d
from tests.conftest import DTYPE_IDS, assert_close, fresh_seed, kernel_device, kernel_dtypes
from tests.nn.test_conv import masked_dense


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _same_pads(n, k, stride, dil):
    out = -(-n // stride)
    total = max((out - 1) * stride + (k - 1) * dil + 1 - n, 0)
    return [total // 2, total - total // 2]


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kernel,stride,dilation,padding", [(3, 1, 1, "same"), (3, 2, 1, "same"), (1, 1, 1, "valid"),
                                                             (3, 1, 2, 2), (2, 2, 1, "same")])
@pytest.mark.parametrize("channels_last", [False, True])
def test_kernels_match_the_masked_dense_conv(dtype, kernel, stride, dilation, padding, channels_last):
    torch.manual_seed(fresh_seed())
    dev = kernel_device()
    conv = BlockSparseConv2d(32, 48, kernel, stride, padding, dilation, block_size=16, density=0.5,
                             backend="triton")
    lay = conv.block_layout()
    w64, b64 = masked_dense(conv), conv.bias.detach().double()
    x = torch.randn(2, 32, 5, 4)                                       # ragged: 5 x 4 images
    conv = conv.to(device=dev, dtype=dtype)
    xd = x.to(dev, dtype)
    if channels_last:
        xd = xd.to(memory_format=torch.channels_last)
    xd.requires_grad_()
    y = conv(xd)
    xr = x.double().requires_grad_()
    if padding == "same":
        pads = _same_pads(4, kernel, stride, dilation) + _same_pads(5, kernel, stride, dilation)
        ref = F.conv2d(F.pad(xr, pads), w64, stride=stride, dilation=dilation)
    else:
        ref = F.conv2d(xr, w64, stride=stride, dilation=dilation, padding=0 if padding == "valid" else padding)
    ref = ref + b64.view(1, -1, 1, 1)
    assert_close(y, ref, None, dtype, "out")
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(y, [xd, conv.weight], g.to(dev, dtype))
    w = w64.clone().requires_grad_()
    ref2 = F.conv2d(F.pad(xr, pads) if padding == "same" else xr, w, stride=stride, dilation=dilation,
                    padding=0 if padding in ("same", "valid") else padding)
    rx, rw = torch.autograd.grad(ref2, [xr, w], g)
    assert_close(dx, rx, None, dtype, "dx")
    bs = 16
    for n, (i, j) in enumerate(zip(*np.nonzero(lay))):
        assert_close(dw[n], rw[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs], None, dtype, f"dW[{n}]")


def test_empty_rows_and_columns_of_the_layout():
    """An input block that feeds nothing gets a zero gradient; an output block with no input is
    the bias alone (both written, not left unset: outputs are poisoned under test)."""
    lay = np.zeros((3, 3), bool)
    lay[0, 0] = lay[2, 1] = lay[2, 0] = True                 # input block 1 feeds nothing; output block 2 is empty
    conv = BlockSparseConv2d(48, 48, 3, padding=1, layout=lay, block_size=16, backend="triton").to(kernel_device())
    x = torch.randn(1, 48, 5, 5, device=kernel_device(), requires_grad=True)
    y = conv(x)
    torch.testing.assert_close(y[:, 32:], conv.bias[32:].view(1, -1, 1, 1).expand(1, 16, 5, 5))
    dx, = torch.autograd.grad(y.sum(), [x])
    assert (dx[:, 16:32] == 0).all() and (dx[:, :16] != 0).any()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_opcheck_backward_strides(layout):
    """The backward op's fake strides match the kernels' (every need on one layout, both on the others)."""
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, backend="triton").to(kernel_device())
    x = torch.randn(1, 32, 3, 3, device=kernel_device())
    x = {"contiguous": x, "channels_last": x.to(memory_format=torch.channels_last),
         "transposed": x.transpose(2, 3)}[layout]
    dy = torch.randn(1, 32, 3, 3, device=kernel_device())
    needs = ((True, True), (True, False), (False, True)) if layout == "channels_last" else ((True, True),)
    for need in needs:
        torch.library.opcheck(torch.ops.bstrain.bsconv2d_bwd.default,
                              (dy, x, conv.weight.detach(), conv._tables.key, [1, 1], [1, 1], [1, 1], *need),
                              test_utils=("test_schema", "test_faketensor"))


def test_opcheck_and_compile():
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, backend="triton").to(kernel_device())
    x = torch.randn(1, 32, 4, 4, device=kernel_device())
    for bias in (conv.bias.detach(), None):
        torch.library.opcheck(torch.ops.bstrain.bsconv2d.default,
                              (x, conv.weight.detach(), bias, conv._tables.key, 32, 4, 4, [1, 1], [1, 1], [1, 1]),
                              test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(conv)(x)
    assert explained.graph_break_count == 0 and "bstrain.bsconv2d" in "".join(g.code for g in explained.graphs)


def test_the_custom_ops_name_an_unknown_layout():
    x = torch.randn(1, 16, 3, 3)
    w = torch.randn(1, 16, 16, 1, 1)
    with pytest.raises(RuntimeError, match="no block-sparse layout is registered under 'conv-nope'"):
        torch.ops.bstrain.bsconv2d(x, w, None, "conv-nope", 16, 3, 3, [1, 1], [0, 0], [1, 1])


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
def test_dw_split_or_not_lands_in_the_weight_layout(dtype):
    """conv_dw writes (nnz, out, in, kh, kw) in the asked dtype: unsplit straight from the kernel,
    split (3 ways) through fp32 partials; both against the float64 dW of the masked dense conv."""
    from bstrain.kernels import conv as K
    from bstrain.kernels import tiles
    from bstrain.kernels.conv import conv_dw
    dev = kernel_device()
    conv = BlockSparseConv2d(32, 48, (1, 3), padding=(0, 1), block_size=16, density=0.5)     # taps: 1 x 3
    assert K._dw_split(40, 16, 1, 3) == (3, 16)
    x, dy = torch.randn(2, 32, 4, 5), torch.randn(2, 48, 4, 5)
    w = masked_dense(conv).requires_grad_()
    rw, = torch.autograd.grad(F.conv2d(x.double(), w, padding=(0, 1)), [w], dy.double())
    luts = conv._tables.on(torch.device(dev)).luts
    bs = 16
    for splits in (1, 3):
        with tiles.overridden("conv", ("dw", 16, dtype.itemsize), tiles.Tile(16, 0, 4, 1)):   # 16-pixel steps: 3 of 40
            dw = conv_dw(x.to(dev, dtype), dy.to(dev, dtype), luts, 1, 3, (1, 1), (0, 1), (1, 1), dtype, splits=splits)
        assert dw.dtype == dtype and dw.shape == conv.weight.shape and dw.is_contiguous()
        for n, (i, j) in enumerate(zip(*np.nonzero(conv.block_layout()))):
            assert_close(dw[n], rw[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs], None, dtype, f"dW[{n}] splits={splits}")


def test_launches_are_planned_once_per_shape():
    """The launchers keep one plan per call shape on the layout's tables: a second fwd+bwd at a
    seen shape makes none, a new shape makes its three (fwd, dx, dW)."""
    dev = kernel_device()
    conv = BlockSparseConv2d(16, 16, 3, padding=1, block_size=16, layout=[[1]], backend="triton").to(dev)
    plans = conv._tables.on(torch.device(dev)).luts.plans
    plans.clear()
    x = torch.randn(1, 16, 2, 3, device=dev, requires_grad=True)
    conv(x).sum().backward()
    assert len(plans) == 3
    conv(x).sum().backward()
    assert len(plans) == 3
    conv(torch.randn(1, 16, 3, 2, device=dev, requires_grad=True)).sum().backward()
    assert len(plans) == 6


def test_triton_backend_input_errors(monkeypatch):
    conv = BlockSparseConv2d(32, 32, 3, block_size=16, density=0.5, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA tensor"):
            conv(torch.randn(1, 32, 4, 4))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TypeError, match=r"x: expected torch.float32 \(the weight's dtype\), got torch.float64"):
        conv.to(kernel_device())(torch.randn(1, 32, 4, 4, dtype=torch.float64, device=kernel_device()))
    with pytest.raises(TypeError, match="backend='triton' takes float16, bfloat16 or float32, got torch.float64"):
        conv.to(kernel_device(), torch.float64)(torch.randn(1, 32, 4, 4, dtype=torch.float64, device=kernel_device()))
    with pytest.raises(ValueError, match="the Triton kernels take 16, 32, 64 or 128"):
        BlockSparseConv2d(24, 24, 3, block_size=8, density=0.5, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("hw,dilation", [((16, 16), 1), ((9, 13), 2)])
def test_kernels_on_cuda_per_block_size(bs, dtype, tma, hw, dilation, monkeypatch):
    """Compiled kernels at every block size, channels-last stride 1 (the TMA kernels, or the
    pointer-load ones forced), ragged images, against the float64 masked dense conv."""
    from bstrain.kernels import conv as K
    monkeypatch.setattr(K, "USE_TMA", tma)
    torch.manual_seed(fresh_seed())
    C = 2 * bs if bs >= 64 else 128
    conv = BlockSparseConv2d(C, C, 3, 1, "same", dilation, block_size=bs, density=0.5, backend="triton")
    lay = conv.block_layout()
    w64, b64 = masked_dense(conv), conv.bias.detach().double()
    x = torch.randn(3, C, *hw)
    conv = conv.to(device="cuda", dtype=dtype)
    xd = x.to("cuda", dtype).to(memory_format=torch.channels_last).requires_grad_()
    y = conv(xd)
    xr = x.double().requires_grad_()
    w = w64.clone().requires_grad_()
    ref = F.conv2d(xr, w, padding=dilation, dilation=dilation)
    assert_close(y, ref + b64.view(1, -1, 1, 1), None, dtype, "out")
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(y, [xd, conv.weight], g.to("cuda", dtype))
    rx, rw = torch.autograd.grad(ref, [xr, w], g)
    assert_close(dx, rx, None, dtype, "dx")
    for n, (i, j) in enumerate(zip(*np.nonzero(lay))):
        assert_close(dw[n], rw[j * bs:(j + 1) * bs, i * bs:(i + 1) * bs], None, dtype, f"dW[{n}]")


def test_auto_backend_choice():
    """auto: the masked dense filter on CPU and for fp32, NCHW or strided CUDA inputs."""
    conv = BlockSparseConv2d(128, 128, 3, block_size=64, density=0.25)
    assert conv._path(torch.randn(1, 128, 4, 4).to(memory_format=torch.channels_last)) == "dense"
    assert BlockSparseConv2d(128, 128, 3, block_size=64, density=0.25, backend="grouped")._path(
        torch.randn(1, 128, 4, 4)) == "grouped"


@pytest.mark.gpu
def test_auto_backend_takes_the_kernels_on_cuda():
    conv = BlockSparseConv2d(128, 128, 3, block_size=64, density=0.25).to("cuda", torch.bfloat16)
    x = torch.randn(2, 128, 8, 8, device="cuda", dtype=torch.bfloat16)
    assert conv._path(x.to(memory_format=torch.channels_last)) == "triton"
    assert conv._path(x) == "dense" and conv._path(x.float()) == "dense"
    strided = BlockSparseConv2d(128, 128, 3, 2, block_size=64, density=0.25).to("cuda", torch.bfloat16)
    assert strided._path(x.to(memory_format=torch.channels_last)) == "dense"
    small = BlockSparseConv2d(128, 128, 3, block_size=32, density=0.5).to("cuda", torch.bfloat16)
    assert small._path(x.to(memory_format=torch.channels_last)) == "dense"
    diagonal = BlockSparseConv2d(128, 128, 3, block_size=32, layout=np.eye(4)).to("cuda", torch.bfloat16)
    assert diagonal._path(x) == "grouped"                   # cuDNN's grouped conv, no gather or scatter


@pytest.mark.parametrize("backend", ["triton", "dense"])
def test_autocast_runs_in_the_autocast_dtype(backend):
    """Under torch.autocast an fp32 layer runs in the autocast dtype (the kernels take x and the
    weight cast alike), the output and its bias stay in that dtype, and the fp32 weight gets
    its gradient."""
    torch.manual_seed(fresh_seed())
    dev = kernel_device()
    dt = torch.float16 if backend == "triton" else torch.bfloat16   # bf16 tl.dot is wrong in the interpreter
    conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5, backend=backend).to(dev)
    x = torch.randn(2, 32, 6, 5, device=dev)
    with torch.autocast(dev, dtype=dt):
        y = conv(x)
    assert y.dtype == dt
    ref = F.conv2d(x.double().cpu(), masked_dense(conv), padding=1) + conv.bias.detach().double().cpu().view(1, -1, 1, 1)
    assert_close(y, ref, None, dt, "out")
    y.float().sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.dtype == torch.float32
