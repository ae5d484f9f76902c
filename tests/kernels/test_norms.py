"""The general layer-norm kernel (axis 0/1, segments, ReLU) against float64 references."""
from __future__ import annotations

import pytest
import torch

from bstrain.ops.norms import layer_norm_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes

kernels = pytest.importorskip("bstrain.kernels.norms")


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("segments", (1, 4), ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("relu", (False, True), ids=["norelu", "relu"])
def test_layer_norm_kernel(dtype, axis, segments, relu):
    dev = kernel_device()
    c, n = 4 * 37, 23                                   # ragged segment size and group count
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) * 3 + 1).to(dtype)
    g, b = torch.randn(c, device=dev).to(dtype), torch.randn(c, device=dev).to(dtype)
    y, mean, rstd = kernels.layer_norm_forward(x, g, b, axis, 1e-6, relu, segments)
    x64, g64, b64 = (t.double().cpu().requires_grad_() for t in (x, g, b))
    ref = layer_norm_ref(x64, g64, b64, axis, 1e-6, relu, segments)
    assert_close(y, ref, layer_norm_ref(x, g, b, axis, 1e-6, relu, segments), dtype, "y")
    dy = torch.randn_like(x)
    ref.backward(dy.double().cpu())
    dx, dg, db = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, axis, relu, segments)
    assert_close(dx, x64.grad, None, dtype, "dx")
    assert_close(dg, g64.grad, None, dtype, "dg")
    assert_close(db, b64.grad, None, dtype, "db")


@pytest.mark.parametrize("axis, n, block_g", [(0, 37, 32), (1, 37, 1), (1, 531, 4)],
                         ids=["axis0", "axis1-row-per-program", "axis1-4-rows"])
def test_layer_norm_loop_kernel(axis, n, block_g, monkeypatch):
    """Segments too large for one tile: the three-pass kernels, with a ragged last slice."""
    monkeypatch.setattr(kernels, "TILE", 32)
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 132)      # an H200's
    dev, dtype = kernel_device(), torch.float32
    c = 2 * 45
    x = (torch.randn((n, c) if axis == 1 else (c, n), device=dev) * 2 + 3).to(dtype)
    g, b = torch.randn(c, device=dev), torch.randn(c, device=dev)
    geometry = kernels._geometry(x, axis, 2)
    assert geometry[6] and geometry[4] == block_g, f"expected the looped kernels, {block_g} groups per program"
    for relu in (False, True):
        y, mean, rstd = kernels.layer_norm_forward(x, g, b, axis, 1e-6, relu, 2)
        x64, g64, b64 = (t.double().cpu().requires_grad_() for t in (x, g, b))
        ref = layer_norm_ref(x64, g64, b64, axis, 1e-6, relu, 2)
        assert_close(y, ref, None, dtype, "y")
        dy = torch.randn_like(x)
        ref.backward(dy.double().cpu())
        dx, dg, db = kernels.layer_norm_backward(dy, x, g, b, mean, rstd, axis, relu, 2)
        assert_close(dx, x64.grad, None, dtype, "dx")
        assert_close(dg, g64.grad, None, dtype, "dg")
        assert_close(db, b64.grad, None, dtype, "db")


def test_segment_limit_is_a_clear_error():
    x = torch.randn(2, kernels.MAX_SEGMENT * 2)
    with pytest.raises(ValueError, match="segments: the kernel handles up to"):
        kernels.layer_norm_forward(x, x[0], x[0], 1, 1e-6, False, 1)
