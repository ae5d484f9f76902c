"""torch.compile(fullgraph=True) as research code uses it: attention (the module and the seed op)
with dynamic shapes and with soft-capping and ALiBi values that change between calls (a new value
recompiles, or runs one symbolic graph), on both backends; BlockSparseLinear and
BlockSparseConv2d with dynamic shapes. Compiled outputs and gradients equal eager ones."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from bstrain import layout as L
from bstrain.nn import BlockSparseAttention, BlockSparseConv2d, BlockSparseLinear
from bstrain.ops.transformer import BlocksparseTransformer, alibi_slopes

DYNAMIC = [None, True]                  # None: torch.compile's default (a value that changes turns symbolic)
DYNAMIC_IDS = ["default", "dynamic"]


def _compiled(fn, dynamic: bool | None):
    """A fresh fullgraph compile of ``fn``, with its counter of compiled frames (dynamo's graph run
    as it is: the failures were dynamo's; a compile's seconds go to tracing)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=dynamic), counter


def _same(compiled, eager, inputs: tuple, *args) -> None:
    """Outputs, and the gradients of ``inputs`` and of any parameter, compiled against eager."""
    got, want = compiled(*inputs, *args), eager(*inputs, *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _qkv(B=2, T=64, H=2, D=16):
    return tuple(torch.randn(B, T, H * D, requires_grad=True) for _ in range(3))


def _layout():
    return L.attention_layout(L.causal_mask, 64, 64, 16)     # (layout, mask_callback)


# --- the seed op: softcap and alibi per call ---------------------------------------------------------
@pytest.mark.parametrize("dynamic", DYNAMIC, ids=DYNAMIC_IDS)
@pytest.mark.parametrize("arg, values", [("softcap", (3.0, 5.0)), ("alibi", ([0.5, 0.25], [0.125, 0.0625]))],
                         ids=["softcap", "alibi"])
def test_seed_op_takes_new_softcap_and_alibi_values(arg, values, dynamic):
    """op.attention(..., softcap=c) (or alibi=slopes) with c an argument of the compiled function:
    a second value, a SymFloat once dynamo makes it dynamic, recompiles or runs the symbolic
    graph; a bad value still raises."""
    lay, cb = _layout()
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb, backend="torch")

    def f(q, k, v, value):      # (not **{arg: value}: a value put in a dict is specialised, never symbolic)
        return op.attention(q, k, v, softcap=value) if arg == "softcap" else op.attention(q, k, v, alibi=value)
    compiled, counter = _compiled(f, dynamic)
    for value in values:
        _same(compiled, f, _qkv(), value)
    assert counter.frame_count <= 2
    bad, match = (-1.0, "softcap: expected a positive finite") if arg == "softcap" else \
        ([0.5, float("nan")], "alibi: expected finite slopes")
    with pytest.raises(Exception, match=match):
        compiled(*_qkv(), bad)


@pytest.mark.parametrize("dynamic", DYNAMIC, ids=DYNAMIC_IDS)
def test_seed_op_default_path_with_dynamic_shapes(dynamic):
    """No options, the default backend (PyTorch on the CPU): two batch sizes, one graph with
    dynamic=True (the layout tables are constants of static shape: no guard on them)."""
    lay, cb = _layout()
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb)
    compiled, counter = _compiled(lambda q, k, v: op.attention(q, k, v), dynamic)
    for B in (2, 3):
        _same(compiled, lambda q, k, v: op.attention(q, k, v), _qkv(B))
    assert counter.frame_count == (1 if dynamic else 2)       # default: a static graph, then a dynamic one


# --- the module: softcap and alibi set at construction, then changed -----------------------------------
@pytest.mark.parametrize("dynamic", DYNAMIC, ids=DYNAMIC_IDS)
def test_module_follows_changed_softcap_and_alibi(dynamic):
    """BlockSparseAttention(softcap=, alibi=True), then ``m.softcap`` set to another value and
    the ``alibi_slopes`` buffer changed: the compiled module follows each (T < context too:
    the dynamic length pads)."""
    m = BlockSparseAttention.from_mask(L.causal_mask, 64, 16, heads=2, backend="torch", softcap=3.0, alibi=True)
    compiled, _ = _compiled(m, dynamic)
    _same(compiled, m, _qkv())
    m.softcap = 5.0
    _same(compiled, m, _qkv())
    m.alibi_slopes.mul_(0.5)
    _same(compiled, m, _qkv(T=48))
    m.alibi_slopes = torch.tensor(alibi_slopes(2)[::-1])
    _same(compiled, m, _qkv(T=48))


# --- the kernels' backend (Triton's interpreter on the CPU: one case each) -------------------------------
@pytest.mark.triton
def test_triton_backend_dynamic_with_changing_softcap(monkeypatch):
    """backend='triton' with dynamic=True: the seed op with a softcap argument, two values and an
    ALiBi tensor; the module with softcap set (its changes: the PyTorch backend's test above)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lay, cb = _layout()
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb, backend="triton")
    slopes = torch.tensor(alibi_slopes(2))

    def f(q, k, v, softcap):
        return op.attention(q, k, v, softcap=softcap, alibi=slopes)
    compiled, _ = _compiled(f, True)
    for softcap in (3.0, 5.0):
        _same(compiled, f, _qkv(), softcap)
    m = BlockSparseAttention(lay, 16, heads=2, mask_callback=cb, backend="triton", softcap=3.0)
    _same(_compiled(m, True)[0], m, _qkv())


# --- the block-sparse layers with dynamic shapes ----------------------------------------------------------
@pytest.mark.parametrize("make, shapes", [
    (lambda: BlockSparseLinear(64, 32, block_size=16, density=0.5, seed=1), [(3, 64), (5, 64)]),
    (lambda: BlockSparseConv2d(16, 16, 3, padding=1, block_size=8, density=0.5, seed=1),
     [(2, 16, 8, 6), (3, 16, 6, 10)]),
], ids=["linear", "conv2d"])
def test_layers_compile_with_dynamic_shapes(make, shapes):
    """dynamic=True: new batch (and spatial) sizes run one graph; outputs, input and weight
    gradients as eager."""
    torch.manual_seed(0)
    layer = make()
    compiled, counter = _compiled(layer, True)
    for shape in shapes:
        x = torch.randn(*shape, requires_grad=True)
        got, want = compiled(x), layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(want)
        inputs = (x, layer.weight)
        for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
