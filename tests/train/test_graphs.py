"""CUDA graphs: the trainer's modes and fallback reasons, bstrain.graphed, graphed = eager, DDP capture."""
from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch

import bstrain
from bstrain.errors import UserError
from bstrain.train.graphs import CaptureError, _changed, _python_state, ema_decay, ema_update
from bstrain.train.trainer import train

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- CPU: modes, errors, the pieces ---------------------------------------------------------------------
def test_auto_trains_eagerly_on_the_cpu_and_true_refuses(make_cfg):
    out = train(make_cfg(trainer__max_steps=2, trainer__device="cpu"))
    assert out["step_mode"] == "eager" and out["steps"] == 2
    with pytest.raises(UserError, match=r"trainer.cuda_graph=true: needs a CUDA device, got device 'cpu'"):
        train(make_cfg(trainer__device="cpu", trainer__cuda_graph=True, run="true"))
    with pytest.raises(UserError, match=r"trainer.cuda_graph: expected auto, true or false, got 'sometimes'"):
        train(make_cfg(trainer__cuda_graph="sometimes", run="bad"))
    with pytest.raises(UserError, match="needs a CUDA device"):            # compile and graphs combine, on CUDA
        train(make_cfg(trainer__device="cpu", trainer__compile=True, trainer__cuda_graph=True, run="both"))


def test_the_result_reports_the_step_mode_and_each_windows_throughput(make_cfg):
    out = train(make_cfg(trainer__max_steps=4, trainer__log_every=2, trainer__cuda_graph=False))
    assert out["step_mode"] == "eager" and out["unit"] == "tokens"
    assert len(out["throughput"]) == 2 and all(r > 0 for r in out["throughput"])


def test_python_side_state_is_named():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls = torch.nn.Linear(2, 2), 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x)
    m = torch.nn.Sequential(Counter())
    before = _python_state([m])
    m(torch.randn(1, 2))
    assert _changed(before, _python_state([m])) == (
        "module 0 changes its attribute 'calls' at every call (0 -> 1); a graph would replay the captured value")
    assert _changed(before, before) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_ema_update_warms_up_its_decay(dtype):
    """The host-sync-free EMA of the graphed step: ema_t = d_t ema_(t-1) + (1 - d_t) w_t with
    d_t = min(decay, (1 + t) / (10 + t)), t the updates before (TF's num_updates, timm's warm-up),
    from the weights the EMA was made with; decay 0.3 is reached at the fourth update."""
    from torch.optim.swa_utils import AveragedModel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(dtype)
    ema = AveragedModel(model)
    want = [p.detach().double().clone() for p in model.parameters()]
    decays = []
    for t in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        assert float(ema_decay(ema.n_averaged, 0.3)) == pytest.approx(min(0.3, (1 + t) / (10 + t)))
        ema_update(ema, model, 0.3)
        d = min(0.3, (1 + t) / (10 + t))
        decays.append(d)
        want = [d * e + (1 - d) * p.detach().double() for e, p in zip(want, model.parameters())]
        for got, ref in zip(ema.module.parameters(), want):
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert decays[:3] == [0.1, 2 / 11, 3 / 12] and decays[3:] == [0.3] * 3
    assert int(ema.n_averaged) == 6


def test_ema_takes_the_models_buffers():
    """BatchNorm's running statistics of the EMA copy are the model's after each update (never the
    ones it was built with, which would normalise its evaluation wrongly)."""
    from torch.optim.swa_utils import AveragedModel
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2))
    ema = AveragedModel(model)
    for _ in range(3):
        model(torch.randn(5, 3, 8, 8) * 3 + 1)           # train mode: the running statistics move
        ema_update(ema, model, 0.9)
        for (name, got), ref in zip(ema.module.named_buffers(), model.buffers()):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
    assert not torch.allclose(ema.module[1].running_mean, torch.zeros(4))


def test_ema_resumes_its_warm_up(make_cfg):
    """A run split by a checkpoint and resumed has the EMA of the run that went straight through
    (the update count is in the checkpoint), and its validation says it reads the EMA weights. On
    the CPU, where steps are bitwise reproducible (the graphed step's EMA is checked against the
    eager one below)."""
    def cfg(run, *extra, steps=8):
        return make_cfg("optim.schedule=constant", "trainer.device=cpu", *extra, optim__ema=0.99,
                        trainer__max_steps=steps, trainer__ckpt_every=4, trainer__eval_every=0, run=run)
    full = train(cfg("full"))
    train(cfg("split", steps=4))
    split = train(cfg("split", "trainer.resume=true"))
    a, b = (torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000008.pt", weights_only=True)["ema"]
            for out in (full, split))
    assert int(a["n_averaged"]) == int(b["n_averaged"]) == 8
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
    assert split["valid_bpb"] == pytest.approx(full["valid_bpb"], rel=1e-6)
    log = (Path(full["run_dir"]) / "train.log").read_text()
    assert "step 8: valid (EMA weights) loss" in log and ", valid (EMA weights) loss" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_graphed_needs_cuda():
    with pytest.raises(ValueError, match="bstrain.graphed: needs a CUDA device"):
        bstrain.graphed(lambda x: x, torch.ones(2))


# --- GPU ---------------------------------------------------------------------------------------------------
def _losses(out):
    return dict(out["history"])


@gpu
@pytest.mark.parametrize("precision,ema", [("fp32", 0.0), ("fp16", 0.0), ("bf16", 0.9)])
def test_graphed_step_follows_the_eager_trajectory(make_cfg, precision, ema):
    """The default (auto) on CUDA captures the whole step, fp16 loss scaling and EMA included, and
    trains as the eager loop does."""
    common = dict(trainer__max_steps=8, trainer__device="cuda", trainer__eval_every=4, trainer__precision=precision,
                  optim__ema=ema)
    eager = train(make_cfg(**common, trainer__cuda_graph=False, run="eager"))
    graphed = train(make_cfg(**common, run="auto"))
    assert eager["step_mode"] == "eager" and graphed["step_mode"] == "graph"
    tol = 1e-4 if precision == "fp32" else 2e-3
    for step, want in _losses(eager).items():
        assert _losses(graphed)[step] == pytest.approx(want, rel=tol), f"step {step}"
    assert graphed["valid_bpb"] == pytest.approx(eager["valid_bpb"], rel=tol)


@gpu
def test_an_eager_step_between_replays_does_not_add_the_replays_gradients(make_cfg, monkeypatch):
    """A step the graph does not take (a batch of another shape) runs eagerly after replays that
    left their gradients in the parameters' .grad: it starts from none, as the eager loop does."""
    from bstrain.train.graphs import CapturedStep
    common = dict(trainer__max_steps=6, trainer__device="cuda", trainer__eval_every=0)
    eager = train(make_cfg(**common, trainer__cuda_graph=False, run="eager"))
    real_step, real_matches = CapturedStep.step, CapturedStep.matches
    seen = {"replays": 0, "forced": 0}

    def step(self, *args, **kwargs):
        seen["replays"] += 1
        return real_step(self, *args, **kwargs)

    def matches(self, x, y):                            # the third batch does not fit the graph
        if seen["replays"] == 2 and not seen["forced"]:
            seen["forced"] = 1
            return False
        return real_matches(self, x, y)
    monkeypatch.setattr(CapturedStep, "step", step)
    monkeypatch.setattr(CapturedStep, "matches", matches)
    mixed = train(make_cfg(**common, run="mixed"))
    assert seen == {"replays": 5, "forced": 1} and mixed["step_mode"] == "graph"
    for s, want in _losses(eager).items():
        assert _losses(mixed)[s] == pytest.approx(want, rel=1e-4), f"step {s}"


def _with_model(cfg, target: str):
    from omegaconf import OmegaConf, open_dict
    with open_dict(cfg):
        cfg.model = OmegaConf.create({"_target_": target})
    return cfg


@gpu
def test_fp16_overflow_skips_the_step_inside_the_graph():
    """A step whose gradients overflow is skipped by the graph's device-side loss scaling: the
    scale halves, the weights and AdamW's state stay, and the next step trains again."""
    from omegaconf import OmegaConf

    from bstrain.train.graphs import CapturedStep
    from bstrain.train.step import Forward
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    from tests.train.user_models import BoostLM
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = BoostLM().to(dev)
    opt = make_optimizer(model, OmegaConf.create(dict(lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8)),
                         dev, capturable=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    step = CapturedStep(Forward(model, torch.float16, dev), ByteLM().loss, opt, 1.0, scaler=scaler)
    x = torch.randint(0, 256, (4, 16), device=dev)
    step.step(x, x, False)
    assert scaler.get_scale() == 2.0**10
    before = [p.detach().clone() for p in model.parameters()]
    model.boost.fill_(float("inf"))
    _, _, _, skipped = step.step(x, x, False)
    assert int(skipped) == 1 and scaler.get_scale() == 2.0**9
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "a skipped step left the weights as they were"
    model.boost.fill_(1.0)
    _, _, _, skipped = step.step(x, x, False)
    assert int(skipped) == 0 and all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@gpu
def test_python_side_state_falls_back_with_its_reason(make_cfg):
    out = train(_with_model(make_cfg(trainer__max_steps=3, trainer__device="cuda"), "tests.train.user_models.OverflowLM"))
    assert out["step_mode"] == "eager"
    text = open(os.path.join(out["run_dir"], "train.log")).read()
    assert "could not capture it: module (root) changes its attribute 'calls' at every call" in text


@gpu
def test_auto_falls_back_on_a_host_sync_and_true_refuses(make_cfg):
    target = "tests.train.user_models.SyncingLM"
    out = train(_with_model(make_cfg(trainer__max_steps=3, trainer__device="cuda"), target))
    assert out["step_mode"] == "eager" and math.isfinite(out["train_loss"])
    text = open(os.path.join(out["run_dir"], "train.log")).read()
    assert "trainer.cuda_graph=auto could not capture it" in text and "host sync" in text
    with pytest.raises(UserError, match="trainer.cuda_graph=true: the step cannot be captured"):
        train(_with_model(make_cfg(trainer__max_steps=3, trainer__device="cuda", trainer__cuda_graph=True,
                                   run="strict"), target))


@gpu
def test_compile_and_graph_combine(make_cfg):
    common = dict(trainer__max_steps=6, trainer__device="cuda", trainer__eval_every=3, data__seq_len=8)
    eager = train(make_cfg(**common, trainer__cuda_graph=False, run="eager"))
    both = train(make_cfg(**common, trainer__compile=True, run="both"))
    assert both["step_mode"] == "graph (compiled)"
    for step, want in _losses(eager).items():
        assert _losses(both)[step] == pytest.approx(want, rel=2e-4), f"step {step}"


def _small_model():
    from bstrain.nn import BlockSparseLinear
    return torch.nn.Sequential(BlockSparseLinear(64, 128, block_size=32, density=0.5, seed=0), torch.nn.GELU(),
                               BlockSparseLinear(128, 64, block_size=32, density=0.5, seed=1)).cuda()


@gpu
def test_graphed_helper_trains_like_the_eager_loop():
    """The README's loop: bstrain.graphed(step, x, y, restore=(model, opt)) replays the same steps."""
    torch.manual_seed(0)
    data = [(torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")) for _ in range(5)]

    def run(graph: bool):
        torch.manual_seed(1)
        model = _small_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        fn = bstrain.graphed(step, *data[0], restore=(model, opt)) if graph else step
        return [fn(x, y).item() for x, y in data]
    eager, graphed = run(False), run(True)
    assert graphed == pytest.approx(eager, rel=1e-3)
    assert graphed[-1] < graphed[0]


@gpu
def test_graphed_helper_checks_its_arguments():
    model = _small_model()
    fn = bstrain.graphed(lambda x: model(x), torch.randn(8, 64, device="cuda"))
    with pytest.raises(ValueError, match=r"args\[0\]: the graph was captured with"):
        fn(torch.randn(4, 64, device="cuda"))
    with pytest.raises(ValueError, match="args: the graph was captured with 1 arguments, got 2"):
        fn(torch.randn(8, 64, device="cuda"), 1)
    with pytest.raises(ValueError, match=r"args\[0\]: expected a CUDA tensor"):
        bstrain.graphed(lambda x: x, torch.ones(2))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"restore\[1\]: AdamW needs capturable=True"):
        bstrain.graphed(lambda x: model(x), torch.randn(8, 64, device="cuda"), restore=(model, opt))
    x = torch.randn(8, 64, device="cuda")
    out = fn(x).clone()
    torch.testing.assert_close(out, model(x))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@gpu
def test_ddp_step_captured_with_its_all_reduce_matches_eager():
    """DDP (NCCL, one rank on this GPU): the captured step, all-reduce included, trains as eager."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bstrain.train.graphs import CapturedStep
    from bstrain.train.step import Forward, train_step
    from bstrain.train.trainer import make_optimizer
    from omegaconf import OmegaConf
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        optim = OmegaConf.create(dict(lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8))
        data = [(torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")) for _ in range(4)]
        loss_fn = lambda out, y: torch.nn.functional.mse_loss(out.float(), y)       # noqa: E731
        results = []
        for graph in (False, True):
            torch.manual_seed(0)
            model = _small_model()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                net = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
            torch.cuda.current_stream().wait_stream(side)
            opt = make_optimizer(model, optim, torch.device("cuda"), capturable=graph)
            fwd = Forward(net, torch.bfloat16, torch.device("cuda"))
            if graph:
                step = CapturedStep(fwd, loss_fn, opt, 1.0, warmup=11, model=model)
                results.append([step.step(x, y, False)[0].item() for x, y in data])
            else:
                results.append([train_step(fwd, loss_fn, x, y, None, opt, list(model.parameters()), 1.0)[0].item()
                                for x, y in data])
        assert results[1] == pytest.approx(results[0], rel=1e-3)
    finally:
        dist.destroy_process_group()


@gpu
def test_capture_error_names_the_sync():
    from bstrain.train.graphs import _capture
    x = torch.ones(4, device="cuda")
    with pytest.raises(CaptureError, match="the step syncs with the host: .*host sync"):
        _capture(lambda: x * float(x.sum()), 2, x.device, None)
    # a sync only while capturing passes the warm-up; the failed capture leaves the RNG working
    with pytest.raises(CaptureError, match="capture failed"):
        _capture(lambda: x * (float(x.sum()) if torch.cuda.is_current_stream_capturing() else 1.0), 1, x.device, None)
    assert torch.randn(3, device="cuda").isfinite().all()
    torch.nn.functional.dropout(x, 0.5)
