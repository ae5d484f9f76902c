"""BlockSparseAttention's SDPA/Flex features: a value head dim of its own in SDPA's form (with
grouped-query k/v and shorter inputs), the returned LSE, ALiBi and soft-capping as construction
options (slopes kept as a non-persistent fp32 buffer), against float64 dense attention and
against FlexAttention's score_mod on the same mask."""
from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch

from bstrain import layout as L
from bstrain.nn import BlockSparseAttention
from bstrain.ops.transformer import alibi_slopes, attention_ref
from tests.conftest import assert_close, kernel_device


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H·D), float64 on the CPU, a leaf that requires grad."""
    B, H, T, D = t.shape
    return t.detach().cpu().double().transpose(1, 2).reshape(B, T, H * D).requires_grad_()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sdpa_form_dv_gqa_lse_alibi_softcap_shorter_inputs(backend):
    """(B, H, T, D) q, (B, Hk, Tk, D) k, (B, Hk, Tk, Dv) v shorter than the context, key padding,
    ALiBi's standard slopes and soft-capping: out (B, H, T, Dv) and lse (B, H, T) as float64 dense
    attention over the layout's first T x Tk positions; gradients through both."""
    dev = kernel_device() if backend == "triton" else "cpu"
    m = BlockSparseAttention.from_mask(L.causal_mask, 48, 16, heads=4, backend=backend, alibi=True, softcap=5.0)
    B, T, D, Dv = 2, 37, 8, 24
    q = torch.randn(B, 4, T, D, device=dev, requires_grad=True)
    k = torch.randn(B, 2, T, D, device=dev, requires_grad=True)
    v = torch.randn(B, 2, T, Dv, device=dev, requires_grad=True)
    pad = torch.zeros(B, T, dtype=torch.bool, device=dev)
    pad[1, 30:] = True
    out, lse = m(q, k, v, key_padding_mask=pad, return_lse=True)
    assert out.shape == (B, 4, T, Dv) and lse.shape == (B, 4, T) and lse.dtype == torch.float32
    flat = [_flat(t) for t in (q, k, v)]
    mask = m.op.dense_mask()[:, :T, :T][None] & ~pad.cpu()[:, None, None, :]
    ref, ref_lse = attention_ref(*flat, mask, D ** -0.5, alibi=alibi_slopes(4), softcap=5.0, return_lse=True)
    assert_close(out.transpose(1, 2).reshape(B, T, -1), ref, None, torch.float32)
    assert_close(lse, ref_lse, None, torch.float32, "lse")
    g, g_lse = torch.randn_like(ref), torch.randn_like(ref_lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (g.view(B, T, 4, Dv).transpose(1, 2).float().to(dev),
                                                      g_lse.float().to(dev)))
    want = torch.autograd.grad((ref, ref_lse), flat, (g, g_lse))
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert_close(a.transpose(1, 2).reshape(B, T, -1), r, None, torch.float32, name)


def test_matches_flex_attention_score_mod():
    """The same scores as FlexAttention's score_mod examples (tanh soft-cap, then ALiBi bias), the
    same natural-log LSE, on a causal block mask, in float64 (Flex's eager path on CPU)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    slopes = [0.5, 0.125]
    m = BlockSparseAttention.from_mask(L.causal_mask, 64, 16, heads=2, backend="torch", alibi=slopes, softcap=3.0)
    q, k = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    bias = torch.tensor(slopes, dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        score = 3.0 * torch.tanh(score / 3.0)
        return score + bias[h] * (kv_idx - q_idx)
    bm = create_block_mask(L.causal_mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)              # "called without torch.compile()"
            want, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_aux=AuxRequest(lse=True))
    finally:
        # flex_attention's eager path compiles a wrapper; a call with another score_mod in the
        # same process then failed in dynamo's recompilation-reason logging (TypeError: 'NoneType'
        # object is not subscriptable, torch 2.13): no compiled state in, none left behind
        torch._dynamo.reset()
    out, lse = m(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, aux.lse)


def test_alibi_buffer_state_dict_casts_and_copies():
    """alibi=True gives the standard slopes as a non-persistent fp32 buffer: state dicts are empty
    with or without it; .half() and to_empty() leave the exact fp32 slopes; copies and pickles
    keep them; repr names both options."""
    plain = BlockSparseAttention.from_mask(L.causal_mask, 32, 16, heads=6, backend="torch")
    m = BlockSparseAttention.from_mask(L.causal_mask, 32, 16, heads=6, backend="torch", alibi=True, softcap=30)
    assert plain.alibi_slopes is None and plain.softcap is None and plain.state_dict() == {}
    assert m.state_dict() == {} and not m.load_state_dict({}).missing_keys
    want = torch.tensor(alibi_slopes(6))
    assert m.alibi_slopes.dtype == torch.float32 and torch.equal(m.alibi_slopes, want) and m.softcap == 30.0
    assert "alibi_slopes" in dict(m.named_buffers())
    m.half()
    assert m.alibi_slopes.dtype == torch.float32 and torch.equal(m.alibi_slopes, want)
    m.to("meta").to_empty(device="cpu")
    assert torch.equal(m.alibi_slopes, want)
    q = torch.randn(1, 32, 6 * 4)
    out = m(q, q, q)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert torch.equal(twin.alibi_slopes, want)
        torch.testing.assert_close(twin(q, q, q), out)
    text = repr(m)
    assert "alibi=[0.25, 0.0625" in text and "softcap=30.0" in text, text
    assert "alibi" not in repr(plain) and "softcap" not in repr(plain)


@pytest.mark.parametrize("kw,err,match", [
    (dict(alibi=[0.5, 0.25, 0.125]), ValueError, r"^alibi: expected 2 finite slopes \(one per head\)"),
    (dict(alibi=[0.5, math.inf]), ValueError, r"^alibi: expected 2 finite slopes"),
    (dict(alibi=torch.ones(2, 1)), ValueError, r"^alibi: expected 2 slopes \(one per head\), got shape \(2, 1\)"),
    (dict(alibi=0.5), TypeError, r"^alibi: expected None, True, or 2 slopes"),
    (dict(softcap=0), ValueError, r"^softcap: expected a positive finite number or None, got 0"),
    (dict(softcap=[1.0]), TypeError, r"^softcap: expected a positive number or None, got list"),
], ids=["alibi-count", "alibi-inf", "alibi-shape", "alibi-float", "softcap-0", "softcap-list"])
def test_bad_construction_options(kw, err, match):
    with pytest.raises(err, match=match):
        BlockSparseAttention.from_mask(L.causal_mask, 32, 16, heads=2, **kw)


def test_bad_value_in_sdpa_form():
    m = BlockSparseAttention.from_mask(L.causal_mask, 32, 16, heads=4, backend="torch")
    q, k = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8)
    with pytest.raises(ValueError, match=r"^v: expected \(batch, heads, T, head_dim\) like q, got \(1, 32, 16\)"):
        m(q, k, torch.randn(1, 32, 16))
    with pytest.raises(ValueError, match=r"^v: expected \(batch, 32, 2·Dv\)"):
        m(q, k, torch.randn(1, 2, 16, 8))                         # 16 positions for k's 32


def test_alibi_slopes_changed_in_place_survive_casts_and_moves():
    attn = BlockSparseAttention.from_mask(L.causal_mask, context=32, block_size=16, heads=2, alibi=True)
    with torch.no_grad():
        attn.alibi_slopes.mul_(2)
    want = attn.alibi_slopes.clone()
    attn.float().half().to("cpu")
    assert attn.alibi_slopes.dtype == torch.float32 and torch.equal(attn.alibi_slopes, want)
    meta = BlockSparseAttention.from_mask(L.causal_mask, context=32, block_size=16, heads=2, alibi=True,
                                          ).to("meta").to_empty(device="cpu")
    assert torch.equal(meta.alibi_slopes, torch.tensor(alibi_slopes(2)))
