"""The flash-style block-sparse attention kernels against float64 dense attention.

On CPU they run in Triton's interpreter (fp32, fp16); on the GPU compiled, bf16 too.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from bstrain import layout as L
from bstrain.kernels import attention as K
from bstrain.kernels import tiles
from bstrain.ops.transformer import BlocksparseTransformer, attention_ref
from tests.conftest import DTYPE_IDS, assert_close, fresh_seed, kernel_device, kernel_dtypes
from tests.ops.test_transformer import checked, qkv, random_layout


def cases(*combos):
    """Parameter sets: every combination with every kernel dtype on the GPU; on CPU (the
    interpreter, slow) only ``combos``, each with the dtype it names, so each case still runs once."""
    if torch.cuda.is_available():
        rest = sorted({c[1:] for c in combos}, key=str)
        return [(dt, *r) for dt in kernel_dtypes() for r in rest]
    return list(combos)


def _id(value) -> str:
    return DTYPE_IDS.get(value, str(value))


def _on(dev, *ts):
    return tuple(t.detach().to(dev).requires_grad_() for t in ts)


def run(op, B, D, dtype, pad=None):
    dev = kernel_device()
    q, k, v = _on(dev, *qkv(B, op.q_ctx, op.k_ctx, op.heads, D, dtype))
    return checked(op, q, k, v, dtype, pad=None if pad is None else pad.to(dev))


@pytest.mark.parametrize("dtype,bs,D", cases((torch.float32, 16, 32), (torch.float16, 32, 48),
                                              (torch.float16, 16, 64)), ids=_id)
def test_per_head_layouts_empty_rows_and_columns(dtype, bs, D):
    lay = random_layout(2, 3, 4, fresh_seed())
    lay[1, :, 3] = False                                     # a key block no query of head 1 uses
    op = BlocksparseTransformer(lay, block_size=bs, backend="triton")
    out = run(op, 2, D, dtype)
    assert (out[:, -bs:, :D] == 0).all()


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
def test_causal_partial_blocks_and_padding(dtype):
    lay, cb = L.attention_layout(L.causal_mask, 64, 64, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=2, mask_callback=cb, backend="triton")
    pad = torch.zeros(2, 64, dtype=torch.bool)
    pad[0, 40:] = True
    pad[1, 5:] = True
    run(op, 2, 32, dtype, pad=pad)


def test_strided_layout_matches_the_torch_path():
    lay, cb = L.attention_layout(L.strided_mask(32), 96, 64, 16, heads=2)
    ops = [BlocksparseTransformer(lay, block_size=16, mask_callback=cb, backend=b) for b in ("torch", "triton")]
    dev = kernel_device()
    q, k, v = (t.to(dev) for t in qkv(1, 96, 64, 2, 32, torch.float32, grad=False))
    torch.testing.assert_close(ops[1].attention(q, k, v), ops[0].attention(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.fixture
def tile_shapes():
    """Sets the kernels' tile shapes for one (block size, head dim, dtype); restores them after."""
    with contextlib.ExitStack() as stack:
        def set_(bs, D, dtype, fwd, dq, dkdv):
            block_d = max(16, 1 << (D - 1).bit_length())
            for name, (bo, bi) in (("fwd", fwd), ("dq", dq), ("dkdv", dkdv)):
                stack.enter_context(tiles.overridden("attention", (name, bs, dtype.itemsize, block_d),
                                                     tiles.Tile(bo, bi, 4, 2)))
        yield set_


def _mixed_callback(seed):
    """Per block: causal, random, all kept, or all dropped element masks."""
    rng = np.random.default_rng(seed)

    def cb(shape, h, qi, ki, n):
        kind = rng.integers(4)
        if kind == 0:
            return np.tril(np.ones(shape, bool))
        if kind == 1:
            return rng.random(shape) < 0.6
        return np.full(shape, kind == 2)
    return cb


TILE_SETS = {"a": ((32, 16), (16, 32), (64, 16)), "b": ((64, 32), (64, 64), (16, 64)),
             "c": ((16, 16), (32, 32), (32, 16))}


@pytest.mark.parametrize("dtype,tiles", cases((torch.float32, "a"), (torch.float16, "b"), (torch.float32, "c")),
                         ids=_id)
def test_tiles_smaller_than_blocks(dtype, tiles, tile_shapes):
    """Blocks of 64 cut into tiles of 16-64: triangular, table and dead tiles, padding, an empty row."""
    bs, D = 64, 16
    tile_shapes(bs, D, dtype, *TILE_SETS[tiles])
    lay = random_layout(1, 3, 3, fresh_seed())
    lay[:, np.arange(3), np.arange(3)] = True
    op = BlocksparseTransformer(lay, block_size=bs, mask_callback=_mixed_callback(fresh_seed()), backend="triton")
    pad = torch.zeros(1, 3 * bs, dtype=torch.bool)
    pad[0, 150:] = True
    run(op, 1, D, dtype, pad=pad)


def test_causal_tiles_are_triangular_and_dead_tiles_dropped():
    """A causal layout's partial tiles need no mask table, and tiles above the diagonal are skipped."""
    bs, n = 64, 4
    lay, cb = L.attention_layout(L.causal_mask, n * bs, n * bs, bs)
    op = BlocksparseTransformer(lay, block_size=bs, heads=1, mask_callback=cb)
    luts = op.luts(torch.device("cpu"))
    for by_key, bo, bi in [(False, 64, 64), (False, 32, 16), (True, 64, 16), (True, 16, 32)]:
        t = luts.tiles(by_key, bo, bi)
        code = t.code.numpy()
        assert (code < 0).all(), "a causal tile was given a mask table"
        # live tiles: those with any q >= k, by element positions
        no, ni = (bo, bi)
        q_t, k_t = (n * bs // ni, n * bs // no) if by_key else (n * bs // no, n * bs // ni)
        qs, ks = (ni, no) if by_key else (no, ni)
        live = sum((qa + 1) * qs - 1 >= kb * ks for qa in range(q_t) for kb in range(k_t))
        assert len(code) == live
        full = sum(qa * qs >= (kb + 1) * ks - 1 for qa in range(q_t) for kb in range(k_t))
        assert (code == -1).sum() == full
        ptr, mid, tab = t.ptr.numpy(), t.mid.numpy(), t.tab.numpy()
        assert ((ptr[:-1] <= mid) & (mid <= tab) & (tab == ptr[1:])).all()
        for r in range(len(mid)):
            assert (code[ptr[r]:mid[r]] == -1).all() and (code[mid[r]:tab[r]] < -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("D", [32, 64, 96, 128])
def test_gpu_block_sizes_and_head_dims(dtype, bs, D):
    lay, cb = L.attention_layout(L.fixed_mask(2 * bs, summary=8), 6 * bs, 6 * bs, bs, heads=2)
    op = BlocksparseTransformer(lay, block_size=bs, mask_callback=cb, backend="triton")
    pad = torch.zeros(2, 6 * bs, dtype=torch.bool)
    pad[1, 5 * bs + 3:] = True
    run(op, 2, D, dtype, pad=pad)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,D", [(32, 64), (128, 128)])
def test_gpu_fp32(bs, D):
    lay, cb = L.attention_layout(L.causal_mask, 4 * bs, 4 * bs, bs, heads=2)
    run(BlocksparseTransformer(lay, block_size=bs, mask_callback=cb, backend="triton"), 2, D, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "local", "strided", "fixed"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_benchmark_sizes(name, D):
    """The benchmark's layouts at S=4096 with 128-blocks (one batch element, two heads)."""
    S, w = 4096, 128
    mask = {"causal": L.causal_mask, "local": L.local_mask(4 * w), "strided": L.strided_mask(w),
            "fixed": L.fixed_mask(w, summary=w // 8)}[name]
    lay, cb = L.attention_layout(mask, S, S, 128, heads=2)
    run(BlocksparseTransformer(lay, block_size=128, mask_callback=cb, backend="triton"), 1, D, torch.bfloat16)


def test_triton_backend_input_errors():
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, backend="triton")
    q = torch.zeros(1, 32, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="the Triton backend takes float16, bfloat16 or float32"):
        op.attention(q, q, q)
    big = torch.zeros(1, 32, 256)
    with pytest.raises(ValueError, match="head dims up to 128"):
        op.attention(big, big, big)
    with pytest.raises(ValueError, match="backend: expected"):
        BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_head_with_no_live_block(backend):
    lay = random_layout(2, 2, 3, fresh_seed())
    lay[1] = False
    op = BlocksparseTransformer(lay, block_size=16, backend=backend)
    out = run(op, 1, 16, torch.float32)
    assert (out[..., 16:] == 0).all()


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
def test_grouped_query_kv_and_padding(dtype):
    """k, v with half of q's heads: the kernels read k/v head h // 2 and sum dK, dV over the group."""
    lay, cb = L.attention_layout(L.causal_mask, 32, 32, 16, heads=4)
    lay[3, 1, 0] = False                                       # heads with their own layouts
    op = BlocksparseTransformer(lay, block_size=16, mask_callback=cb, backend="triton")
    dev = kernel_device()
    q, = _on(dev, torch.randn(2, 32, 4 * 16, dtype=dtype))
    k, v = _on(dev, *(torch.randn(2, 32, 2 * 16, dtype=dtype) for _ in range(2)))
    pad = torch.zeros(2, 32, dtype=torch.bool, device=dev)
    pad[1, 20:] = True
    checked(op, q, k, v, dtype, pad=pad)


def test_empty_batch():
    op = BlocksparseTransformer(np.ones((2, 2)), 16, heads=1, backend="triton")
    q = torch.randn(0, 32, 16, device=kernel_device(), requires_grad=True)
    out = op.attention(q, q, q)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape


@pytest.mark.gpu
def test_gpu_launch_plans_direct_path_fresh_inputs():
    """After a plan's first (JIT) launch, later calls launch directly; each call is checked with
    fresh inputs, and a misaligned view after aligned calls gets a plan of its own."""
    from bstrain.kernels import launch
    lay, cb = L.attention_layout(L.strided_mask(32), 128, 128, 32, heads=2)
    op = BlocksparseTransformer(lay, block_size=32, mask_callback=cb, backend="triton")
    before = dict(launch.stats)
    for step in range(4):
        base = torch.randn(3 * 128 * 64 + 8, device="cuda", dtype=torch.float16)
        q = base[1 if step == 3 else 0:][:3 * 128 * 64].view(3, 128, 64)       # the last: misaligned
        k, v = (torch.randn(3, 128, 64, device="cuda", dtype=torch.float16) for _ in range(2))
        pad = torch.zeros(3, 128, dtype=torch.bool, device="cuda")
        pad[2, 100 + step:] = True
        checked(op, *_on("cuda", q, k, v), torch.float16, pad=pad)
    assert launch.stats["direct"] - before["direct"] >= 6, (before, launch.stats)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_with_padding():
    """fwd+bwd with a padding mask captured in a CUDA graph (nothing syncs with the host) and
    replayed on new data gives the eager results."""
    lay, cb = L.attention_layout(L.causal_mask, 256, 256, 64)
    op = BlocksparseTransformer(lay, block_size=64, heads=2, mask_callback=cb)
    q, k, v = (torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pad = torch.zeros(2, 256, dtype=torch.bool, device="cuda")
    g = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        out = op.attention(q, k, v, key_padding_mask=pad)
        return (out,) + torch.autograd.grad(out, (q, k, v), g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                                   # warm-up: plans and tables made
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v, g):
            t.copy_(torch.randn_like(t))
        pad[1, 200:] = True
    graph.replay()
    for a, b in zip(captured, step()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=DTYPE_IDS.get)
def test_fused_qkv_views_are_read_in_place(dtype):
    """q, k, v as chunks of one (B, T, 3·H·D) projection: the kernels take their strides (no copy)."""
    lay, cb = L.attention_layout(L.strided_mask(16), 48, 48, 16)
    op = BlocksparseTransformer(lay, block_size=16, heads=2, mask_callback=cb, backend="triton")
    x, = _on(kernel_device(), torch.randn(2, 48, 3 * 32, dtype=dtype))
    q, k, v = x.chunk(3, -1)
    assert all(a is b for a, b in zip(K.kernel_inputs(q, k, v), (q, k, v)))
    out = op.attention(q, k, v, scale=0.3)
    x64 = x.detach().double().cpu().requires_grad_()
    ref = attention_ref(*x64.chunk(3, -1), op.dense_mask(), 0.3)
    assert_close(out, ref, None, dtype)
    g = torch.randn_like(ref)
    got, = torch.autograd.grad(out, x, g.to(out.device, dtype))
    want, = torch.autograd.grad(ref, x64, g)
    assert_close(got, want, None, dtype, "dx")


# --- the kernels' options: v's own head dim, ALiBi, soft-capping, an LSE gradient, TMA and warp specialisation
def _reference(q, k, v, mask, scale, slopes, softcap):
    """Float64 (O, natural-log LSE) of dense attention with the kernels' options: logits
    scale·q·k, soft-capped (softcap > 0), plus slope·(key − query); mask (H, Tq, Tk) bool."""
    B, Tq, HD = q.shape
    H = mask.shape[0]
    D = HD // H
    Hk = k.shape[2] // D
    Dv = v.shape[2] // Hk
    qh = q.view(B, Tq, H, D).transpose(1, 2)
    kh = k.view(B, -1, Hk, D).transpose(1, 2).repeat_interleave(H // Hk, 1)
    vh = v.view(B, -1, Hk, Dv).transpose(1, 2).repeat_interleave(H // Hk, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        pos = torch.arange(s.shape[-1], dtype=s.dtype) - torch.arange(Tq, dtype=s.dtype)[:, None]
        s = s + slopes.to(s.dtype)[:, None, None] * pos
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)                                         # -inf: no live key
    live = mask.any(-1)
    p = torch.where(live[..., None], torch.exp(s - torch.where(live, lse, 0.0)[..., None]), 0.0)
    return (p @ vh).transpose(1, 2).reshape(B, Tq, H * Dv), lse


def _check_options(op, B, H, Hk, D, Dv, dtype, slopes, softcap, dlse_on, scale=0.4):
    dev = kernel_device()
    T = op.q_ctx
    q = torch.randn(B, T, H * D, dtype=torch.float64)
    k = torch.randn(B, T, Hk * D, dtype=torch.float64)
    v = torch.randn(B, T, Hk * Dv, dtype=torch.float64)
    do = torch.randn(B, T, H * Dv, dtype=torch.float64)
    dlse = torch.randn(B, H, T, dtype=torch.float64) if dlse_on else None
    x = [t.to(dev, dtype) for t in (q, k, v, do)]
    luts = op.luts(dev)
    sl = None if slopes is None else slopes.to(dev)
    o, lse2 = K.attention_forward(*K.kernel_inputs(*x[:3]), luts, scale, alibi=sl, softcap=softcap)
    dq, dk, dv = K.attention_backward(x[3], *K.kernel_inputs(*x[:3]), o, lse2, luts, scale, alibi=sl,
                                      softcap=softcap, dlse=None if dlse is None else dlse.view(B, -1).to(dev))
    q64, k64, v64 = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    ref, lse = _reference(q64, k64, v64, op.dense_mask(), scale, slopes, softcap)
    loss = (ref * do).sum() + (0 if dlse is None else (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum())
    want = torch.autograd.grad(loss, (q64, k64, v64))
    assert_close(o, ref, None, dtype, "out")
    got_lse = lse2.view(B, H, T).double().cpu() / K.LOG2E
    live = torch.isfinite(lse)
    assert (got_lse[~live] == float("inf")).all(), "an empty row's LSE is not +inf"
    assert_close(got_lse[live], lse[live].detach(), None, dtype, "lse")
    for name, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(a, r, None, dtype, name)


@pytest.mark.parametrize("dtype,D,Dv,Hk,alibi,softcap,dlse", cases(
    (torch.float32, 32, 16, 2, True, 0.0, False),          # MLA-style: v narrower, grouped-query
    (torch.float16, 16, 48, 1, False, 3.0, True),          # v wider and not a power of two; softcap; LSE grad
    (torch.float32, 16, 16, 2, True, 2.0, True)), ids=_id)
def test_value_head_dim_alibi_softcap_and_lse_gradient(dtype, D, Dv, Hk, alibi, softcap, dlse):
    lay = random_layout(2, 3, 3, fresh_seed())
    op = BlocksparseTransformer(lay, block_size=16, mask_callback=_mixed_callback(fresh_seed()), backend="triton")
    slopes = torch.rand(2, dtype=torch.float32) if alibi else None
    _check_options(op, 2, 2, Hk, D, Dv, dtype, slopes, softcap, dlse)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (128, 64), (96, 96)])
def test_gpu_tma_and_pointer_tiles(tma, D, Dv):
    """Inner tiles through tensor descriptors or pointers, 64- and 128-row tiles, against float64
    (causal 128-blocks, grouped-query, with the options on; a head dim of 96 reads by pointers)."""
    block = max(16, 1 << (max(D, Dv) - 1).bit_length())
    with contextlib.ExitStack() as stack:
        for kern, (bo, bi, w) in {"fwd": (128, 128, 8), "dq": (64, 64, 4), "dkdv": (128, 32, 8)}.items():
            stack.enter_context(tiles.overridden("attention", (kern, 128, 2, block), tiles.Tile(bo, bi, w, 3, tma)))
        lay, cb = L.attention_layout(L.causal_mask, 512, 512, 128)
        op = BlocksparseTransformer(lay, block_size=128, heads=2, mask_callback=cb, backend="triton")
        _check_options(op, 2, 2, 1, D, Dv, torch.bfloat16, torch.rand(2), 20.0, True)
