"""BlockSparseAttention: input forms, shorter inputs, grouped-query k/v, and the research-code
survival cases (inference mode first, export, compile, batch 0, copies), against float64 dense
attention."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from bstrain import layout as L
from bstrain.nn import BlockSparseAttention
from bstrain.ops.transformer import attention_ref
from tests.conftest import assert_close, kernel_device

BACKENDS = ["torch", "triton"]       # triton: Triton's interpreter on CPU, compiled on the GPU


def _module(backend="torch", mask=None, heads=2, context=64, **kw):
    return BlockSparseAttention.from_mask(mask or L.strided_mask(16), context, 16, heads=heads, backend=backend, **kw)


def _reference(m, q, k, v, T, Tk, pad=None):
    """float64 dense attention over the layout's first T x Tk positions; (B, T, H·D) inputs."""
    mask = m.op.dense_mask()[:, :T, :Tk][None]
    if pad is not None:
        mask = mask & ~pad[:, None, None, :]
    scale = m.scale or (q.shape[-1] // m.heads) ** -0.5
    return attention_ref(q.double(), k.double(), v.double(), mask, scale)


def _grads_match(out, ref, inputs, inputs64, dtype, names=("dq", "dk", "dv")):
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, g.to(out.device, out.dtype))
    want = torch.autograd.grad(ref, inputs64, g)
    for name, a, r in zip(names, got, want):
        assert_close(a, r, None, dtype, name)


def test_shorter_inputs_seed_and_sdpa_forms():
    """T < context: the layout's first T positions, exactly; (B, T, H·D) in, same form out, and
    SDPA's (B, H, T, D) gives the same values; key padding on top of the short keys. (The
    kernels' side of it, a padding mask, is tests/kernels/test_attention.py's.)"""
    m = _module("torch", mask=L.local_mask(24, causal=False))
    dev, B, T, H, D = kernel_device(), 2, 37, 2, 8
    q, k, v = (torch.randn(B, T, H * D, device=dev, requires_grad=True) for _ in range(3))
    pad = torch.zeros(B, T, dtype=torch.bool, device=dev)
    pad[1, 30:] = True
    out = m(q, k, v, key_padding_mask=pad)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = _reference(m, q64, k64, v64, T, T, pad.cpu())
    assert out.shape == (B, T, H * D)
    assert_close(out, ref, None, torch.float32)
    _grads_match(out, ref, (q, k, v), (q64, k64, v64), torch.float32)
    four = m(*(t.detach().view(B, T, H, D).transpose(1, 2) for t in (q, k, v)), key_padding_mask=pad)
    assert four.shape == (B, H, T, D)
    assert_close(four.transpose(1, 2).reshape(B, T, H * D), ref, None, torch.float32, "sdpa form")


def test_grouped_query_kv():
    """k, v with 2 heads for q's 4 (SDPA's enable_gqa) in SDPA's form: values and gradients; 3
    heads is an error naming k. (The kernels': tests/kernels/test_attention.py.)"""
    m = _module("torch", mask=L.causal_mask, heads=4)
    dev, B, T, D = kernel_device(), 2, 64, 8
    q = torch.randn(B, 4, T, D, device=dev, requires_grad=True)
    k, v = (torch.randn(B, 2, T, D, device=dev, requires_grad=True) for _ in range(2))
    out = m(q, k, v)
    flat = [t.detach().double().cpu().transpose(1, 2).reshape(B, T, -1).requires_grad_() for t in (q, k, v)]
    ref = _reference(m, *flat, T, T)
    assert_close(out.transpose(1, 2).reshape(B, T, -1), ref, None, torch.float32)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), g.view(B, T, 4, D).transpose(1, 2).float().to(dev))
    want = torch.autograd.grad(ref, flat, g)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert_close(a.transpose(1, 2).reshape(B, T, -1), r, None, torch.float32, name)
    bad = torch.randn(B, 3, T, D, device=dev)
    with pytest.raises(ValueError, match=r"^k: expected .*kv_heads dividing heads=4"):
        m(q, bad, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_zero(backend):
    """An empty batch gives an empty output and empty gradients, as SDPA."""
    m = _module(backend)
    q = torch.randn(0, 2, 40, 8, device=kernel_device(), requires_grad=True)
    out = m(q, q, q)
    assert out.shape == (0, 2, 40, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_call_in_inference_mode_then_training(backend):
    """Nothing made during an inference-mode call is kept: training afterwards can save for backward."""
    m = _module(backend, context=32)
    dev = kernel_device()
    with torch.inference_mode():
        m(*(torch.randn(1, 32, 16, device=dev) for _ in range(3)))
    q, k, v = (torch.randn(1, 32, 16, device=dev, requires_grad=True) for _ in range(3))
    m(q, k, v).square().sum().backward()
    flat = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    _reference(m, *flat, 32, 32).square().sum().backward()
    for name, t, t64 in zip("qkv", (q, k, v), flat):
        assert_close(t.grad, t64.grad, None, torch.float32, f"d{name}")


def test_export_then_eager_gives_real_tensors():
    """torch.export of a never-run module (non-strict: the module runs on fake tensors) leaves no
    fake tensor behind: the eager module still returns real, correct tensors."""
    m = _module("torch")
    q, k, v = (torch.randn(2, 48, 16) for _ in range(3))
    ep = torch.export.export(m, (q, k, v), strict=False)
    out = m(q, k, v)
    assert type(out) is torch.Tensor
    assert_close(out, _reference(m, q, k, v, 48, 48), None, torch.float32)
    torch.testing.assert_close(ep.module()(q, k, v), out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_of_a_never_run_module_is_one_graph(backend):
    """A plain torch.compile of a fresh module: one graph, no break (layout tables already exist)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m = _module(backend)
    q = torch.randn(2, 2, 48, 8, device=kernel_device(), requires_grad=True)
    torch.compile(m, backend="eager")(q, q, q).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_copies_pickles_state_dict_and_repr():
    m = _module("torch", scale=0.5)
    q = torch.randn(1, 64, 16)
    want = m(q, q, q)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert twin.op.key == m.op.key and twin.op._tables is m.op._tables     # one set of tables
        torch.testing.assert_close(twin(q, q, q), want)
    assert m.state_dict() == {} and not m.load_state_dict({}).missing_keys
    text = repr(m)
    for part in ("heads=2", "context=64", "block_size=16", f"blocks={m.op.blocks}", "scale=0.5", "'torch'"):
        assert part in text, text


def test_bad_inputs():
    m = _module("torch")
    x = torch.randn(1, 65, 16)
    with pytest.raises(ValueError, match=r"^q: expected .* 1 <= T <= 64"):
        m(x, x, x)
    q = torch.randn(1, 3, 64, 8)
    with pytest.raises(ValueError, match=r"^q: expected \(batch, 2, T, head_dim\)"):
        m(q, q, q)
    q = torch.randn(1, 64, 16)
    with pytest.raises(ValueError, match=r"^key_padding_mask: expected a bool \(1, 64\)"):
        m(q, q, q, key_padding_mask=torch.zeros(1, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="scale: expected a positive number"):
        _module(scale=-1.0)


@pytest.mark.gpu
def test_gpu_bf16_module_shorter_inputs_and_gqa():
    m = _module("auto", mask=L.fixed_mask(32, 4), heads=4, context=256)
    B, T, D = 2, 200, 64
    q = torch.randn(B, 4, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, 1, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = m(q, k, v)
    flat = [t.detach().double().cpu().transpose(1, 2).reshape(B, T, -1).requires_grad_() for t in (q, k, v)]
    ref = _reference(m, *flat, T, T)
    assert_close(out.transpose(1, 2).reshape(B, T, -1), ref, None, torch.bfloat16)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
