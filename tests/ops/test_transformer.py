"""BlocksparseTransformer (PyTorch path) against a float64 dense masked-softmax reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain import layout as L
from bstrain.ops.transformer import BlocksparseTransformer, attention_ref
from tests.conftest import DTYPE_IDS, assert_close, fresh_seed, kernel_device


def element_mask(op: BlocksparseTransformer) -> torch.Tensor:
    """(heads, q_ctx, k_ctx) bool: the layout with each live block's element mask."""
    return op.dense_mask()


def block_coords(op: BlocksparseTransformer) -> list[tuple[int, int, int]]:
    """(head, query block, key block) of every live block, in the score tensor's order."""
    return [tuple(c) for c in np.argwhere(op.layout).tolist()]


def random_layout(heads, nq, nk, seed, empty_row=True):
    rng = np.random.default_rng(seed)
    lay = rng.random((heads, nq, nk)) < 0.5
    lay[:, :, 0] = True
    if empty_row:
        lay[0, nq - 1] = False                     # a query block of head 0 with no live key
    return lay


def qkv(B, Tq, Tk, H, D, dtype, grad=True):
    return tuple(torch.randn(B, T, H * D, dtype=dtype).requires_grad_(grad) for T in (Tq, Tk, Tk))


def checked(op, q, k, v, dtype, mask=None, pad=None, scale=0.3):
    """Output and dq, dk, dv of op.attention against float64 dense attention; in 16-bit dtypes the
    error may also be 2x that of dense attention computed by PyTorch in that dtype."""
    full = element_mask(op)[None] if pad is None else element_mask(op)[None] & ~pad.cpu()[:, None, None, :]
    full = full.to(q.device)
    out = op.attention(q, k, v, scale=scale, key_padding_mask=pad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, full, scale)
    g = torch.randn_like(ref)
    base, base_grads = None, (None,) * 3
    if dtype in (torch.float16, torch.bfloat16):
        same = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        base = attention_ref(*same, full, scale)
        base_grads = torch.autograd.grad(base, same, g.to(dtype))
    assert_close(out, ref, base, dtype, "out")
    got = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), g)
    for name, a, r, b in zip(("dq", "dk", "dv"), got, want, base_grads):
        assert_close(a, r, b, dtype, name)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("bs", [16, 32])
def test_per_head_layouts_with_unequal_block_counts(dtype, bs):
    lay = random_layout(3, 4, 3, fresh_seed())
    lay[2, :, 1:] = False                          # head 2: the first key block only
    lay[1, :, :2] = True
    op = BlocksparseTransformer(lay, block_size=bs)
    assert op.blocks == lay.sum() and len(set(lay.sum(axis=(1, 2)).tolist())) > 1
    out = checked(op, *qkv(2, 4 * bs, 3 * bs, 3, 16, dtype), dtype)
    assert (out[0, -bs:, :16] == 0).all(), "a query with no live key must give zeros"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=DTYPE_IDS.get)
def test_causal_mask_callback_shared_layout(dtype):
    lay, cb = L.attention_layout(L.causal_mask, 64, 64, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=2, mask_callback=cb)
    checked(op, *qkv(2, 64, 64, 2, 32, dtype), dtype)


def test_strided_mask_and_key_padding():
    lay, cb = L.attention_layout(L.strided_mask(32), 128, 128, 32, heads=2)
    op = BlocksparseTransformer(lay, block_size=32, mask_callback=cb)
    pad = torch.zeros(2, 128, dtype=torch.bool)
    pad[0, 100:] = True                            # the first sequence is 100 long
    pad[1, :] = True                               # the second is all padding: every row gives zeros
    out = checked(op, *qkv(2, 128, 128, 2, 16, torch.float64), torch.float64, pad=pad)
    assert (out[1] == 0).all()


def test_unfused_methods_and_the_score_tensor():
    lay = random_layout(2, 3, 2, fresh_seed(), empty_row=False)
    op = BlocksparseTransformer(lay, block_size=16)
    q, k, v = qkv(2, 48, 32, 2, 8, torch.float64, grad=False)
    w = op.query_key_op(q, k)
    assert w.shape == op.w_shape(2) == (2, int(lay.sum()), 16, 16)
    for n, (h, i, j) in enumerate(block_coords(op)):       # head-major, row-major blocks
        qb = q[:, i * 16:(i + 1) * 16, h * 8:(h + 1) * 8]
        kb = k[:, j * 16:(j + 1) * 16, h * 8:(h + 1) * 8]
        torch.testing.assert_close(w[:, n], qb @ kb.transpose(1, 2))
    p = op.masked_softmax(w, scale=0.5)
    y = op.weight_value_op(p, v)
    torch.testing.assert_close(y, op.attention(q, k, v, scale=0.5))
    # autoregress_at_key=20 (the seed's rule): keys before 20 are seen by every query, keys from 20
    # on only by queries at or after them
    p = op.masked_softmax(w, scale=0.5, autoregress_at_key=20)
    for n, (h, i, j) in enumerate(block_coords(op)):
        for qq in range(16):
            for kk in range(16):
                qpos, kpos = i * 16 + qq, j * 16 + kk
                if not (kpos < 20 or kpos <= qpos):
                    assert (p[:, n, qq, kk] == 0).all(), (qpos, kpos)
                elif qpos >= 0 and kpos < 20:
                    assert (p[:, n, qq, kk] > 0).all(), (qpos, kpos)
    with pytest.raises(ValueError, match="autoregress_at_key: expected an int key position in"):
        op.masked_softmax(w, autoregress_at_key=32)
    rows = torch.zeros(2, 2, 3, 16, dtype=torch.float64)
    for n, (h, i, j) in enumerate(block_coords(op)):
        rows[:, h, i] += p[:, n].sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))          # each row sums to one


def test_gradcheck_float64():
    lay, cb = L.attention_layout(L.local_mask(20), 32, 32, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=1, mask_callback=cb)
    q, k, v = qkv(1, 32, 32, 1, 4, torch.float64)
    torch.autograd.gradcheck(lambda a, b, c: op.attention(a, b, c), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("call,err,match", [
    (lambda: BlocksparseTransformer(np.ones((2, 2)), 16), ValueError, "heads: expected a positive int"),
    (lambda: BlocksparseTransformer(np.ones((2, 2, 2)), 16, heads=3), ValueError, "heads: expected 2"),
    (lambda: BlocksparseTransformer(np.ones((2, 2)), 24, heads=1), ValueError, "block_size: expected one of"),
    (lambda: BlocksparseTransformer(np.full((2, 2), 2), 16, heads=1), ValueError, "layout: expected"),
    (lambda: BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, mask_callback=lambda *a: np.ones((3, 3))),
     ValueError, "mask_callback: expected a \\(16, 16\\) array"),
])
def test_bad_construction(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_bad_calls():
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=2)
    q, k, v = qkv(1, 32, 32, 2, 8, torch.float32, grad=False)
    with pytest.raises(ValueError, match=r"q: expected \(batch, 32, heads·head_dim\) with heads=2"):
        op.attention(q[:, :16], k, v)
    with pytest.raises(ValueError, match="k: expected batch 1, torch.float32"):
        op.attention(q, k.double(), v)
    with pytest.raises(TypeError, match="v: expected a float16"):
        op.attention(q, k, v.int())
    with pytest.raises(ValueError, match="key_padding_mask: expected a bool \\(1, 32\\)"):
        op.attention(q, k, v, key_padding_mask=torch.zeros(1, 32))
    with pytest.raises(ValueError, match="w: expected the score tensor"):
        op.masked_softmax(torch.zeros(1, 3, 16, 16))


# --- torch.ops.bstrain.bst_attention --------------------------------------------------------------------
def _pad_mask(B, T):
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, T - 5:] = True
    return pad


@pytest.mark.parametrize("padded", [False, True])
def test_opcheck_attention_ops(padded):
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16)
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb)
    q, k, v = qkv(2, 32, 32, 2, 8, torch.float32)
    pad = _pad_mask(2, 32) if padded else None
    torch.library.opcheck(torch.ops.bstrain.bst_attention.default, (q, k, v, pad, op.key, 0.3))
    o, lse = torch.ops.bstrain.bst_attention(q.detach(), k.detach(), v.detach(), pad, op.key, 0.3)
    torch.library.opcheck(torch.ops.bstrain.bst_attention_bwd.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, pad, op.key, 0.3))


def test_copies_keep_their_attention_layout_registered():
    import copy
    import gc
    op = BlocksparseTransformer(random_layout(2, 2, 2, fresh_seed()), 16)
    twin, key = copy.deepcopy(op), op.key
    del op
    gc.collect()
    q, k, v = qkv(1, 32, 32, 2, 8, torch.float32, grad=False)
    torch.testing.assert_close(torch.ops.bstrain.bst_attention(q, k, v, None, key, 0.5)[0],
                               twin.attention(q, k, v, scale=0.5))


@pytest.mark.triton
def test_compile_fullgraph_through_the_attention_op(monkeypatch):
    """backend='triton' under torch.compile(fullgraph=True): the graph holds bstrain.bst_attention
    (on CPU it runs PyTorch inside), no graph break; outputs and gradients as in eager, with a
    padding mask and grouped-query k/v going through the op too."""
    dev = kernel_device()
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    lay, cb = L.attention_layout(L.strided_mask(16), 64, 64, 16)
    op = BlocksparseTransformer(lay, 16, heads=4, mask_callback=cb, backend="triton")

    def f(q, k, v, pad):
        return op.attention(q, k, v, key_padding_mask=pad)
    q = torch.randn(2, 64, 4 * 8, device=dev, requires_grad=True)
    k, v = (torch.randn(2, 64, 2 * 8, device=dev, requires_grad=True) for _ in range(2))
    pad = _pad_mask(2, 64).to(dev)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
    a, b = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, pad), f(q, k, v, pad)
    assert len(graphs) == 1 and "bstrain.bst_attention" in graphs[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(a)
    for x, y in zip(torch.autograd.grad(a, (q, k, v), g), torch.autograd.grad(b, (q, k, v), g)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_partial_masks_are_stored_once_per_distinct_tile():
    lay, cb = L.attention_layout(L.strided_mask(32), 256, 256, 16)
    op = BlocksparseTransformer(lay, 16, heads=4, mask_callback=cb)
    assert (op._partial_idx >= 0).sum() > 4 * 16 and len(op._pmasks) <= 4     # many partial blocks, few tiles
    q, k, v = qkv(1, 256, 256, 4, 8, torch.float64)
    checked(op, q, k, v, torch.float64)


def test_first_call_in_inference_mode_then_training():
    """The op's tables exist before the first call, so an inference-mode call leaves nothing an
    autograd graph later saves (no "Inference tensors cannot be saved for backward")."""
    lay, cb = L.attention_layout(L.fixed_mask(16, 4), 64, 64, 16)
    op = BlocksparseTransformer(lay, 16, heads=2, mask_callback=cb)
    with torch.inference_mode():
        op.attention(*qkv(1, 64, 64, 2, 8, torch.float32, grad=False))
    checked(op, *qkv(2, 64, 64, 2, 8, torch.float64), torch.float64)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_kv(kv_heads):
    """k, v with fewer heads than q (SDPA's enable_gqa): query head h reads k/v head h // (4 / kv_heads)."""
    lay = random_layout(4, 3, 2, fresh_seed())
    op = BlocksparseTransformer(lay, 16, mask_callback=None)
    q = torch.randn(2, 48, 4 * 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 32, kv_heads * 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    checked(op, q, k, v, torch.float64)
    do, o = torch.randn(2, 48, 32, dtype=torch.float64), op.attention(q, k, v, scale=0.3)
    want = torch.autograd.grad(o, (q, k, v), do)
    o2, lse = torch.ops.bstrain.bst_attention(q.detach(), k.detach(), v.detach(), None, op.key, 0.3)
    got = torch.ops.bstrain.bst_attention_bwd(do, q.detach(), k.detach(), v.detach(), o2, lse, None, op.key, 0.3)
    for a, b in zip(got, want):                                 # the custom op's formula backward
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"^k: expected \(batch, 32, kv_heads·8\) with kv_heads dividing heads=4"):
        op.attention(q, *(torch.randn(2, 32, 3 * 8, dtype=torch.float64) for _ in range(2)))   # 3 heads
    with pytest.raises(ValueError, match=r"^v: expected \(batch, 32, "):
        op.attention(q, k, v[:, :16])                           # (any value head dim: tests/ops/test_transformer_mods.py)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch(backend):
    op = BlocksparseTransformer(random_layout(2, 2, 2, fresh_seed()), 16, backend=backend)
    dev = kernel_device() if backend == "triton" else "cpu"
    q = torch.randn(0, 32, 16, device=dev, requires_grad=True)
    out = op.attention(q, q, q, key_padding_mask=torch.zeros(0, 32, dtype=torch.bool, device=dev))
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape
    assert op.query_key_op(q, q).shape == (0, op.blocks, 16, 16)
