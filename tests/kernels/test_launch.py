"""Launch plans: a kernel compiled once per specialisation, then launched directly."""
from __future__ import annotations

import pytest
import torch

from bstrain.kernels import launch
from bstrain.kernels import matmul as kernels
from bstrain.kernels.ew import lstm_gates_forward
from bstrain.kernels.matmul_luts import make_luts
from bstrain.kernels.norms import layer_norm_forward
from bstrain.ops.ew import fused_lstm_gates_ref
from bstrain.ops.norms import layer_norm_ref
from tests.conftest import assert_close, dense_weight, fresh_seed, kernel_device, ragged_layout


def test_plan_cache_is_bounded_and_keyed(monkeypatch):
    monkeypatch.setattr(launch, "MAX_PLANS", 3)
    cache, made = {}, []
    for key in (1, 2, 1, 3, 4, 1):
        launch.plan(cache, key, lambda: made.append(key) or key)
    assert made == [1, 2, 3, 4, 1] and len(cache) == 3     # 1 was evicted by 4, then made again


def test_constexpr_parameters_must_come_last():
    import triton
    import triton.language as tl

    @triton.jit
    def bad(X, N: tl.constexpr, Y):
        pass
    with pytest.raises(TypeError, match="constexpr parameters must come last"):
        launch.Launch(bad, (1,), torch.device("cpu"), {"N": 4})


def test_aligned_bits():
    t = torch.zeros(64)
    assert launch.aligned(t, t[1:], t[4:]) == 0b101


@pytest.mark.gpu
def test_repeated_launches_take_fresh_arguments():
    """The first call of a plan goes through the JIT, later ones launch directly: each result is
    checked against float64 with fresh inputs, including a misaligned view after aligned calls."""
    dev = kernel_device()
    lay = ragged_layout(6, 5, seed=fresh_seed())
    luts = make_luts(lay, 32, dev)
    before = launch.stats["direct"]
    for step in range(4):
        base = torch.randn(70, 6 * 32 + 8, device=dev)
        x = base[:, 1:6 * 32 + 1] if step == 3 else base[:, :6 * 32]   # the last one: not 16-byte aligned
        w = torch.randn(luts.nnz, 32, 32, device=dev)
        dy = torch.randn(70, 5 * 32, device=dev)
        wd = dense_weight(lay, w)
        xd, dyd = x.double().cpu(), dy.double().cpu()
        assert_close(kernels.bsmm_forward(x, w, luts), xd @ wd, None, torch.float32, "y")
        assert_close(kernels.bsmm_dx(dy, w, luts), dyd @ wd.t(), None, torch.float32, "dx")
        dw = kernels.bsmm_dw(x, dy, luts)
        assert_close(dense_weight(lay, dw), (xd.t() @ dyd) * (wd != 0), None, torch.float32, "dw")
        g, b = torch.randn(96, device=dev), torch.randn(96, device=dev)
        xl = torch.randn(33, 96, device=dev)
        y, _, _ = layer_norm_forward(xl, g, b, 1, 1e-5, True, 3)
        assert_close(y, layer_norm_ref(*(t.double().cpu() for t in (xl, g, b)), 1, 1e-5, True, 3), None,
                     torch.float32, "layer norm")
        h, c = torch.randn(9, 4 * 40, device=dev), torch.randn(9, 40, device=dev)
        got = lstm_gates_forward(c, *h.chunk(4, 1))
        want = fused_lstm_gates_ref(c.double().cpu(), *h.double().cpu().chunk(4, 1))
        for a, r in zip(got, want):
            assert_close(a, r, None, torch.float32, "gates")
    assert launch.stats["direct"] > before, "the direct launch path was never taken"


def _small(dev="cpu"):
    lay = ragged_layout(3, 3, seed=fresh_seed())
    return lay, make_luts(lay, 16, dev)


def test_plans_keep_no_argument_tensor_alive():
    import gc
    import weakref
    lay, luts = _small(kernel_device())
    x = torch.randn(40, 48, device=kernel_device())
    dy = torch.randn(40, 48, device=kernel_device())
    w = torch.randn(luts.nnz, 16, 16, device=kernel_device())
    refs = [weakref.ref(x), weakref.ref(dy), weakref.ref(w)]
    kernels.bsmm_dw(x, dy, luts)
    kernels.bsmm_forward(x, w, luts)
    kernels.bsmm_dx(dy, w, luts)
    del x, dy, w
    gc.collect()
    assert all(r() is None for r in refs), "a launch plan holds an argument tensor"


def test_plan_keys_cover_tf32_and_the_dw_output_pointer():
    dev = kernel_device()
    lay, luts = _small(dev)
    x, dy = torch.randn(8, 48, device=dev), torch.randn(8, 48, device=dev)
    w = torch.randn(luts.nnz, 16, 16, device=dev)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = flag
            kernels.bsmm_forward(x, w, luts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert len(luts.fwd.plans) == 2, "the TF32 setting must select its own plan"
    buf = torch.empty(luts.nnz * 256 + 1, device=dev)
    n = luts.nnz * 256
    for out in (buf[:n].view(-1, 16, 16), buf[1:].view(-1, 16, 16)):       # 16-byte aligned, then not
        got = kernels.bsmm_dw(x, dy, luts, out=out)
        want = (x.double().cpu().t() @ dy.double().cpu()) * (dense_weight(lay, torch.ones_like(w)) != 0)
        assert_close(dense_weight(lay, got), want, None, torch.float32, "dw")
    assert len(luts.dw_plans) == 2, "the output's alignment must select its own plan"
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        kernels.bsmm_dw(x, dy, luts, out=torch.empty(16, luts.nnz, 16, device=dev).transpose(0, 1))


def test_graph_plans_context_nests_and_restores():
    from bstrain.kernels.launch import _GRAPH_PLANS, graph_plans
    assert _GRAPH_PLANS[0] is False
    with graph_plans():
        with graph_plans():
            assert _GRAPH_PLANS[0] is True
        assert _GRAPH_PLANS[0] is True
    assert _GRAPH_PLANS[0] is False
    with pytest.raises(RuntimeError), graph_plans():
        raise RuntimeError
    assert _GRAPH_PLANS[0] is False
