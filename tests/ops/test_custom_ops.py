"""torch.ops.bstrain.*: registration (opcheck), fake tensors, autograd, and torch.compile through them.

On CPU the ops run their PyTorch references; on the GPU the Triton kernels. The compile tests
force the kernel path on CPU (``backend="triton"``, BSTRAIN_FORCE_TRITON) so that the traced
graph holds the custom ops, which then run their CPU references.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bstrain.ops  # noqa: F401  (registers the ops)
import bstrain.ops.tables
from bstrain.nn import BlockSparseLinear
from bstrain.ops.ew import fused_lstm_gates_ref
from bstrain.ops.matmul import BlocksparseMatMul
from bstrain.ops.norms import layer_norm_ref
from tests.conftest import assert_close, dense_weight, fresh_seed, kernel_device, ragged_layout

OPS = torch.ops.bstrain
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rand(*shape, device="cpu", dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


# --- opcheck: schema, fake tensors, autograd registration, AOT dispatch -----------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [0, 1])
def test_opcheck_bsmm_family(device, axis):
    op = BlocksparseMatMul(ragged_layout(3, 4, seed=fresh_seed()), 16, axis)
    for grad in (False, True):
        x = _rand(*op.i_shape(5), device=device, grad=grad)
        w = _rand(*op.w_shape, device=device, grad=grad)
        dy = _rand(*op.o_shape(5), device=device, grad=grad)
        torch.library.opcheck(OPS.bsmm.default, (x, w, op.key, axis, torch.float32))
        torch.library.opcheck(OPS.bsmm_dx.default, (dy, w, op.key, axis))
        torch.library.opcheck(OPS.bsmm_dw.default, (x, dy, op.key, axis, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis,relu,segments", [(1, False, 1), (1, True, 4), (0, False, 2)])
def test_opcheck_layer_norm(device, axis, relu, segments):
    shape = (6, 32) if axis == 1 else (32, 6)
    x = _rand(*shape, device=device, grad=True)
    g = (1 + 0.1 * _rand(32, device=device)).requires_grad_()
    b = _rand(32, device=device, grad=True)
    torch.library.opcheck(OPS.layer_norm.default, (x, g, b, axis, 1e-5, relu, segments))
    y, mean, rstd = OPS.layer_norm(x.detach(), g.detach(), b.detach(), axis, 1e-5, relu, segments)
    torch.library.opcheck(OPS.layer_norm_bwd.default,
                          (torch.randn_like(y), x.detach(), g.detach(), b.detach(), mean, rstd, axis, relu, segments))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_lstm_gates(device, bias):
    h = _rand(5, 4 * 16, device=device, grad=True)
    c = _rand(5, 16, device=device, grad=True)
    b = _rand(4 * 16, device=device, grad=True) if bias else None
    i, u, f, o = h.chunk(4, dim=1)
    torch.library.opcheck(OPS.lstm_gates.default, (c, i, u, f, o, b, 1.0))
    d = [torch.randn_like(c) for _ in range(2)]
    args = (c.detach(), *(t.detach() for t in (i, u, f, o)), None if b is None else b.detach())
    torch.library.opcheck(OPS.lstm_gates_bwd.default, (*args, d[0], d[1], 1.0))
    torch.library.opcheck(OPS.lstm_gates_bwd.default, (*args, None, d[1], 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_layer_norm_mul(device):
    x = _rand(6, 32, device=device, grad=True)
    g, b = (1 + 0.1 * _rand(32, device=device)).requires_grad_(), _rand(32, device=device, grad=True)
    m = _rand(6, 32, device=device, grad=True)
    torch.library.opcheck(OPS.layer_norm.default, (x, g, b, 1, 1e-5, False, 4, m))
    y, mean, rstd = OPS.layer_norm(x.detach(), g.detach(), b.detach(), 1, 1e-5, False, 4, m.detach())
    torch.library.opcheck(OPS.layer_norm_mul_bwd.default, (torch.randn_like(y), x.detach(), g.detach(), b.detach(),
                                                           m.detach(), mean, rstd, 1, 4))


def _cell_inputs(n: int, H: int, gain_spread: float, device):
    """(c, z, xg, g, b, bias) of the LSTM cell op, all requiring grad: c (n, H), the rest 4H wide."""
    c, z, xg = _rand(n, H, device=device, grad=True), _rand(n, 4 * H, device=device, grad=True), \
        _rand(n, 4 * H, device=device, grad=True)
    g = (1 + gain_spread * _rand(4 * H, device=device)).requires_grad_()
    return c, z, xg, g, _rand(4 * H, device=device, grad=True), _rand(4 * H, device=device, grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_lstm_cell(device):
    c, z, xg, g, b, bias = _cell_inputs(5, 8, 0.1, device)
    torch.library.opcheck(OPS.lstm_cell.default, (c, z, xg, g, b, bias, 1.0, 1e-6))
    _, _, mean, rstd = OPS.lstm_cell(*(t.detach() for t in (c, z, xg, g, b, bias)), 1.0, 1e-6)
    args = tuple(t.detach() for t in (c, z, xg, g, b, bias)) + (mean, rstd)
    d = torch.randn_like(c)
    torch.library.opcheck(OPS.lstm_cell_bwd.default, (*args, d, torch.randn_like(c), 1.0))
    torch.library.opcheck(OPS.lstm_cell_bwd.default, (*args, None, d, 1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual, rbias", [(True, False), (False, False), (True, True)],
                         ids=["res", "nores", "res+bias"])
def test_opcheck_add_layer_norm(device, residual, rbias):
    x = _rand(6, 40, device=device, grad=True)
    r = _rand(6, 40, device=device, grad=True) if residual else None
    c = _rand(40, device=device, grad=True) if rbias else None
    w, b = (1 + 0.1 * _rand(40, device=device)).requires_grad_(), _rand(40, device=device, grad=True)
    torch.library.opcheck(OPS.add_layer_norm.default, (x, r, c, w, b, 1e-5))
    y, h, mean, rstd = OPS.add_layer_norm(x.detach(), None if r is None else r.detach(),
                                          None if c is None else c.detach(), w.detach(), b.detach(), 1e-5)
    stream = x.detach() if r is None else h
    for dh in (None, torch.randn_like(y)):
        torch.library.opcheck(OPS.add_layer_norm_bwd.default,
                              (torch.randn_like(y), dh, stream, w.detach(), mean, rstd, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rotary_and_cross_entropy(device):
    from bstrain.ops.rotary import rotary_tables
    cos, sin = rotary_tables(7, 8, device)
    x = _rand(2, 7, 32, device=device, grad=True)
    bias = _rand(32, device=device, grad=True)
    for inverse in (False, True):
        torch.library.opcheck(OPS.rotary.default, (x, cos, sin, None, 8, 3, inverse))
        torch.library.opcheck(OPS.rotary.default, (x, cos, sin, bias, 8, 3, inverse))
        torch.library.opcheck(OPS.rotary_bwd.default, (x.detach(), cos, sin, 8, 3, inverse))
    torch.library.opcheck(OPS.bias_gelu.default, (_rand(5, 24, device=device, grad=True), bias[:24].detach()))
    torch.library.opcheck(OPS.bias_gelu_bwd.default, (_rand(5, 24, device=device), _rand(5, 24, device=device),
                                                      bias[:24].detach()))
    logits = _rand(9, 20, device=device, grad=True)
    labels = torch.randint(0, 20, (9,), device=device)
    torch.library.opcheck(OPS.softmax_xent.default, (logits, labels))
    loss, lse = OPS.softmax_xent(logits.detach(), labels)
    torch.library.opcheck(OPS.softmax_xent_bwd.default, (torch.rand_like(loss), logits.detach(), labels, lse))


# --- the ops' numbers against float64 references (CPU: the references; GPU: the kernels) ----------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [0, 1])
def test_bsmm_ops_and_their_gradients_match_float64(device, axis):
    op = BlocksparseMatMul(ragged_layout(4, 3, seed=fresh_seed()), 16, axis)
    x, w = _rand(*op.i_shape(7), device=device, grad=True), _rand(*op.w_shape, device=device, grad=True)
    y = OPS.bsmm(x, w, op.key, axis, torch.float32)
    wd = dense_weight(op.layout, w.detach())
    xr = (x if axis == 1 else x.t()).detach().double().cpu()
    yr = y if axis == 1 else y.t()
    assert_close(yr, xr @ wd, None, torch.float32, "y")
    dy = torch.randn_like(y)
    dyr = (dy if axis == 1 else dy.t()).double().cpu()
    (dx, dw) = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    assert_close(dx if axis == 1 else dx.t(), dyr @ wd.t(), None, torch.float32, "dx")
    mask = dense_weight(op.layout, torch.ones_like(w)) != 0
    assert_close(dense_weight(op.layout, dw.detach()), (xr.t() @ dyr) * mask, None, torch.float32, "dw")
    # second order, through the registered gradients of bsmm_dx and bsmm_dw: d/dw of <dx, g>
    g = torch.randn_like(dx)
    gw, = torch.autograd.grad(dx, w, g)
    gr = (g if axis == 1 else g.t()).double().cpu()
    assert_close(dense_weight(op.layout, gw), (gr.t() @ dyr) * mask, None, torch.float32, "d2w")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis,relu,segments", [(1, False, 1), (1, True, 4), (0, True, 2)])
def test_layer_norm_op_matches_float64(device, axis, relu, segments):
    shape = (9, 48) if axis == 1 else (48, 9)
    x = _rand(*shape, device=device, grad=True)
    g, b = (1 + 0.2 * _rand(48, device=device)).requires_grad_(), _rand(48, device=device, grad=True)
    y, mean, rstd = OPS.layer_norm(x, g, b, axis, 1e-5, relu, segments)
    x64, g64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, g, b))
    y64 = layer_norm_ref(x64, g64, b64, axis, 1e-5, relu, segments)
    assert_close(y, y64, None, torch.float32, "y")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, g, b), dy)
    want = torch.autograd.grad(y64, (x64, g64, b64), dy.double().cpu())
    for name, a, r in zip(("dx", "dg", "db"), got, want):
        assert_close(a, r, None, torch.float32, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_lstm_gates_op_matches_float64(device, bias):
    h, c = _rand(6, 4 * 24, device=device, grad=True), _rand(6, 24, device=device, grad=True)
    b = _rand(4 * 24, device=device, grad=True) if bias else None
    cn, hn = OPS.lstm_gates(c, *h.chunk(4, dim=1), b, 1.0)
    h64, c64 = (t.detach().double().cpu().requires_grad_() for t in (h, c))
    b64 = b.detach().double().cpu().requires_grad_() if bias else None
    gates = (h64 + b64 if bias else h64).chunk(4, dim=1)
    cn64, hn64 = fused_lstm_gates_ref(c64, *gates, forget_bias=1.0)
    assert_close(cn, cn64, None, torch.float32, "new_c")
    assert_close(hn, hn64, None, torch.float32, "new_h")
    dc, dh = torch.randn_like(cn), torch.randn_like(hn)
    inputs, inputs64 = [h, c] + ([b] if bias else []), [h64, c64] + ([b64] if bias else [])
    got = torch.autograd.grad((cn, hn), inputs, (dc, dh))
    want = torch.autograd.grad((cn64, hn64), inputs64, (dc.double().cpu(), dh.double().cpu()))
    for name, a, r in zip(("dh", "dc", "dbias"), got, want):
        assert_close(a, r, None, torch.float32, name)
    # only new_c used: new_h's gradient arrives as None
    got = torch.autograd.grad(OPS.lstm_gates(c, *h.chunk(4, dim=1), b, 1.0)[0], h, dc)[0]
    want = torch.autograd.grad(fused_lstm_gates_ref(c64, *gates, forget_bias=1.0)[0], h64, dc.double().cpu())[0]
    assert_close(got, want, None, torch.float32, "dh (new_c only)")


@pytest.mark.parametrize("device", DEVICES)
def test_lstm_cell_op_matches_float64(device):
    from bstrain.ops.lstm_cell import fused_lstm_cell_ref
    c, z, xg, g, b, bias = _cell_inputs(6, 24, 0.2, device)
    args = [c, z, xg, g, b, bias]
    cn, hn, _, _ = OPS.lstm_cell(*args, 0.5, 1e-6)
    args64 = [t.detach().double().cpu().requires_grad_() for t in args]
    cn64, hn64 = fused_lstm_cell_ref(*args64, forget_bias=0.5)
    assert_close(cn, cn64, None, torch.float32, "new_c")
    assert_close(hn, hn64, None, torch.float32, "new_h")
    dc, dh = torch.randn_like(cn), torch.randn_like(hn)
    got = torch.autograd.grad((cn, hn), args, (dc, dh))
    want = torch.autograd.grad((cn64, hn64), args64, (dc.double().cpu(), dh.double().cpu()))
    for name, a, r in zip(("dc", "dz", "dxg", "dg", "db", "dbias"), got, want):
        assert_close(a, r, None, torch.float32, name)


def test_unregistered_layout_is_a_clear_error():
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="no block-sparse layout is registered"):
        OPS.bsmm(x, torch.randn(2, 16, 16), "bs16-2x2-0000", 1, torch.float32)


def test_equal_layouts_share_tables():
    lay = ragged_layout(3, 3, seed=fresh_seed())
    a, b = BlocksparseMatMul(lay, 16), BlocksparseMatMul(lay.copy(), 16)
    assert a.key == b.key and a._tables is b._tables
    assert BlocksparseMatMul(lay, 16, feature_axis=0).key == a.key        # the tables do not depend on the axis
    assert BlocksparseMatMul(lay.repeat(2, 0).repeat(2, 1), 8).key != a.key


# --- torch.compile through the ops ----------------------------------------------------------------
@pytest.fixture
def dev(monkeypatch):
    """Where the compile tests run: the GPU when there is one (the kernels inside the graph), else
    the CPU with calls routed through the kernel path, so traced graphs hold torch.ops.bstrain.*
    (which run their references on CPU; eager CPU calls run the interpreter)."""
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("BSTRAIN_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def _to_kernels(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, BlockSparseLinear):
            m.op.backend = "triton"
        if isinstance(getattr(m, "op", None), BlocksparseMatMul):
            m.op.backend = "triton"
    return model


class UsesOp(torch.nn.Module):
    """A user's module calling BlocksparseMatMul directly, with torch ops around it."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.op = BlocksparseMatMul(ragged_layout(4, 4, seed=fresh_seed()), 16)
        self.w = torch.nn.Parameter(0.1 * torch.randn(self.op.w_shape, device=device))

    def forward(self, x):
        return F.gelu(self.op(x, self.w)).sum(-1)


def _explain(fn, *args):
    out = torch._dynamo.explain(fn)(*args)
    code = "".join(g.code for g in out.graphs)
    return out.graph_break_count, out.graph_count, code


def _check_compiled(model, compiled, make_inputs, steps=3):
    """Outputs and gradients of ``steps`` fresh batches, compiled against eager."""
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(steps):
        args = make_inputs()
        want = model(*args)
        want_grads = torch.autograd.grad(want.float().sum(), params)
        got = compiled(*args)
        got_grads = torch.autograd.grad(got.float().sum(), params)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, b in zip(got_grads, want_grads):      # fp32 sums in another order: relative to the largest
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(b.abs().max())))


def _compile_counted(model, **kwargs):
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend(kwargs.pop("backend", "aot_eager"))
    return torch.compile(model, backend=counter, fullgraph=True, **kwargs), counter


@pytest.mark.triton
def test_compile_block_sparse_linear_through_custom_op(dev):
    torch._dynamo.reset()
    layer = _to_kernels(BlockSparseLinear(64, 48, block_size=16, density=0.5, seed=fresh_seed(), device=dev))
    x = torch.randn(5, 64, device=dev)
    breaks, graphs, code = _explain(layer, x)
    assert breaks == 0 and graphs == 1 and "bstrain.bsmm" in code, code
    compiled, counter = _compile_counted(layer)
    _check_compiled(layer, compiled, lambda: (torch.randn(5, 64, device=dev, requires_grad=True),))
    assert counter.frame_count == 1, "recompiled between steps"


@pytest.mark.triton
def test_compile_user_module_calling_the_op(dev):
    torch._dynamo.reset()
    m = _to_kernels(UsesOp(dev))
    breaks, _, code = _explain(m, torch.randn(3, 64, device=dev))
    assert breaks == 0 and "bstrain.bsmm" in code
    compiled, counter = _compile_counted(m)
    _check_compiled(m, compiled, lambda: (torch.randn(3, 64, device=dev),))
    assert counter.frame_count == 1


@pytest.mark.triton
def test_compile_inductor(dev):
    """The default backend (Inductor), forward and backward, with a dynamic batch."""
    torch._dynamo.reset()
    m = _to_kernels(UsesOp(dev))
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    _check_compiled(m, compiled, lambda: (torch.randn(int(torch.randint(2, 9, ())), 64, device=dev),))


@pytest.mark.triton
def test_compile_sparse_lstm_training_step(dev):
    """The mLSTM forward + loss in one graph: block-sparse matmuls, the layer norms (one with its
    fused multiplicative operand) and the fused cell as custom ops, no graph break, no
    recompilation; gradients as in eager."""
    from bstrain.models.lstm import SparseLSTM
    torch._dynamo.reset()
    model = _to_kernels(SparseLSTM(hidden=32, embed=8, block_size=16, density=0.5, depth=2)).to(dev)
    state = model.init_state(3, dev)

    def step(x, c, h):
        logits, (c, h) = model(x, (c, h))
        return F.cross_entropy(logits.reshape(-1, 256), x.reshape(-1)) + 0 * c.sum() + 0 * h.sum()
    x = torch.randint(0, 256, (3, 4), device=dev)
    breaks, _, code = _explain(step, x, *state)
    assert breaks == 0
    for name in ("bstrain.bsmm", "bstrain.layer_norm(", "bstrain.lstm_cell"):
        assert name in code, name
    steps = x.shape[1]                       # a step: LN(h·W_hm)·xm and the deep update's LN, then the cell
    assert code.count("bstrain.layer_norm(") == 2 * steps and code.count("bstrain.lstm_cell(") == steps
    compiled, counter = _compile_counted(step)

    def loss_check(fn):
        out = fn(x, *state)
        return out, torch.autograd.grad(out, list(model.parameters()))
    for _ in range(2):
        x = torch.randint(0, 256, (3, 4), device=dev)
        (a, ga), (b, gb) = loss_check(compiled), loss_check(step)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for p, q in zip(ga, gb):        # fp32 sums in another order, through 4 steps of 2 layers:
            # near-cancelling entries differ by more than 1e-4 relative (seen: 2e-4 on 1 of 4096),
            # so the whole gradient is held to 1e-4 in norm, each entry to 1e-3 of its largest
            assert float((p - q).norm()) <= 1e-4 * float(q.norm()) + 1e-12, float((p - q).norm() / q.norm())
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3 * float(q.abs().max()))
    assert counter.frame_count == 1


@pytest.mark.triton
def test_compile_transformer_fused_glue(dev):
    """The transformer with fused glue in one graph: rotary, residual + layer norm and the
    attention as custom ops, no graph break or recompilation; outputs and gradients as eager."""
    from bstrain.models.transformer import SparseTransformer
    torch._dynamo.reset()
    model = SparseTransformer(d_model=32, n_layer=2, n_head=2, context=64, block_size=16, window=16,
                              attention="strided,local", positions="rotary", backend="triton").to(dev)
    x = torch.randint(0, 256, (2, 64), device=dev)
    breaks, _, code = _explain(model, x)
    assert breaks == 0
    for name in ("bstrain.rotary", "bstrain.add_layer_norm", "bstrain.bst_attention", "bstrain.bias_gelu"):
        assert name in code, name
    assert code.count("bstrain.add_layer_norm(") == 5                   # two per block and the final norm
    assert ".cos()" not in code and ".sin()" not in code                # the rotary tables were made once, not traced
    compiled, counter = _compile_counted(model)
    _check_compiled(model, compiled, lambda: (torch.randint(0, 256, (2, 64), device=dev),), steps=2)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_on_gpu_matches_eager(mode):
    """Inductor on CUDA: the Triton kernels inside the graph, bf16 under autocast; reduce-overhead
    captures CUDA graphs through the ops (no cudagraph skips)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    layer = BlockSparseLinear(256, 256, block_size=32, density=0.3, seed=fresh_seed(), device="cuda")
    compiled = torch.compile(layer, fullgraph=True, mode=mode)
    for _ in range(4):
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, got = layer(x), compiled(x)
        gw_want = torch.autograd.grad(want.float().square().sum(), (x, layer.weight))
        gw_got = torch.autograd.grad(got.float().square().sum(), (x, layer.weight))
        assert_close(got, want, None, torch.bfloat16, "y")
        for name, a, b in zip(("dx", "dw"), gw_got, gw_want):
            assert_close(a, b, None, torch.bfloat16, name)
    assert counters["stats"]["unique_graphs"] == 1
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_copies_and_pickles_keep_their_layout_registered():
    """A deep copy (as an EMA AveragedModel makes) or an unpickled module keeps a key that names
    live tables after the original is gone."""
    import copy
    import gc
    import pickle
    layer = BlockSparseLinear(64, 48, block_size=16, density=0.5, seed=fresh_seed())
    copied, loaded = copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))
    key = layer.op.key
    del layer
    gc.collect()
    for m in (copied, loaded):
        assert m.op.key == key and bstrain.ops.tables.lookup(key) is m.op._tables
        x = torch.randn(3, 64)
        torch.testing.assert_close(OPS.bsmm(x, m.weight, key, 1, torch.float32), m(x) - m.bias)


@pytest.mark.triton
def test_public_products_check_their_arguments_before_any_kernel(monkeypatch):
    """forward_raw, dx, dw and the kernel path's size limit: clear errors, no launch."""
    from bstrain.kernels import launch
    from bstrain.ops.ew import fused_lstm_gates
    monkeypatch.setattr(launch.Launch, "__call__", lambda *a: pytest.fail("a kernel was launched"))
    op = BlocksparseMatMul(ragged_layout(3, 3, seed=fresh_seed()), 16, backend="triton")
    w = torch.randn(op.w_shape)
    with pytest.raises(ValueError, match=r"I: expected a 2-D \(N, 48\)"):
        op.forward_raw(torch.randn(4, 32), w)
    with pytest.raises(ValueError, match="W: expected shape"):
        op.forward_raw(torch.randn(4, 48), w[:-1])
    with pytest.raises(TypeError, match="W: expected torch.float16"):
        op.forward_raw(torch.randn(4, 48).half(), w)
    with pytest.raises(ValueError, match=r"dY: expected a 2-D \(N, 48\)"):
        op.dx(torch.randn(4, 32), w)
    with pytest.raises(ValueError, match=r"dY: expected a 2-D \(N, 48\)"):
        op.dw(torch.randn(4, 48), torch.randn(5, 48))
    dev = kernel_device()                          # the size check comes after the device check
    big = torch.zeros(1, 48, device=dev).expand(2**31 // 48 + 1, 48)
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1 elements"):
        op(big, w.to(dev))
    with pytest.raises(ValueError, match="c: expected a 2-D"):
        fused_lstm_gates(*(torch.randn(2, 3, 4) for _ in range(5)))
