"""The sparse transformer LM: causality, shapes, config errors, and training through the trainer."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from bstrain.nn import BlockSparseLinear
from bstrain.models.transformer import PATTERNS, SparseTransformer
from bstrain.train.trainer import train
from tests.conftest import kernel_device, killed_then_resumed

SMALL = dict(d_model=32, n_layer=2, n_head=2, context=64, block_size=16, window=16, summary=4)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_for_every_pattern(pattern, positions):
    """Changing byte t changes no logit before t; inputs of any length up to the context work."""
    torch.manual_seed(0)
    m = SparseTransformer(**SMALL, attention=pattern, positions=positions)
    x = torch.randint(0, 256, (2, 45))                     # not a multiple of the block size
    y = m(x)
    assert y.shape == (2, 45, 256)
    x2 = x.clone()
    x2[:, 30] = (x2[:, 30] + 1) % 256
    y2 = m(x2)
    assert torch.equal(y[:, :30], y2[:, :30]) and not torch.equal(y[:, 30:], y2[:, 30:])


def test_sparse_ffn_and_layouts():
    m = SparseTransformer(**SMALL, attention="local,strided", ffn_density=0.5, ffn_block_size=16)
    lays = m.block_sparse_layouts()
    assert isinstance(m.blocks[0].fc1, BlockSparseLinear)
    assert sorted(lays) == ["blocks.0.attn", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.attn", "blocks.1.fc1",
                            "blocks.1.fc2"]
    assert lays["blocks.0.attn"].shape == (4, 4) and not lays["blocks.0.attn"][0, 3]     # causal
    assert m.blocks[1].attn.pattern == "strided"


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="full"), "model.attention: expected one of"),
    (dict(n_head=3), "model.n_head: expected a divisor"),
    (dict(block_size=24), "model.block_size: expected 16, 32, 64 or 128"),
    (dict(ffn_density=0), "model.ffn_density"),
    (dict(positions="alibi"), "model.positions, model.backend"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseTransformer(**{**SMALL, **kwargs})
    with pytest.raises(TypeError, match="unexpected argument 'hidden'"):
        SparseTransformer(hidden=3)
    with pytest.raises(ValueError, match="x: expected 1 to context=64"):
        SparseTransformer(**SMALL)(torch.zeros(1, 65, dtype=torch.long))


def _cfg(tmp_path, run, **over):
    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["config=transformer_tiny"])
    with open_dict(cfg):
        cfg.model.update(SMALL)
        cfg.data.seq_len, cfg.data.batch_size = 64, 4
        cfg.trainer.update(max_steps=8, eval_every=4, ckpt_every=4, eval_batches=2, log_every=2, progress=False,
                           run_dir=str(tmp_path / run), device="cpu")
        cfg.optim.warmup_steps = 2
        for k, v in over.items():
            cfg.trainer[k] = v
    return cfg


def test_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """transformer_tiny, shrunk: the loss falls, and a run killed after its step-4 checkpoint
    resumes onto the same loss curve."""
    full = train(_cfg(tmp_path, "full"))
    hist = dict(full["history"])
    assert hist[8] < hist[2]
    second = killed_then_resumed(monkeypatch, lambda resume: _cfg(tmp_path, "split", **({"resume": True} if resume
                                                                                           else {})), kill_at=4)
    got = dict(second["history"])
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(hist[step], rel=1e-6), step
    assert second["valid_bpb"] == pytest.approx(full["valid_bpb"], rel=1e-6)


def test_patterns_per_head():
    m = SparseTransformer(**SMALL, attention="strided+local,causal")
    lay = m.blocks[0].attn.attention.op.layout
    assert lay.shape == (2, 4, 4) and not (lay[0] == lay[1]).all()       # head 0 strided, head 1 local
    assert m.block_sparse_layouts()["blocks.0.attn"].shape == (4, 8)
    x = torch.randint(0, 256, (1, 64))
    x2 = x.clone()
    x2[0, 40] = (x2[0, 40] + 1) % 256
    assert torch.equal(m(x)[:, :40], m(x2)[:, :40])
    with pytest.raises(ValueError, match="model.attention"):
        SparseTransformer(**SMALL, attention="strided+dense")


def test_dense_layers_match_the_causal_pattern():
    """attention="dense" (SDPA, is_causal) gives the causal block-sparse layout's outputs and gradients."""
    torch.manual_seed(0)
    a = SparseTransformer(**SMALL, attention="causal", positions="rotary")
    b = SparseTransformer(**SMALL, attention="dense", positions="rotary")
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 256, (2, 64))
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-5)
    ga = torch.autograd.grad(ya.square().mean(), list(a.parameters()))
    gb = torch.autograd.grad(yb.square().mean(), list(b.parameters()))
    for p, q in zip(ga, gb):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert "blocks.0.attn" not in b.block_sparse_layouts()
    with pytest.raises(ValueError, match="'dense' takes a whole layer"):
        SparseTransformer(**SMALL, attention="dense+strided")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_glue_matches_the_plain_modules(backend):
    """fused=True (rotary from cached tables in one op, residual add + layer norm in one op; the
    kernels with backend="triton") gives the plain modules' outputs and gradients in fp32, from
    the same state dict."""
    torch.manual_seed(0)
    dev = kernel_device() if backend == "triton" else "cpu"
    kw = dict(SMALL, attention="strided+local,fixed", positions="rotary")
    plain = SparseTransformer(**kw, fused=False).to(dev)
    fused = SparseTransformer(**kw, fused=True, backend=backend).to(dev)
    fused.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 50), device=dev)
    ya, yb = plain(x), fused(x)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-4)
    ga = torch.autograd.grad(ya.square().mean(), list(plain.parameters()))
    gb = torch.autograd.grad(yb.square().mean(), list(fused.parameters()))
    for (name, _), p, q in zip(plain.named_parameters(), ga, gb):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_fused_glue_keeps_the_stream_in_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast the residual stream, the norms' outputs and the logits are bf16, and
    the loss is close to fp32's."""
    import bstrain.models.transformer as tm
    torch.manual_seed(0)
    m = SparseTransformer(**SMALL, attention="local", positions="rotary")
    seen = []

    def spy(x, r, *args, **kwargs):
        y, h = tm_add(x, r, *args, **kwargs)
        seen.append((x.dtype, None if r is None else r.dtype, y.dtype, h.dtype))
        return y, h
    tm_add = tm.add_layer_norm
    monkeypatch.setattr(tm, "add_layer_norm", spy)
    x = torch.randint(0, 256, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    bf = torch.bfloat16
    assert y.dtype == bf and seen == [(bf, None, bf, bf)] + [(bf, bf, bf, bf)] * 4
    torch.testing.assert_close(y.float(), m(x), rtol=0.1, atol=0.1)


def test_meta_construction_to_empty_and_load():
    """Built under a meta default device, moved with to_empty and loaded: the reference's outputs
    (the attention tables were made on the CPU when the model was built, not on the meta device)."""
    torch.manual_seed(0)
    ref = SparseTransformer(**SMALL, attention="strided+local,fixed")
    with torch.device("meta"):
        m = SparseTransformer(**SMALL, attention="strided+local,fixed")
    assert m.head.weight.is_meta
    m.to_empty(device="cpu")
    m.load_state_dict(ref.state_dict())
    x = torch.randint(0, 256, (2, 40))
    torch.testing.assert_close(m(x), ref(x))


def test_inference_mode_first_then_training_and_export():
    """A first forward under inference_mode, then a training step; torch.export of a fresh model
    (non-strict), after which the eager model still returns real tensors."""
    torch.manual_seed(0)
    m = SparseTransformer(**SMALL, attention="fixed,strided")
    x = torch.randint(0, 256, (2, 64))
    with torch.inference_mode():
        m(x)
    m(x).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    fresh = SparseTransformer(**SMALL, attention="strided+causal")
    ep = torch.export.export(fresh, (x,), strict=False)
    y = fresh(x)
    assert type(y) is torch.Tensor
    torch.testing.assert_close(ep.module()(x), y)
