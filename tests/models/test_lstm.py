"""SparseLSTM against a plain float64 re-statement of the mLSTM recurrence, outputs and gradients."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bstrain.nn import set_grad_group
from bstrain.models.lstm import LSTMConfig, SparseLSTM


def _ln(x, g, b, segments=1, relu=False):
    n, c = x.shape
    y = F.layer_norm(x.reshape(n, segments, c // segments), (c // segments,), eps=1e-6).reshape(n, c) * g + b
    return torch.relu(y) if relu else y


def reference(model: SparseLSTM, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor):
    """m = LN(x W_xm) * LN(h W_hm); m = ReLU(LN(m W_d)); gates = x W_xg + LN4(m W_mg) + bias;
    gate order i, u, f, o with forget bias 1."""
    H = model.cfg.hidden

    def w(layer):                              # the (C, K) dense equivalent, differentiable
        if not model.cfg.sparse:
            return layer.weight.t()
        lay, bs = layer.op.layout, layer.op.block_size
        dense = layer.weight.new_zeros(lay.shape[0], lay.shape[1], bs, bs)
        dense[np.nonzero(lay)] = layer.weight                          # blocks in row-major layout order
        return dense.permute(0, 2, 1, 3).reshape(lay.shape[0] * bs, lay.shape[1] * bs)
    emb = model.embedding[x]                                            # (B, T, E)
    xw = emb @ model.w_x.weight.t()
    outs = []
    for t in range(x.shape[1]):
        m = _ln(xw[:, t, :H], model.norm_xm.g, model.norm_xm.b) * _ln(h @ w(model.w_hm), model.norm_hm.g,
                                                                        model.norm_hm.b)
        for layer, norm in zip(model.deep, model.norm_deep):
            m = _ln(m @ w(layer), norm.g, norm.b, relu=True)
        gates = xw[:, t, H:] + _ln(m @ w(model.w_mg), model.norm_gates.g, model.norm_gates.b, segments=4)
        i, u, f, o = (gates + model.gate_bias).chunk(4, dim=1)
        c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(u)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return model.head(torch.stack(outs, 1)), (c, h)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_forward_and_gradients_match_the_recurrence(sparse, group_size):
    torch.manual_seed(0)
    cfg = LSTMConfig(hidden=64, embed=16, block_size=16, depth=3, density=0.5, layout="random", sparse=sparse)
    model = SparseLSTM(cfg).double()
    set_grad_group(model, group_size)
    with torch.no_grad():                      # non-trivial layer-norm parameters and gate bias
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    x = torch.randint(0, 256, (3, 7))
    c0, h0 = torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64)
    logits, (c, h) = model(x, (c0, h0))
    assert logits.shape == (3, 7, 256)
    dl = torch.randn_like(logits)
    grads = torch.autograd.grad((logits * dl).sum() + c.sum() + h.square().sum(), list(model.parameters()))
    ref_logits, (rc, rh) = reference(model, x, c0, h0)
    ref_grads = torch.autograd.grad((ref_logits * dl).sum() + rc.sum() + rh.square().sum(), list(model.parameters()))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(c, rc, rtol=1e-9, atol=1e-10)
    for (name, _), g, rg in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-8, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_reference_blocks_follow_the_layout():
    """The test's dense equivalent agrees with the kernel tests' (row-major block order)."""
    from tests.conftest import dense_weight
    model = SparseLSTM(LSTMConfig(hidden=64, embed=16, block_size=16, depth=1, density=0.5, layout="random")).double()
    layer = model.w_hm
    lay, bs = layer.op.layout, layer.op.block_size
    dense = layer.weight.new_zeros(lay.shape[0], lay.shape[1], bs, bs)
    dense[np.nonzero(lay)] = layer.weight
    ours = dense.permute(0, 2, 1, 3).reshape(lay.shape[0] * bs, lay.shape[1] * bs)
    torch.testing.assert_close(ours, dense_weight(lay, layer.weight))


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [1, 8])
def test_kernels_on_cuda_match_the_float64_recurrence(group_size):
    """fp32 on CUDA (block-sparse, layer-norm and LSTM-gate kernels) against the float64 reference."""
    torch.manual_seed(1)
    cfg = LSTMConfig(hidden=128, embed=16, block_size=32, depth=2, density=0.5, layout="random")
    ref_model = SparseLSTM(cfg).double()
    with torch.no_grad():
        for p in ref_model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model = SparseLSTM(cfg)
    model.load_state_dict(ref_model.state_dict())
    model = model.cuda()
    set_grad_group(model, group_size)
    x = torch.randint(0, 256, (4, 9))
    logits, (c, h) = model(x.cuda(), None)
    (logits.square().sum() + h.sum()).backward()
    z = torch.zeros(4, 128, dtype=torch.float64)
    ref_logits, (_, rh) = reference(ref_model, x, z, z)
    (ref_logits.square().sum() + rh.sum()).backward()
    torch.testing.assert_close(logits.double().cpu(), ref_logits, rtol=2e-4, atol=2e-4)
    for (name, p), rp in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.double().cpu(), rp.grad, rtol=5e-4, atol=5e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_shared_cast_sums_timestep_gradients_in_fp32():
    """A parameter cast to bf16 once and used at 256 timesteps gets the fp32 sum of its per-step
    gradients (a shared cast node would add them up in bf16 first: errors of about 1e-2)."""
    from bstrain.models.lstm import shared_cast
    torch.manual_seed(0)
    p = torch.randn(512, requires_grad=True)
    xs = torch.randn(256, 512).to(torch.bfloat16)
    use = shared_cast(p, torch.bfloat16)
    loss = sum((use() * x).float().sum() for x in xs)
    loss.backward()
    want = xs.double().sum(0)                     # each step's gradient is x_t, exact in bf16
    torch.testing.assert_close(p.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert shared_cast(p, torch.float32)() is p   # same dtype: the parameter itself


def _randomised(cfg: LSTMConfig, dtype=torch.float32) -> SparseLSTM:
    """A model with non-trivial layer-norm parameters and gate bias."""
    model = SparseLSTM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _run(model, x, c0, h0, dl):
    """((logits, c, h), parameter gradients) of a loss on all three outputs, in dl's dtype."""
    logits, (c, h) = model(x, (c0, h0))
    work = dl.dtype
    loss = (logits.to(work) * dl).sum() + c.to(work).sum() + h.to(work).square().sum()
    return (logits, c, h), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the kernels in Triton's interpreter on CPU tensors; on a GPU the bf16 test below "
                           "checks the fused loop")
@pytest.mark.parametrize("block_size", [16, 32], ids=["bs16", "bs32"])
def test_fused_steps_match_the_op_by_op_path(block_size, monkeypatch):
    """The kernel path's fused time loop (LN·xm, LN4 + add + gates, grouped parameter gradients)
    against the same kernels' op-by-op loop, in the interpreter: outputs, state and every
    gradient. The matmuls run in PyTorch here (their kernels have tests of their own), so the
    launches counted are the fused loop's own: one per layer norm and one per cell a step, each
    way, and no torch reduction or accumulation per step in backward."""
    from bstrain.kernels import launch
    monkeypatch.setenv("BSTRAIN_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = LSTMConfig(hidden=64, embed=16, block_size=block_size, depth=2, density=0.5 if block_size == 16 else 1.0,
                     layout="random")
    model = _randomised(cfg)
    for layer in model.sparse_layers():
        layer.op.backend = "torch"
    set_grad_group(model, 2)
    B, T = 3, 4
    x = torch.randint(0, 256, (B, T))
    c0, h0 = torch.randn(B, 64), torch.randn(B, 64)
    dl = torch.randn(B, T, 256)
    model.fused = False
    want, want_grads = _run(model, x, c0, h0, dl)
    model.fused = True
    before = launch.stats["jit"]
    got, got_grads = _run(model, x, c0, h0, dl)
    assert launch.stats["jit"] - before == 2 * T * cfg.depth + 2 * T      # LN·xm, deep LNs, cells; both ways
    for name, a, r in zip(("logits", "c", "h"), got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for (name, _), a, r in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_fused_bf16_step_is_as_accurate_as_op_by_op():
    """bf16 under autocast on CUDA, fused and op by op, each against the float64 recurrence: the
    fused loop's error is at most 2x the op-by-op loop's (plus bf16's floor), outputs and
    gradients (the tolerance rule of tests/conftest.py).

    depth=1: a deep update's ReLU makes the gradient discontinuous, so two 16-bit paths that round
    differently may take different ReLU decisions and both be right (its kernel has tests of its
    own). The state starts away from zero, where a layer norm of h·W_hm = 0 has rstd = 1/sqrt(eps)
    and magnifies every rounding difference a thousandfold."""
    from tests.conftest import TOL_FLOOR
    torch.manual_seed(2)
    cfg = LSTMConfig(hidden=256, embed=32, block_size=32, depth=1, density=0.3, layout="random")
    ref_model = _randomised(cfg, torch.float64)
    model = SparseLSTM(cfg)
    model.load_state_dict(ref_model.state_dict())
    model = model.cuda()
    set_grad_group(model, 4)
    B, T = 16, 12
    x = torch.randint(0, 256, (B, T))
    c0, h0 = torch.randn(B, 256, dtype=torch.float64), torch.randn(B, 256, dtype=torch.float64) * 0.5
    dl = torch.randn(B, T, 256, dtype=torch.float64)
    ref, ref_grads = _run(ref_model, x, c0, h0, dl)
    runs = {}
    for fused in (True, False):
        model.fused = fused
        with torch.autocast("cuda", dtype=torch.bfloat16):
            runs[fused] = _run(model, x.cuda(), c0.float().cuda(), h0.float().cuda(), dl.float().cuda())
    names = ["logits", "c", "h"] + [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        r = (ref[i] if i < 3 else ref_grads[i - 3]).detach()
        fused, plain = ((out[i] if i < 3 else grads[i - 3]).double().cpu() for out, grads in (runs[True], runs[False]))
        err, base = (fused - r).abs().max().item(), (plain - r).abs().max().item()
        assert err <= 2 * base + TOL_FLOOR[torch.bfloat16] * r.abs().max().item(), \
            f"{name}: fused error {err:.3g}, op-by-op {base:.3g}"
