"""train(cfg): a falling loss, run-dir contents, exact resume, kill safety, fp16 overflow, eval/sample."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bstrain.train import checkpoint as ckpt_mod
from bstrain.train import step as step_mod
from bstrain.train import trainer as trainer_mod
from bstrain.train.trainer import train

REPO = Path(__file__).parents[2]


def test_trains_and_writes_the_run_dir(make_cfg):
    cfg = make_cfg(trainer__max_steps=30, trainer__eval_every=15)
    out = train(cfg)
    run = Path(out["run_dir"])
    losses = [loss for _, loss in out["history"]]
    assert out["steps"] == 30 and math.isfinite(out["valid_bpb"])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, f"loss did not fall: {losses}"
    assert (run / "train.log").read_text().count("valid loss") == 2
    assert list((run / "tb").glob("events.out.tfevents.*")), "TensorBoard events missing"
    assert ckpt_mod.latest_checkpoint(run / "ckpt").name == "step_00000030.pt"


def test_dense_variant_and_layout_choices(make_cfg):
    for overrides in (dict(model__sparse=False), dict(model__layout="watts_strogatz", model__density=0.5),
                      dict(model__layout="random", model__layer_norm=False, model__depth=1)):
        out = train(make_cfg(trainer__max_steps=3, **overrides, run=str(sorted(overrides.items()))))
        assert math.isfinite(out["train_loss"])


class _Killed(Exception):
    pass


def test_resume_continues_the_same_loss_curve(make_cfg, monkeypatch):
    full = train(make_cfg(trainer__max_steps=12, run="full"))
    real_save = trainer_mod.save_checkpoint

    def save_then_die(path, state):                     # the run dies right after its step-8 checkpoint
        real_save(path, state)
        if state["step"] == 8:
            raise _Killed
    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_die)
    with pytest.raises(_Killed):
        train(make_cfg(trainer__max_steps=12, run="split"))
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real_save)
    second = train(make_cfg("trainer.resume=true", trainer__max_steps=12, run="split"))
    got, want = dict(second["history"]), dict(full["history"])
    assert sorted(got) == [9, 10, 11, 12]
    for step in got:                    # bitwise on CPU; GPU reductions may differ in the last bits
        assert got[step] == pytest.approx(want[step], rel=1e-6), f"step {step}: {got[step]} != {want[step]}"
    assert second["valid_bpb"] == pytest.approx(full["valid_bpb"], rel=1e-6)


def test_resume_from_path_and_corrupt_checkpoint(make_cfg, tmp_path):
    out = train(make_cfg(trainer__max_steps=4, run="a"))
    path = Path(out["run_dir"]) / "ckpt" / "step_00000004.pt"
    more = train(make_cfg(f"trainer.resume={path}", trainer__max_steps=6, run="b"))
    assert [s for s, _ in more["history"]] == [5, 6]
    bad = tmp_path / "step_00000009.pt"
    bad.write_bytes(path.read_bytes()[:1000])                            # truncated
    with pytest.raises(ckpt_mod.CheckpointError, match=str(bad)):
        ckpt_mod.load_checkpoint(bad)
    with pytest.raises(ckpt_mod.CheckpointError, match="does not exist"):
        ckpt_mod.load_checkpoint(tmp_path / "missing.pt")


def test_sigkill_mid_training_resumes_from_last_complete_checkpoint(tmp_path):
    """Kill -9 a training process, plant a half-written checkpoint, resume: the last complete one wins."""
    run = tmp_path / "killed"
    def args(*extra):
        return [sys.executable, "-m", "bstrain", "train", f"trainer.run_dir={run}", "trainer.ckpt_every=2",
                "trainer.eval_every=0", "trainer.progress=false", "trainer.keep_ckpts=100", "model.hidden=64",
                "model.embed=16", "model.block_size=16", "data.seq_len=8", "data.batch_size=2",
                f"hydra.run.dir={tmp_path / 'hydra'}", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(args("trainer.max_steps=100000"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            done = sorted((run / "ckpt").glob("step_*.pt")) if (run / "ckpt").is_dir() else []
            if len(done) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoints appeared")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    last = ckpt_mod.latest_checkpoint(run / "ckpt")
    step = int(last.stem.split("_")[1])
    # a kill during a write leaves only the temp file: simulate one for a later step
    (run / "ckpt" / f"step_{step + 2:08d}.pt.tmp").write_bytes(last.read_bytes()[:500])
    resumed = subprocess.run(args(f"trainer.max_steps={step + 2}", "trainer.resume=true"), env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert f"resumed from {last} at step {step}" in log
    assert ckpt_mod.latest_checkpoint(run / "ckpt").name == f"step_{step + 2:08d}.pt"


def test_fp16_overflow_skips_the_step_and_never_writes_nan(make_cfg, monkeypatch):
    def final_state(inject: bool, run: str) -> dict:
        real_ce = torch.nn.functional.cross_entropy
        calls = {"n": 0}

        def maybe_overflowing_ce(*args, **kwargs):
            calls["n"] += 1
            loss = real_ce(*args, **kwargs)
            return loss * float("inf") if inject and calls["n"] == 3 else loss    # step 3 overflows
        monkeypatch.setattr(step_mod.F, "cross_entropy", maybe_overflowing_ce)
        cfg = make_cfg(trainer__max_steps=5, trainer__precision="fp16", trainer__eval_every=0,
                       trainer__ckpt_every=0, run=run)
        out = train(cfg)
        return torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000005.pt", weights_only=True)

    clean, hit = final_state(False, "clean"), final_state(True, "hit")
    assert all(torch.isfinite(v).all() for v in hit["model"].values() if v.is_floating_point())
    steps = [int(s["step"]) for s in (clean["optimizer"]["state"][0], hit["optimizer"]["state"][0])]
    assert steps[1] == steps[0] - 1, f"the overflowing step must be skipped: optimizer steps {steps}"
    assert hit["scaler"]["scale"] < clean["scaler"]["scale"], "the overflow must lower the loss scale"


def test_bf16_runs(make_cfg):
    out = train(make_cfg(trainer__max_steps=3, trainer__precision="bf16"))
    assert math.isfinite(out["train_loss"])


@pytest.mark.parametrize("bad, match", [
    (dict(trainer__precision="fp8"), "trainer.precision"),
    (dict(optim__schedule="step"), "optim.schedule"),
    (dict(model__layout="grid"), "model.layout"),
    (dict(data__path="/definitely/missing.txt"), "missing.txt"),
])
def test_bad_config_values(make_cfg, bad, match):
    with pytest.raises(ValueError, match=match):
        train(make_cfg(**bad))


def test_too_small_data_is_a_clear_error(make_cfg, tmp_path):
    small = tmp_path / "tiny.txt"
    small.write_text("hello world " * 10)
    with pytest.raises(ValueError, match="tiny.txt"):
        train(make_cfg(data__path=str(small)))


def test_eval_and_sample_commands(make_cfg):
    from omegaconf import OmegaConf

    from bstrain.train.commands import evaluate_checkpoint, sample
    out = train(make_cfg(trainer__max_steps=4, optim__ema=0.9))
    res = evaluate_checkpoint(OmegaConf.create(dict(ckpt=out["run_dir"], split="test", device="cpu", batches=2,
                                                    data_path=None)))
    assert math.isfinite(res["bpb"]) and res["step"] == 4
    text = sample(OmegaConf.create(dict(ckpt=out["run_dir"], prompt="def ", length=20, temperature=1.0, seed=0,
                                        device="cpu")))
    assert text.startswith("def ") and len(text.encode("utf-8", errors="replace")) >= 4


def test_model_init_and_tiny_hidden():
    from bstrain.configs.schema import ModelConfig
    from bstrain.models.lstm import SparseLSTM
    dense = SparseLSTM(ModelConfig(hidden=64, block_size=32, sparse=False, init="identity"))
    torch.testing.assert_close(dense.w_hm.weight, torch.eye(64))
    with pytest.raises(ValueError, match="model.init"):
        SparseLSTM(ModelConfig(hidden=64, block_size=32, init="orthgonal"))
    for kind in ("barabasi_albert", "watts_strogatz", "random"):
        SparseLSTM(ModelConfig(hidden=32, block_size=32, layout=kind))        # one block: dense layout
        SparseLSTM(ModelConfig(hidden=64, block_size=32, layout=kind))


def test_enwik8_experiment_config_on_a_small_enwik8_file(make_cfg, tmp_path):
    """config=lstm_enwik8 composes and trains (shrunk) on a file named enwik8 (proportional split)."""
    text = (Path(__file__).read_bytes() * 40)[:200_000]
    (tmp_path / "enwik8").write_bytes(text)
    cfg = make_cfg("config=lstm_enwik8", f"data.path={tmp_path / 'enwik8'}", trainer__max_steps=2,
                   optim__warmup_steps=1)
    assert cfg.data.name == "enwik8" and cfg.trainer.precision == "bf16" and cfg.optim.ema == 0.999
    out = train(cfg)
    assert out["steps"] == 2 and math.isfinite(out["valid_bpb"])


def test_cuda_graph_config_errors(make_cfg):
    from bstrain.train.graphs import check_graph_config
    with pytest.raises(ValueError, match="trainer.cuda_graph: needs a CUDA device"):
        train(make_cfg(trainer__device="cpu", trainer__cuda_graph=True))
    with pytest.raises(ValueError, match="trainer.cuda_graph: expected precision fp32 or bf16, got 'fp16'"):
        check_graph_config(torch.device("cuda"), "fp16", 1)
    with pytest.raises(ValueError, match="trainer.cuda_graph: expected a single process"):
        check_graph_config(torch.device("cuda"), "bf16", 2)
    check_graph_config(torch.device("cuda"), "bf16", 1)


@pytest.mark.gpu
def test_cuda_graph_follows_the_eager_trajectory(make_cfg):
    """Replaying a captured step trains exactly like the eager loop, across evals, checkpoints
    and a resume (the warm-up steps before capture are undone)."""
    common = dict(trainer__max_steps=10, trainer__device="cuda", trainer__eval_every=5)
    eager = train(make_cfg(**common, run="eager"))
    graphed = train(make_cfg(**common, trainer__cuda_graph=True, run="graph"))
    got, want = dict(graphed["history"]), dict(eager["history"])
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), f"step {step}: {got[step]} != {want[step]}"
    assert graphed["valid_bpb"] == pytest.approx(eager["valid_bpb"], rel=1e-4)
    # resume a graphed run from an eager checkpoint (float learning rates become tensors)
    path = Path(eager["run_dir"]) / "ckpt" / "step_00000008.pt"
    more = train(make_cfg(f"trainer.resume={path}", **common, trainer__cuda_graph=True, run="resumed"))
    for step, loss in more["history"]:
        assert loss == pytest.approx(want[step], rel=1e-4), f"resumed step {step}: {loss} != {want[step]}"
    # graph -> graph (a checkpoint's lr tensors load on the CPU and must become device tensors
    # again, or the schedule would stop reaching the graph) and graph -> eager
    gpath = Path(graphed["run_dir"]) / "ckpt" / "step_00000008.pt"
    for run, graph in (("regraphed", True), ("degraphed", False)):
        more = train(make_cfg(f"trainer.resume={gpath}", **common, trainer__cuda_graph=graph, run=run))
        for step, loss in more["history"]:
            assert loss == pytest.approx(want[step], rel=1e-4), f"{run} step {step}: {loss} != {want[step]}"
    bf16 = train(make_cfg(**common, trainer__cuda_graph=True, trainer__precision="bf16", run="bf16"))
    assert math.isfinite(bf16["valid_bpb"]) and bf16["history"][-1][1] < bf16["history"][0][1]


def test_loaded_optimizer_groups_follow_this_run(make_cfg):
    """A checkpoint's param groups carry the saving run's settings; this run's choice wins."""
    cfg = make_cfg()
    model = torch.nn.Linear(3, 2)
    opt = trainer_mod.make_optimizer(model, cfg.optim, torch.device("cpu"))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    for g in saved["param_groups"]:
        g["lr"], g["capturable"], g["fused"], g["foreach"] = torch.tensor(0.01), True, True, None
    fresh = trainer_mod.make_optimizer(model, cfg.optim, torch.device("cpu"))
    fresh.load_state_dict(saved)
    trainer_mod._match_graph_mode(fresh, False, torch.device("cpu"))
    for g in fresh.param_groups:
        assert g["lr"] == pytest.approx(0.01) and isinstance(g["lr"], float)
        assert (g["capturable"], g["fused"], g["foreach"]) == (False, None, True)
    steps = [st["step"] for st in fresh.state.values()]
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 and float(s) == 1.0 for s in steps)
    trainer_mod._match_graph_mode(fresh, True, torch.device("cpu"))
    assert all(isinstance(g["lr"], torch.Tensor) and g["capturable"] for g in fresh.param_groups)
    trainer_mod._match_graph_mode(fresh, False, torch.device("cpu"))
    fresh.step()                                         # still a working optimizer
    assert all(float(st["step"]) == 2.0 for st in fresh.state.values())
