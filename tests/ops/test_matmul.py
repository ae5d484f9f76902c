"""BlocksparseMatMul: the seed API, autograd on both backends, initialisers and input checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain import layout as layouts
from bstrain.ops.matmul import BlocksparseMatMul, bsmm_ref
from tests.conftest import (DTYPE_IDS, assert_close, dense_weight, fresh_seed, kernel_device, kernel_dtypes,
                            ragged_layout, torch_mm)


def rows(t, axis):
    return (t if axis == 1 else t.t()).double().cpu()


def reference_grads(op, x, w, dy):
    """float64 dense y, dx and per-block dw."""
    wd = dense_weight(op.layout, w)
    xr, dyr = rows(x, op.feature_axis), rows(dy, op.feature_axis)
    full = xr.t() @ dyr
    c_idx, k_idx = np.nonzero(op.layout)
    cb, kb = op.layout.shape
    bs = op.block_size
    return xr @ wd, dyr @ wd.t(), full.reshape(cb, bs, kb, bs)[c_idx, :, k_idx, :], wd


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("bs", (8, 32, 64), ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
def test_autograd_matches_reference(backend, dtype, bs, axis):
    op = BlocksparseMatMul(ragged_layout(3, 5, seed=fresh_seed()), bs, axis, backend=backend)
    dev = kernel_device()
    x = torch.randn(op.i_shape(29), device=dev).to(dtype).requires_grad_()
    w = (torch.randn(op.w_shape, device=dev) / bs**0.5).to(dtype).requires_grad_()
    y = op(x, w)
    assert y.shape == op.o_shape(29) and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_y, ref_dx, ref_dw, wd = reference_grads(op, x, w, dy)
    xr, dyr = rows(x, axis), rows(dy, axis)
    assert_close(rows(y, axis), ref_y, torch_mm(xr, wd, dtype), dtype, "y")
    assert_close(rows(x.grad, axis), ref_dx, torch_mm(dyr, wd.t(), dtype), dtype, "dx")
    cb, kb = op.layout.shape
    c_idx, k_idx = np.nonzero(op.layout)
    base_dw = torch_mm(xr.t(), dyr, dtype).reshape(cb, bs, kb, bs)[c_idx, :, k_idx, :]
    assert_close(w.grad, ref_dw, base_dw, dtype, "dw")


@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
def test_gradcheck_cpu_float64(axis):
    op = BlocksparseMatMul(ragged_layout(3, 4, seed=3), 8, axis, backend="torch")
    x = torch.randn(op.i_shape(5), dtype=torch.float64, requires_grad=True)
    w = torch.randn(op.w_shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op, (x, w))


@pytest.mark.triton
def test_two_weights_share_one_layout():
    backend = "triton"
    op = BlocksparseMatMul(layouts.random((4, 4), 0.5, seed=0), 16, backend=backend)
    dev = kernel_device()
    x = torch.randn(op.i_shape(20), device=dev)
    w1, w2 = torch.randn(op.w_shape, device=dev), torch.randn(op.w_shape, device=dev)
    y1, y2 = op(x, w1), op(x, w2)
    for w, y in ((w1, y1), (w2, y2)):
        wd = dense_weight(op.layout, w)
        assert_close(y, x.double().cpu() @ wd, torch_mm(x.double().cpu(), wd, torch.float32), torch.float32)
    assert op.luts(dev) is op.luts(dev), "lookup tables must be built once per device"
    assert op._tables.on(dev) is op._tables.on(dev)


@pytest.mark.triton
def test_master_weights_fp32_with_fp16_activations():
    op = BlocksparseMatMul(layouts.random((3, 3), 0.7, seed=1), 16, backend="triton")
    dev = kernel_device()
    x = torch.randn(op.i_shape(17), device=dev).half().requires_grad_()
    w = torch.randn(op.w_shape, device=dev, requires_grad=True)               # fp32 master
    y = op(x, w, dw_dtype=torch.float32)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float16
    _, _, ref_dw, _ = reference_grads(op, x, w.half(), torch.ones_like(y))
    assert_close(w.grad, ref_dw, None, torch.float16, "dw")


@pytest.mark.triton
@pytest.mark.parametrize("axis", (0, 1), ids=("axis0", "axis1"))
@pytest.mark.parametrize("host_bound", (True, False), ids=("cast_in_kernel", "cast_first"))
def test_autocast_fp32_activations_on_the_kernels(axis, host_bound, monkeypatch):
    """An fp32 activation that needs its gradient, under a 16-bit autocast with fp32 master
    weights: host-bound eager calls hand it to the kernels as it is (they cast its tiles) and get
    its gradient in fp32 from the dX kernel; larger calls cast it first. Both give what the
    product of the cast operands gives, gradients included (bf16: on the GPU; the interpreter's
    bf16 dot is wrong)."""
    from bstrain.kernels import launch
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    monkeypatch.setattr(launch, "host_bound", lambda rows, limit, t: host_bound)
    op = BlocksparseMatMul(layouts.random((3, 4), 0.6, seed=fresh_seed()), 16, feature_axis=axis, backend="triton")
    dev = kernel_device()
    x = torch.randn(op.i_shape(19), device=dev, requires_grad=True)              # fp32
    w = torch.randn(op.w_shape, device=dev, requires_grad=True)                  # fp32 master
    dy = torch.randn(op.o_shape(19), device=dev).to(dtype)
    with torch.autocast(dev, dtype=dtype):
        y = op(x, w)
    assert y.dtype == dtype
    y.backward(dy)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    xc, wc = x.detach().to(dtype), w.detach().to(dtype)                          # what autocast computes on
    ref_y, ref_dx, ref_dw, _ = reference_grads(op, xc, wc, dy)
    assert_close(rows(y, axis), ref_y, None, dtype, "y")
    assert_close(rows(x.grad, axis), ref_dx, None, dtype, "dx")
    assert_close(w.grad, ref_dw, None, dtype, "dw")


def test_cpu_fallback_never_builds_dense():
    """A 65536 x 65536 weight at 1e-4 density: a dense path would need 17 GB."""
    lay = np.zeros((2048, 2048), dtype=bool)
    rng = np.random.default_rng(0)
    lay[rng.integers(0, 2048, 400), rng.integers(0, 2048, 400)] = True
    op = BlocksparseMatMul(lay, 32, backend="torch")
    x = torch.randn(op.i_shape(3), requires_grad=True)
    w = torch.randn(op.w_shape, requires_grad=True)
    y = op(x, w)
    y.sum().backward()
    c, k = op.block_coord(0)
    expect = x[:, c * 32:(c + 1) * 32] @ w[0] if op.layout[:, k].sum() == 1 else None
    if expect is not None:
        torch.testing.assert_close(y[:, k * 32:(k + 1) * 32], expect)
    assert w.grad.shape == op.w_shape


def test_shapes_and_block_coord():
    lay = np.array([[1, 0, 1], [0, 1, 0]])
    op = BlocksparseMatMul(lay, 8, feature_axis=0)
    assert op.w_shape == (3, 8, 8)
    assert op.i_shape(5) == (16, 5) and op.o_shape(5) == (24, 5)
    assert [op.block_coord(i) for i in range(3)] == [(0, 0), (0, 2), (1, 1)]
    op1 = BlocksparseMatMul(lay, 8, feature_axis=1)
    assert op1.i_shape(5) == (5, 16) and op1.o_shape(5) == (5, 24)


@pytest.mark.parametrize("axis", (0, 1))
def test_identity_init_is_identity(axis):
    lay = layouts.random((4, 4), 0.4, seed=2) | np.eye(4, dtype=bool)
    op = BlocksparseMatMul(lay, 16, feature_axis=axis)
    w = op.identity_init()
    assert w.dtype == torch.float32 and w.device.type == "cpu"
    x = torch.randn(op.i_shape(6))
    torch.testing.assert_close(op(x, w), x)
    torch.testing.assert_close(op(x, op.identity_init(0.5)), 0.5 * x)      # the seed's scale, positional


@pytest.mark.parametrize("shape", [(2, 6), (6, 2), (3, 5)])
def test_identity_init_tiles_non_square_layouts(shape):
    """The seed's rule: block (c, k) gets scale·eye when c % KB == k % CB."""
    cb, kb = shape
    op = BlocksparseMatMul(np.ones(shape), 8)
    dense = op.to_dense(op.identity_init(scale=2.0))
    want = torch.zeros(cb * 8, kb * 8)
    for c in range(cb):
        for k in range(kb):
            if c % kb == k % cb:
                want[c * 8:(c + 1) * 8, k * 8:(k + 1) * 8] = 2.0 * torch.eye(8)
    torch.testing.assert_close(dense, want)
    with pytest.raises(TypeError, match="scale: expected a number"):
        op.identity_init(True)


def test_dense_round_trip_and_gradient():
    lay = ragged_layout(3, 5, seed=fresh_seed())
    op = BlocksparseMatMul(lay, 8)
    w = torch.randn(op.w_shape, dtype=torch.float64, requires_grad=True)
    dense = op.to_dense(w)
    torch.testing.assert_close(dense, dense_weight(lay, w))
    torch.testing.assert_close(op.from_dense(dense), w)
    x = torch.randn(4, op.C, dtype=torch.float64)
    torch.testing.assert_close(x @ dense, op(x, w))
    (x @ op.to_dense(w)).sum().backward()
    g_dense = w.grad.clone()
    w.grad = None
    op(x, w).sum().backward()
    torch.testing.assert_close(g_dense, w.grad)


def _seed_z_order_2d(x, y):
    """The seed's blocksparse.utils.z_order_2d, restated."""
    answer = 0
    for i in range(max(len(bin(x)), len(bin(y))) - 2):
        answer |= ((x & (1 << i)) << i) | ((y & (1 << i)) << (i + 1))
    return answer


def test_seed_block_order_conversion():
    """The seed numbers weight blocks in z-order of (c, k): sorted((z_order_2d(c, k), i)) gives its
    block ids. Converting a weight saved in that order gives the same function in ours."""
    lay = layouts.random((13, 9), 0.4, seed=fresh_seed())
    op = BlocksparseMatMul(lay, 8)
    cs, ks = np.nonzero(lay)
    seed_ids = np.empty(len(cs), dtype=np.int64)
    for rank, (_, i) in enumerate(sorted((_seed_z_order_2d(int(cs[i]), int(ks[i])), i) for i in range(len(cs)))):
        seed_ids[i] = rank                           # the seed's block id of our block i
    assert op.seed_order().tolist() == seed_ids.tolist()
    w = torch.randn(op.w_shape, dtype=torch.float64)
    w_seed = torch.empty_like(w)
    w_seed[torch.as_tensor(seed_ids)] = w                                  # as the seed would store it
    torch.testing.assert_close(op.from_seed_order(w_seed), w)
    torch.testing.assert_close(op.to_seed_order(w), w_seed)
    torch.testing.assert_close(op.from_seed_order(w, z_order=False), w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("axis", (0, 1), ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("lead", [(2, 3), (0,), (), (4, 0, 2)], ids=["2x3", "zero-rows", "one-row", "zero-mid"])
def test_any_rank_input(backend, axis, lead):
    """(*, C) in, (*, K) out (with feature_axis=0: (C, *) -> (K, *)), zero rows included, with gradients."""
    op = BlocksparseMatMul(ragged_layout(3, 5, seed=fresh_seed()), 16, axis, backend=backend)
    dev = kernel_device() if backend == "triton" else "cpu"
    shape = (*lead, op.C) if axis == 1 else (op.C, *lead)
    x = torch.randn(shape, device=dev, requires_grad=True)
    w = torch.randn(op.w_shape, device=dev, requires_grad=True)
    y = op(x, w)
    assert y.shape == ((*lead, op.K) if axis == 1 else (op.K, *lead))
    x2 = x.reshape(-1, op.C) if axis == 1 else x.reshape(op.C, -1).t()
    ref = x2.double().cpu() @ dense_weight(op.layout, w)
    assert_close(y.reshape(-1, op.K) if axis == 1 else y.reshape(op.K, -1).t(), ref, None, torch.float32, "y")
    dy = torch.randn_like(y)
    y.backward(dy)
    dy2 = dy.reshape(-1, op.K) if axis == 1 else dy.reshape(op.K, -1).t()
    dx_ref = dy2.double().cpu() @ dense_weight(op.layout, w).t()
    assert_close(x.grad.reshape(-1, op.C) if axis == 1 else x.grad.reshape(op.C, -1).t(), dx_ref, None,
                 torch.float32, "dx")
    if x2.shape[0] == 0:
        assert (w.grad == 0).all()


class UsesOp(torch.nn.Module):
    """A user's module calling the op directly, its weight a Parameter."""

    def __init__(self):
        super().__init__()
        self.op = BlocksparseMatMul(ragged_layout(3, 5, seed=fresh_seed()), 16)
        self.w = torch.nn.Parameter(torch.randn(self.op.w_shape))

    def forward(self, x):
        return self.op(x, self.w)


def test_compile_has_no_graph_break_and_no_recompile_per_batch_size():
    """CPU path under torch.compile(fullgraph=True): batch sizes 3..13 compile at most twice (the
    first static graph, then one dynamic one), and with dynamic=True once."""
    from torch._dynamo.utils import counters
    m = UsesOp()
    for dynamic, most in ((None, 2), (True, 1)):
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(m, fullgraph=True, dynamic=dynamic)
        for n in (3, 5, 7, 9, 11, 13):              # batch sizes that may equal layout sizes too
            x = torch.randn(n, m.op.C, requires_grad=True)
            y = f(x)
            torch.testing.assert_close(y, m(x))
            y.sum().backward()
        assert counters["stats"]["unique_graphs"] <= most, dict(counters["stats"])


def test_export_fresh_op_leaves_eager_calls_real():
    """torch.export of a never-called op, with a dynamic batch; afterwards eager calls still return
    real tensors (nothing created under tracing is cached)."""
    from torch.export import Dim, export
    m = UsesOp()
    ep = export(m, (torch.randn(4, m.op.C),), dynamic_shapes=({0: Dim("batch")},))
    x = torch.randn(9, m.op.C)
    torch.testing.assert_close(ep.module()(x), m(x))
    y = m(x)
    assert type(y) is torch.Tensor and not isinstance(y, torch._subclasses.FakeTensor)
    assert all(type(t) is torch.Tensor for t in (*m.op._ref_coords(x.device), *m.op._tables.on(x.device).c_idx[None]))


def test_ortho_init_blocks_are_orthogonal():
    op = BlocksparseMatMul(layouts.random((3, 3), 0.6, seed=0), 32)
    w = op.ortho_init()
    eye = torch.eye(32).expand_as(w)
    torch.testing.assert_close(w.transpose(1, 2) @ w, eye, atol=1e-5, rtol=0)


def test_l2_normalize_columns_and_gain():
    lay = layouts.random((4, 3), 0.6, seed=4)
    op = BlocksparseMatMul(lay, 8)
    w = torch.randn(op.w_shape, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(op.K, dtype=torch.float64) + 0.5
    wn = op.l2_normalize(w, gain=gain)
    norms = dense_weight(lay, wn).norm(dim=0)                                 # (K,)
    live = torch.as_tensor(lay.any(0)).repeat_interleave(8)
    torch.testing.assert_close(norms[live], gain[live])
    torch.autograd.gradcheck(lambda t: op.l2_normalize(t, gain=gain), (w,))


def test_bsmm_ref_axis0_matches_axis1():
    lay = ragged_layout(3, 5, seed=7)
    c_idx, k_idx = (torch.as_tensor(v) for v in np.nonzero(lay))
    x = torch.randn(11, 48, dtype=torch.float64)
    w = torch.randn(len(c_idx), 16, 16, dtype=torch.float64)
    torch.testing.assert_close(bsmm_ref(x.t(), w, c_idx, k_idx, 80, 0), bsmm_ref(x, w, c_idx, k_idx, 80, 1).t())


# --- bad input: a clear error naming the argument, before any kernel runs ---------------------
LAY = np.array([[1, 0], [1, 1]])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(layout=LAY, block_size=48), ValueError, "block_size: expected one of"),
    (dict(layout=LAY, block_size=True), ValueError, "block_size"),
    (dict(layout=[[0, 2], [1, 1]]), ValueError, "layout: expected only 0/1"),
    (dict(layout=np.zeros((2, 2))), ValueError, "layout: expected at least one live block"),
    (dict(layout=np.ones((2, 2, 2))), ValueError, "layout: expected a 2-D"),
    (dict(layout=[["a", "b"]]), TypeError, "layout: expected a numeric"),
    (dict(layout=LAY, feature_axis=2), ValueError, "feature_axis"),
    (dict(layout=LAY, backend="cuda"), ValueError, "backend"),
])
def test_constructor_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        BlocksparseMatMul(**kwargs)


def _call(op, x, w, **kw):
    return lambda: op(x, w, **kw)


@pytest.mark.parametrize("case, exc, match", [
    ("wrong_i_shape", ValueError, r"I: expected shape \(\*, C\) with C=32"),
    ("i_3d", ValueError, "I: expected shape"),
    ("scalar", ValueError, "I: expected shape"),
    ("wrong_w_shape", ValueError, r"W: expected shape w_shape=\(3, 16, 16\)"),
    ("dtype_mismatch", TypeError, "W: expected dtype torch.float16"),
    ("int_input", TypeError, "I: expected float32"),
    ("device_mismatch", ValueError, "W: expected device cpu"),
    ("not_tensor", TypeError, "I: expected a torch.Tensor"),
    ("bad_dw_dtype", TypeError, "dw_dtype"),
])
def test_call_rejects(case, exc, match):
    op = BlocksparseMatMul(LAY, 16)
    x, w = torch.randn(4, 32), torch.randn(op.w_shape)
    call = {
        "wrong_i_shape": _call(op, torch.randn(4, 48), w),
        "i_3d": _call(op, torch.randn(4, 32, 1), w),
        "scalar": _call(op, torch.tensor(1.0), w),
        "wrong_w_shape": _call(op, x, torch.randn(2, 16, 16)),
        "dtype_mismatch": _call(op, x.half(), w.bfloat16()),
        "int_input": _call(op, x.int(), w),
        "device_mismatch": _call(op, x, w.to("meta")),
        "not_tensor": _call(op, x.numpy(), w),
        "bad_dw_dtype": _call(op, x, w, dw_dtype=torch.int32),
    }[case]
    with pytest.raises(exc, match=match):
        call()


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    op = BlocksparseMatMul(LAY, 16, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        op(torch.randn(4, 32), torch.randn(op.w_shape))


@pytest.mark.triton
def test_non_contiguous_weight_is_handled():
    """A transposed or expanded W gives the same result as its contiguous copy, on both paths."""
    lay = layouts.random((4, 4), 0.5, seed=1)
    dev = kernel_device()
    for backend in ("triton", "torch"):
        op = BlocksparseMatMul(lay, 16, backend=backend)
        w = torch.randn(op.w_shape, device=dev).transpose(1, 2)
        x = torch.randn(8, op.C, device=dev)
        torch.testing.assert_close(op(x, w), op(x, w.contiguous()))


def test_autocast_cpu_with_fp32_inputs():
    op = BlocksparseMatMul(LAY, 16)
    x, w = torch.randn(4, 32), torch.randn(op.w_shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = op(x, w)
    assert y.dtype == torch.bfloat16
    xb, wb = x.bfloat16().double(), w.bfloat16().double()               # what autocast computes on
    ref = op(xb, wb)
    assert_close(y, ref, torch_mm(xb, dense_weight(LAY, wb), torch.bfloat16), torch.bfloat16, "y")
