"""BlocksparseTransformer.attention's SDPA/Flex features against float64 dense attention: a value
head dim of its own (Dv ≠ D, with grouped-query k/v too), the row log-sum-exp (``return_lse``,
differentiable), ALiBi and tanh soft-capping; on the PyTorch path and the kernels (Triton's
interpreter on CPU: few, tiny cases), gradients included; the custom ops' formula backward,
opcheck and torch.compile through them; the reference itself against a loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bstrain import layout as L
from bstrain.ops.transformer import BlocksparseTransformer, alibi_slopes, attention_ref
from tests.conftest import DTYPE_IDS, assert_close, fresh_seed, kernel_device
from tests.ops.test_transformer import random_layout

SLOPES = [0.5, 0.0625, 0.3, 0.01]                         # 4 heads: not the standard ones, one per head


def _loop_reference(q, k, v, mask, scale, slopes, softcap):
    """Attention of one batch element, element by element: (out (Tq, H, Dv), lse (H, Tq))."""
    Tq, H, D = q.shape
    Tk, Hk, Dv = v.shape
    out, lse = torch.zeros(Tq, H, Dv, dtype=q.dtype), torch.full((H, Tq), -math.inf, dtype=q.dtype)
    for h in range(H):
        g = h // (H // Hk)
        for i in range(Tq):
            keys = [j for j in range(Tk) if mask[h, i, j]]
            s = []
            for j in keys:
                x = scale * float(sum(q[i, h, d] * k[j, g, d] for d in range(D)))
                x = softcap * math.tanh(x / softcap)
                s.append(x + slopes[h] * (j - i))
            if keys:
                m = max(s)
                total = sum(math.exp(x - m) for x in s)
                lse[h, i] = m + math.log(total)
                for j, x in zip(keys, s):
                    out[i, h] += math.exp(x - m) / total * v[j, g]
    return out, lse


def test_reference_against_a_loop():
    """The oracle itself: GQA, Dv ≠ D, ALiBi, soft-capping, an empty query row, against a loop."""
    H, Hk, D, Dv, Tq, Tk = 4, 2, 3, 5, 4, 6
    q, k, v = torch.randn(1, Tq, H * D).double(), torch.randn(1, Tk, Hk * D).double(), torch.randn(1, Tk, Hk * Dv)
    v = v.double()
    mask = torch.rand(H, Tq, Tk) < 0.6
    mask[:, :, 0] = True
    mask[1, 2] = False                                     # head 1's query 2 sees no key
    out, lse = attention_ref(q, k, v, mask, 0.7, alibi=SLOPES, softcap=2.0, return_lse=True)
    want_out, want_lse = _loop_reference(q[0].view(Tq, H, D), k[0].view(Tk, Hk, D), v[0].view(Tk, Hk, Dv), mask,
                                         0.7, SLOPES, 2.0)
    assert out.shape == (1, Tq, H * Dv) and lse.shape == (1, H, Tq)
    torch.testing.assert_close(out[0], want_out.reshape(Tq, H * Dv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0], want_lse, rtol=1e-12, atol=1e-12)
    assert lse[0, 1, 2] == -math.inf and (out[0, 2, Dv:2 * Dv] == 0).all()


def test_standard_alibi_slopes():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(6) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]     # 4 heads', then 8's odd
    assert alibi_slopes(1) == [2.0 ** -8]


# --- the op against float64 dense attention ----------------------------------------------------------------
def _device(backend: str) -> str:
    return kernel_device() if backend == "triton" else "cpu"


def _inputs(op, B, D, Dv, kv_heads, dtype, dev):
    shapes = ((op.q_ctx, op.heads * D), (op.k_ctx, kv_heads * D), (op.k_ctx, kv_heads * Dv))
    return tuple(torch.randn(B, T, n, dtype=dtype, device=dev, requires_grad=True) for T, n in shapes)


def check_attention(op, q, k, v, dtype, *, pad=None, scale=0.3, alibi=None, softcap=None):
    """out and lse of ``op.attention(..., return_lse=True)`` and the gradients of q, k, v through
    both against float64 dense attention (16-bit dtypes: within 2x PyTorch's error in that dtype
    too, as tests/ops/test_transformer.py's ``checked``). Returns (out, lse)."""
    mask = op.dense_mask()[None] if pad is None else op.dense_mask()[None] & ~pad.cpu()[:, None, None, :]
    out, lse = op.attention(q, k, v, scale=scale, key_padding_mask=pad, return_lse=True, alibi=alibi,
                            softcap=softcap)
    alibi = alibi_slopes(op.heads) if alibi is True else alibi
    alibi = alibi.cpu() if isinstance(alibi, torch.Tensor) else alibi
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64, k64, v64, mask, scale, alibi=alibi, softcap=softcap, return_lse=True)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.promote_types(dtype, torch.float32)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse).cpu(), empty) and (lse.cpu()[empty] < 0).all(), "empty rows: lse -inf"
    g, g_lse = torch.randn_like(ref), torch.randn_like(ref_lse)
    base = base_lse = None
    base_grads = (None,) * 3
    if dtype in (torch.float16, torch.bfloat16):
        same = tuple(t.detach().cpu().clone().requires_grad_() for t in (q, k, v))
        base, base_lse = attention_ref(*same, mask, scale, alibi=alibi, softcap=softcap, return_lse=True)
        base_grads = torch.autograd.grad((base, base_lse), same, (g.to(dtype), g_lse.to(dtype)))
        base_lse = base_lse.masked_fill(empty, 0.0)
    assert_close(out, ref, base, dtype, "out")
    assert_close(lse.masked_fill(empty.to(lse.device), 0.0), ref_lse.masked_fill(empty, 0.0), base_lse, dtype, "lse")
    got = torch.autograd.grad((out, lse), (q, k, v), (g.to(out), g_lse.to(lse)))
    want = torch.autograd.grad((ref, ref_lse), (q64, k64, v64), (g, g_lse))
    for name, a, r, b in zip(("dq", "dk", "dv"), got, want, base_grads):
        assert_close(a, r, b, dtype, name)
    return out, lse


# (kv_heads, D, Dv, alibi, softcap): ids name what each case adds
FEATURES = {
    "dv": (4, 16, 8, None, None),
    "gqa-dv": (2, 8, 24, None, None),
    "alibi": (4, 16, 16, SLOPES, None),
    "softcap": (4, 16, 16, None, 0.5),
    "alibi+softcap+gqa-dv": (1, 16, 8, True, 0.5),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(FEATURES))
def test_torch_path_features(case, dtype):
    """A random per-head layout with an empty query row and per-head unequal blocks, key padding."""
    kv_heads, D, Dv, alibi, softcap = FEATURES[case]
    op = BlocksparseTransformer(random_layout(4, 3, 2, fresh_seed()), 16, backend="torch")
    pad = torch.zeros(2, 32, dtype=torch.bool)
    pad[1, 20:] = True
    _, lse = check_attention(op, *_inputs(op, 2, D, Dv, kv_heads, dtype, "cpu"), dtype, pad=pad,
                             alibi=alibi, softcap=softcap)
    assert (lse[:, 0, -16:] == -math.inf).all()


def test_gradcheck_float64_through_out_and_lse():
    """torch.autograd.gradcheck of (out, lse) with ALiBi, soft-capping, GQA and Dv (no empty rows:
    finite differences of a -inf LSE are NaN)."""
    lay, cb = L.attention_layout(L.local_mask(20), 32, 32, 16)
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb, backend="torch")
    q, k, v = _inputs(op, 1, 4, 3, 1, torch.float64, "cpu")
    torch.autograd.gradcheck(lambda a, b, c: op.attention(a, b, c, return_lse=True, alibi=[0.5, 0.2], softcap=0.8),
                             (q, k, v), fast_mode=True)


@pytest.mark.parametrize("backend,case", [("torch", "alibi+softcap+gqa-dv"), ("triton", "gqa-dv"),
                                          ("triton", "alibi+softcap+gqa-dv")])
def test_causal_features(backend, case):
    """A causal layout (partial diagonal blocks, ALiBi's usual use), fp32; the kernels' cases in
    the interpreter on CPU."""
    kv_heads, D, Dv, alibi, softcap = FEATURES[case]
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16)
    op = BlocksparseTransformer(lay, 16, heads=4, mask_callback=cb, backend=backend)
    check_attention(op, *_inputs(op, 1, D, Dv, kv_heads, torch.float32, _device(backend)), torch.float32,
                    alibi=alibi, softcap=softcap)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lse_alone_and_empty_rows(backend):
    """Gradients through the LSE alone (the output unused: dO is None) reach q and k
    (∂lse_i/∂s_ij = p_ij), and v gets none; a query block with no key and a batch element all
    padding give -inf LSE rows, zero outputs and finite gradients."""
    dev = _device(backend)
    lay = random_layout(2, 2, 2, fresh_seed())
    op = BlocksparseTransformer(lay, 16, backend=backend)
    q, k, v = _inputs(op, 2, 16, 8, 2, torch.float32, dev)
    pad = torch.zeros(2, 32, dtype=torch.bool, device=dev)
    pad[1] = True
    out, lse = op.attention(q, k, v, key_padding_mask=pad, return_lse=True, softcap=3.0)
    assert (lse[1] == -math.inf).all() and (lse[0, 0, 16:] == -math.inf).all() and (out[1] == 0).all()
    mask = op.dense_mask()[None] & ~pad.cpu()[:, None, None, :]
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    _, ref_lse = attention_ref(q64, k64, v64, mask, 0.25, softcap=3.0, return_lse=True)
    g = torch.randn_like(ref_lse)
    got = torch.autograd.grad(lse, (q, k, v), g.float().to(dev), allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(ref_lse, (q64, k64), g)
    for name, a, r in zip(("dq", "dk"), got, want):
        assert_close(a, r, None, torch.float32, name)
    assert (got[2] == 0).all()


@pytest.mark.triton
def test_eager_kernels_against_the_torch_path():
    """The same call on both backends (kernels in the interpreter on CPU), fp32: GQA, Dv, ALiBi
    given as a tensor, soft-capping, padding, and the LSE."""
    dev = kernel_device()
    lay, cb = L.attention_layout(L.strided_mask(16), 48, 32, 16, heads=2)
    ops = [BlocksparseTransformer(lay, 16, mask_callback=cb, backend=b) for b in ("torch", "triton")]
    q, k, v = (t.detach() for t in _inputs(ops[0], 2, 16, 32, 1, torch.float32, dev))
    pad = torch.zeros(2, 32, dtype=torch.bool, device=dev)
    pad[0, 27:] = True
    kw = dict(key_padding_mask=pad, return_lse=True, alibi=torch.tensor([0.25, 0.125], device=dev), softcap=2.0)
    (o_t, l_t), (o_k, l_k) = (op.attention(q, k, v, **kw) for op in ops)
    assert o_k.shape == (2, 48, 2 * 32) and l_k.shape == (2, 2, 48) and l_k.dtype == torch.float32
    torch.testing.assert_close(o_k, o_t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l_k, l_t, rtol=1e-5, atol=1e-5)


# --- the custom ops ------------------------------------------------------------------------------------------
def _op_inputs(op, kv_heads=2, D=8, Dv=12):
    q, k, v = (t.detach() for t in _inputs(op, 2, D, Dv, kv_heads, torch.float64, "cpu"))
    pad = torch.zeros(2, op.k_ctx, dtype=torch.bool)
    pad[0, -5:] = True
    return q, k, v, pad


def test_custom_op_formula_backward_with_dlse():
    """bst_attention_bwd (the PyTorch formulas: what the custom op runs on CPU) against autograd of
    the reference, with an LSE gradient, ALiBi, soft-capping, GQA and Dv."""
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16)
    op = BlocksparseTransformer(lay, 16, heads=4, mask_callback=cb)
    q, k, v, pad = _op_inputs(op)
    slopes = torch.tensor(SLOPES, dtype=torch.float64)
    o, lse2 = torch.ops.bstrain.bst_attention(q, k, v, pad, op.key, 0.3, slopes, 1.5)
    assert o.shape == (2, 32, 4 * 12) and lse2.shape == (2, 4 * 32)
    mask = op.dense_mask()[None] & ~pad[:, None, None, :]
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64, k64, v64, mask, 0.3, alibi=SLOPES, softcap=1.5, return_lse=True)
    torch.testing.assert_close(o, ref.detach())
    torch.testing.assert_close(lse2.view(2, 4, 32) * math.log(2), ref_lse.detach())    # base 2
    do, dlse = torch.randn_like(o), torch.randn(2, 4 * 32, dtype=torch.float64)
    got = torch.ops.bstrain.bst_attention_bwd(do, q, k, v, o, lse2, pad, op.key, 0.3, slopes, 1.5, dlse)
    want = torch.autograd.grad((ref, ref_lse), (q64, k64, v64), (do, dlse.view(2, 4, 32)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_opcheck_with_the_new_arguments():
    lay = random_layout(4, 2, 2, fresh_seed())
    op = BlocksparseTransformer(lay, 16)
    q, k, v, pad = (t.float() if t.is_floating_point() else t for t in _op_inputs(op))
    slopes = torch.tensor(SLOPES)
    torch.library.opcheck(torch.ops.bstrain.bst_attention.default, (q, k, v, pad, op.key, 0.3, slopes, 2.0))
    o, lse = torch.ops.bstrain.bst_attention(q, k, v, pad, op.key, 0.3, slopes, 2.0)
    dlse = torch.randn_like(lse)
    torch.library.opcheck(torch.ops.bstrain.bst_attention_bwd.default,
                          (torch.randn_like(o), q, k, v, o, lse, pad, op.key, 0.3, slopes, 2.0, dlse))


@pytest.mark.triton
@pytest.mark.parametrize("use_lse", [True, False], ids=["lse-in-loss", "lse-unused"])
def test_compile_fullgraph_with_lse(use_lse, monkeypatch):
    """backend='triton' under torch.compile(fullgraph=True) with return_lse, GQA, Dv ≠ D, ALiBi and
    soft-capping: one graph holding bstrain.bst_attention (the fake gives O (B, Tq, H·Dv)); values
    and gradients as the eager PyTorch path's, with the LSE in the loss or unused."""
    dev = kernel_device()
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16)
    ops = [BlocksparseTransformer(lay, 16, heads=4, mask_callback=cb, backend=b) for b in ("triton", "torch")]
    slopes = torch.tensor(alibi_slopes(4), device=dev)

    def f(op, q, k, v):
        out, lse = op.attention(q, k, v, return_lse=True, alibi=slopes, softcap=4.0)
        return (out, lse) if use_lse else (out,)
    q, k, v = _inputs(ops[0], 2, 8, 16, 2, torch.float32, dev)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
    got = torch.compile(lambda *a: f(ops[0], *a), fullgraph=True, backend=backend)(q, k, v)
    want = f(ops[1], q, k, v)
    assert len(graphs) == 1 and "bstrain.bst_attention" in graphs[0]
    assert got[0].shape == (2, 32, 4 * 16) and (not use_lse or got[1].shape == (2, 4, 32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    grads = tuple(torch.randn_like(t) for t in got)
    for x, y in zip(torch.autograd.grad(got, (q, k, v), grads), torch.autograd.grad(want, (q, k, v), grads)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


# --- argument checks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,err,match", [
    (dict(alibi=[0.5, 0.25, 0.1]), ValueError, r"^alibi: expected 4 finite slopes \(one per head\), got"),
    (dict(alibi=[0.5, 0.25, float("nan"), 0.1]), ValueError, r"^alibi: expected 4 finite slopes"),
    (dict(alibi=torch.ones(3)), ValueError, r"^alibi: expected 4 slopes \(one per head\), got shape \(3,\)"),
    (dict(alibi=torch.tensor([1.0, 2.0, float("inf"), 0.0])), ValueError, r"^alibi: expected finite slopes"),
    (dict(alibi=torch.ones(4, dtype=torch.int64)), TypeError, r"^alibi: expected a floating tensor"),
    (dict(alibi="standard"), TypeError, r"^alibi: expected None, True, or 4 slopes"),
    (dict(softcap=0.0), ValueError, r"^softcap: expected a positive finite number or None, got 0.0"),
    (dict(softcap=-1), ValueError, r"^softcap: expected a positive finite number"),
    (dict(softcap=float("inf")), ValueError, r"^softcap: expected a positive finite number"),
    (dict(softcap="30"), TypeError, r"^softcap: expected a positive number or None, got str"),
    (dict(softcap=True), TypeError, r"^softcap: expected a positive number or None, got bool"),
], ids=["alibi-count", "alibi-nan", "alibi-tensor-count", "alibi-tensor-inf", "alibi-int", "alibi-str",
        "softcap-0", "softcap-neg", "softcap-inf", "softcap-str", "softcap-bool"])
def test_bad_modification_arguments(kw, err, match):
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=4)
    q = torch.randn(1, 32, 4 * 8)
    with pytest.raises(err, match=match):
        op.attention(q, q, q, **kw)


def test_bad_value_widths():
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=4, backend="triton")
    q, k = torch.randn(1, 32, 4 * 8), torch.randn(1, 32, 2 * 8)
    with pytest.raises(ValueError, match=r"^v: expected \(batch, 32, 2·Dv\) \(k's 2 kv heads; any value head dim "
                                         r"Dv\), got \(1, 32, 5\)"):
        op.attention(q, k, torch.randn(1, 32, 5))
    with pytest.raises(ValueError, match=r"^v: the Triton backend takes head dims up to 128, got 160"):
        op.attention(q, k, torch.randn(1, 32, 2 * 160))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_alibi_slopes_are_constants_on_every_backend(backend):
    """Slopes that require grad get none on either backend (the kernels give none), and slopes
    given as numbers are made on the device once, not copied at every call."""
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=2, mask_callback=cb, backend=backend)
    dev = kernel_device()
    q = torch.randn(1, 32, 2 * 16, device=dev, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], device=dev, requires_grad=True)
    op.attention(q, q, q, alibi=slopes).sum().backward()
    assert slopes.grad is None and q.grad is not None
    from bstrain.ops.transformer import _check_alibi
    a = _check_alibi(True, 2, torch.device(dev), torch.float32)
    assert a is _check_alibi(True, 2, torch.device(dev), torch.float32)
    assert a is _check_alibi([float(x) for x in alibi_slopes(2)], 2, torch.device(dev), torch.float32)
