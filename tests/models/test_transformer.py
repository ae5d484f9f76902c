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


def _cfg(tmp_path, run, model=None, **over):
    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["config=transformer_tiny"])
    with open_dict(cfg):
        cfg.model.update(SMALL)
        cfg.model.update(model or {})
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


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_fused_glue_keeps_the_stream_in_the_autocast_dtype(monkeypatch, dropout):
    """Under bf16 autocast the residual stream, the norms' outputs and the logits are bf16 (residual
    dropout too), and the loss is close to fp32's."""
    import bstrain.models.transformer as tm
    torch.manual_seed(0)
    m = SparseTransformer(**SMALL, attention="local", positions="rotary", dropout=dropout)
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
    m.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    # bf16 keeps 8 mantissa bits (rel 4e-3 a rounding) through every layer: an autocast check, not a precision one
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
    torch.manual_seed(0)
    twin = SparseTransformer(**SMALL, attention="fixed,strided")         # the same weights, no inference call
    twin(x).logsumexp(-1).mean().backward()
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fresh = SparseTransformer(**SMALL, attention="strided+causal")
    ep = torch.export.export(fresh, (x,), strict=False)
    y = fresh(x)
    assert type(y) is torch.Tensor
    torch.testing.assert_close(ep.module()(x), y)


# --- activation checkpointing (model.checkpoint) -----------------------------------------------------------
def _loss_and_grads(m, x, seed=1):
    torch.manual_seed(seed)                    # the dropout masks' stream
    loss = m(x).logsumexp(-1).mean()
    return loss, torch.autograd.grad(loss, list(m.parameters()))


def _saved_bytes(m, x) -> int:
    """Bytes autograd keeps for the backward outside any checkpoint (a checkpoint's own holders
    are packed by its hooks, not these)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).logsumexp(-1).mean()
    return total


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_checkpoint_gives_the_same_loss_and_gradients(fused, dropout):
    """checkpoint=True: the loss and every parameter's gradient equal checkpoint=False's exactly
    (fp32, same seeds; with dropout the recompute draws the same masks), autograd keeps less,
    and without grad (evaluation) the forward is the same."""
    kw = dict(SMALL, n_layer=3, attention="strided+local,fixed,dense", positions="rotary", fused=fused,
              dropout=dropout)
    torch.manual_seed(0)
    plain = SparseTransformer(**kw)
    ckpt = SparseTransformer(**kw, checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 50))
    want, got = _loss_and_grads(plain, x), _loss_and_grads(ckpt, x)
    assert got[0].item() == want[0].item()
    for (name, _), p, q in zip(plain.named_parameters(), want[1], got[1]):
        assert torch.equal(q, p), f"{name}: worst {(q - p).abs().max().item():.3g}"
    assert _saved_bytes(ckpt, x) < _saved_bytes(plain, x) / 2
    plain.eval(), ckpt.eval()
    with torch.no_grad():
        assert torch.equal(ckpt(x), plain(x))


def test_checkpoint_under_torch_compile():
    """torch.compile(fullgraph=True) traces the checkpointed blocks (dropout on) with no graph
    break, and gives the eager model's loss and gradients."""
    kw = dict(SMALL, attention="strided+local,fixed", positions="rotary", dropout=0.2)
    torch.manual_seed(0)
    ref = SparseTransformer(**kw)
    m = SparseTransformer(**kw, checkpoint=True)
    m.load_state_dict(ref.state_dict())
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randint(0, 256, (2, 64))
    (want, gw), (got, gg) = _loss_and_grads(ref, x), _loss_and_grads(compiled, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, _), p, q in zip(ref.named_parameters(), gw, gg):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=lambda msg: f"{name}: {msg}")


def test_checkpoint_and_dropout_errors():
    with pytest.raises(ValueError, match="model.checkpoint: expected true or false, got 'yes'"):
        SparseTransformer(**SMALL, checkpoint="yes")
    with pytest.raises(ValueError, match=r"model.dropout: expected a probability in \[0, 1\), got 1.0"):
        SparseTransformer(**SMALL, dropout=1.0)


def test_trainer_with_checkpoint_follows_the_same_trajectory(tmp_path):
    """transformer_tiny, shrunk, through the trainer on the CPU: model.checkpoint=true (dropout on)
    trains to the same losses and validation as false."""
    model = dict(dropout=0.1)
    common = dict(max_steps=4, eval_every=0, ckpt_every=0, log_every=1)
    plain = train(_cfg(tmp_path, "plain", model=model, **common))
    ckpt = train(_cfg(tmp_path, "ckpt", model=dict(model, checkpoint=True), **common))
    assert ckpt["steps"] == 4 and dict(ckpt["history"]) == dict(plain["history"])
    assert ckpt["valid_bpb"] == plain["valid_bpb"]


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_checkpoint_in_the_cuda_graph_step(tmp_path, dropout):
    """On CUDA the checkpointed step is captured as one graph (the default mode), compiled or not,
    and trains as the uncheckpointed graph does: with dropout, the recompute inside the graph
    draws the masks of the forward (torch's checkpoint saves and restores the CUDA generator's
    state inside the capture). Compiled code draws other masks than eager, so the compiled run is
    compared without dropout only."""
    common = dict(max_steps=6, eval_every=0, ckpt_every=0, log_every=1, device="cuda")
    plain = train(_cfg(tmp_path, "plain", model=dict(dropout=dropout), **common))
    ckpt = train(_cfg(tmp_path, "ckpt", model=dict(dropout=dropout, checkpoint=True), **common))
    both = train(_cfg(tmp_path, "both", model=dict(dropout=dropout, checkpoint=True), compile=True, **common))
    assert (plain["step_mode"], ckpt["step_mode"], both["step_mode"]) == ("graph", "graph", "graph (compiled)")
    for step, want in dict(plain["history"]).items():
        assert dict(ckpt["history"])[step] == pytest.approx(want, rel=1e-4), f"step {step}"
        if not dropout:
            assert dict(both["history"])[step] == pytest.approx(want, rel=2e-4), f"step {step}"
