"""train(cfg): a falling loss, run-dir contents, exact resume, kill safety, fp16 overflow, eval/sample."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from bstrain.train import checkpoint as ckpt_mod
from bstrain.train import trainer as trainer_mod
from bstrain.train.tasks import lm as lm_task
from bstrain.errors import UserError
from bstrain.train.trainer import train
from tests.conftest import killed_then_resumed

REPO = Path(__file__).parents[2]


def test_trains_and_writes_the_run_dir(make_cfg):
    cfg = make_cfg(trainer__max_steps=30, trainer__eval_every=15)
    out = train(cfg)
    run = Path(out["run_dir"])
    losses = [loss for _, loss in out["history"]]
    assert out["steps"] == 30 and math.isfinite(out["valid_bpb"])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, f"loss did not fall: {losses}"
    log = (run / "train.log").read_text()
    assert log.count(": valid loss") == 2
    assert len(re.findall(r" INFO step \d+ loss \S+ \(avg2\) ", log)) == 15, "every log_every=2 steps a line in train.log"
    assert list((run / "tb").glob("events.out.tfevents.*")), "TensorBoard events missing"
    assert ckpt_mod.latest_checkpoint(run / "ckpt").name == "step_00000030.pt"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(run / "tb"), size_guidance={"images": 0}).Reload()
    layouts = board.Tags()["images"]
    assert layouts and all(t.startswith("layout/") for t in layouts), layouts
    for tag in layouts:                                  # 4 or 16 blocks on the long side: 64 or 16 pixels a block
        image = board.Images(tag)[0]
        assert max(image.width, image.height) == 256, (tag, image.width, image.height)


def test_layout_pictures_are_scaled_up_block_by_block():
    from bstrain.train.progress import layout_picture
    lay = np.zeros((3, 5), dtype=bool)
    lay[0, 0] = lay[2, 4] = True
    img = layout_picture(lay)
    assert img.shape == (3 * 52, 5 * 52) and img.dtype == np.uint8        # the long side >= 256 px
    blocks = img.reshape(3, 52, 5, 52)
    assert (blocks.min(axis=(1, 3)) == blocks.max(axis=(1, 3))).all(), "each block one flat square"
    assert (blocks[:, 0, :, 0] == lay * 255).all()
    assert layout_picture(np.ones((512, 300), dtype=bool)).shape == (512, 300), "large layouts stay 1 px a block"


def _dense_model(state):
    assert state["w_hm.weight"].shape == (64, 64) and not any(k.endswith(".layout") for k in state), list(state)


def _small_world(state):                                  # 4x4 blocks: watts_strogatz gives 0.75, not 0.5
    from bstrain.models.lstm import small_world_layout
    assert np.array_equal(state["w_hm.layout"].numpy(), small_world_layout(4, 0.5, "watts_strogatz", 0))
    assert int(state["w_hm.layout"].sum()) == 12 and state["w_hm.weight"].shape == (12, 16, 16)


def _random_shallow_no_norm(state):
    assert int(state["w_hm.layout"].sum()) == 6, "random: 0.375 of 16 blocks exactly"
    assert not [k for k in state if k.startswith(("norm", "deep."))], list(state)


@pytest.mark.filterwarnings("ignore:model.density")
def test_dense_variant_and_layout_choices(make_cfg):
    for check, overrides in ((_dense_model, dict(model__sparse=False)),
                             (_small_world, dict(model__layout="watts_strogatz", model__density=0.5)),
                             (_random_shallow_no_norm, dict(model__layout="random", model__layer_norm=False,
                                                            model__depth=1))):
        out = train(make_cfg(trainer__max_steps=3, **overrides, run=str(sorted(overrides.items()))))
        check(torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000003.pt", weights_only=True)["model"])


def test_resume_continues_the_same_loss_curve(make_cfg, monkeypatch):
    full = train(make_cfg(trainer__max_steps=12, run="full"))
    second = killed_then_resumed(monkeypatch, lambda resume: make_cfg(*(["trainer.resume=true"] if resume else []),
                                                                      trainer__max_steps=12, run="split"), kill_at=8)
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
                "model.embed=16", "model.block_size=16", "data.seq_len=8", "data.batch_size=2", *extra]
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
        real_ce = lm_task.cross_entropy
        calls = {"n": 0}

        def maybe_overflowing_ce(*args, **kwargs):
            calls["n"] += torch.is_grad_enabled()        # training steps only, not the start's check of the model
            loss = real_ce(*args, **kwargs)
            return loss * float("inf") if inject and calls["n"] == 3 else loss    # step 3 overflows
        # the LM task's loss (bstrain's fused cross-entropy on CUDA, F.cross_entropy on the CPU)
        monkeypatch.setattr(lm_task, "cross_entropy", maybe_overflowing_ce)
        # eager: the overflow is injected from Python, which a captured step would not re-run
        # (tests/train/test_graphs.py checks the skip inside a graph)
        cfg = make_cfg(trainer__max_steps=5, trainer__precision="fp16", trainer__eval_every=0,
                       trainer__ckpt_every=0, trainer__cuda_graph=False, run=run)
        out = train(cfg)
        log = (Path(out["run_dir"]) / "train.log").read_text()
        return torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000005.pt", weights_only=True), log

    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # e.g. "lr_scheduler.step() before optimizer.step()"
        (clean, clean_log), (hit, log) = final_state(False, "clean"), final_state(True, "hit")
    # the first step overflows at the initial scale of 2**16 in both runs (and is counted); the
    # injected overflow at step 3 is the hit run's only other skip
    first = "step 2: 1 of the last 2 steps skipped (fp16 overflow"
    assert first in clean_log and first in log and clean_log.count("skipped") == 1
    assert "step 4: 1 of the last 2 steps skipped (fp16 overflow" in log
    assert "grad_norm nan" not in log
    assert all(torch.isfinite(v).all() for v in hit["model"].values() if v.is_floating_point())
    steps = [int(s["step"]) for s in (clean["optimizer"]["state"][0], hit["optimizer"]["state"][0])]
    assert steps[1] == steps[0] - 1, f"the overflowing step must be skipped: optimizer steps {steps}"
    assert hit["scaler"]["scale"] < clean["scaler"]["scale"], "the overflow must lower the loss scale"


def test_bf16_runs(make_cfg):
    """bf16 autocast is on (the first loss differs from fp32's) and tracks fp32 within bf16's error."""
    bf16 = train(make_cfg(trainer__max_steps=3, trainer__precision="bf16", run="bf16"))["history"]
    fp32 = train(make_cfg(trainer__max_steps=1, trainer__eval_every=0, run="fp32"))["history"]
    assert bf16[0][1] != fp32[0][1], "the bf16 run computed in fp32"
    # bf16 rounds to 8 bits of mantissa (rel 4e-3 per op); measured |diff| 1.4e-4 rel at step 1
    assert bf16[0][1] == pytest.approx(fp32[0][1], rel=1e-2)


@pytest.mark.parametrize("bad, match", [
    (dict(data__path="{tmp}/missing.txt"), "missing.txt"),
    (dict(optim__lr=-1.0), r"optim.lr: expected > 0, got -1.0"),
    (dict(trainer__keep_ckpts=0), r"trainer.keep_ckpts: expected >= 1, got 0"),
    (dict(data__seq_len=0), r"data.seq_len: expected an int >= 1, got 0"),
    (dict(optim__lr="${oops}"), r"optim.lr: Interpolation key 'oops' not found"),
])
def test_bad_config_values(make_cfg, bad, match, tmp_path):
    bad = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in bad.items()}
    with pytest.raises(UserError, match=match):
        train(make_cfg(**bad))


@pytest.mark.parametrize("override, match", [
    ("trainer.precision=fp8", "trainer.precision"), ("optim.schedule=step", "optim.schedule"),
    ("trainer.device=tpu", "trainer.device"), ("model.init=orthogonal", "model.init"),
    ("model.layout=grid", "model.layout"), ("model.hiden=3", "model.hiden"),
])
def test_enum_and_key_errors_when_composed(make_cfg, override, match):
    """Choices are Enum fields and keys are typed: a bad value fails when the config is composed."""
    from hydra.errors import ConfigCompositionException
    with pytest.raises(ConfigCompositionException, match=match):
        make_cfg(override)


def test_too_small_data_is_a_clear_error(make_cfg, tmp_path):
    small = tmp_path / "tiny.txt"
    small.write_text("hello world " * 10)
    with pytest.raises(ValueError, match="tiny.txt"):
        train(make_cfg(data__path=str(small)))


def test_eval_and_sample_commands(make_cfg, command_cfg):
    from bstrain.train.commands import evaluate_checkpoint, sample
    out = train(make_cfg(trainer__max_steps=4, optim__ema=0.9))
    res = evaluate_checkpoint(command_cfg("eval", f"ckpt={out['run_dir']}", "split=test", "device=cpu", "batches=2"))
    valid = evaluate_checkpoint(command_cfg("eval", f"ckpt={out['run_dir']}", "split=valid", "device=cpu",
                                            "batches=2"))
    assert res["step"] == valid["step"] == 4
    assert valid["bpb"] == out["valid_bpb"], "eval reproduces the trainer's own (EMA) evaluation"
    assert res["bpb"] != valid["bpb"], "split=test reads the test split"
    text = sample(command_cfg("sample", f"ckpt={out['run_dir']}", "prompt='def '", "length=20", "temperature=1.0",
                              "device=cpu"))
    assert text.startswith("def ") and len(text.encode("utf-8", errors="replace")) >= 4


def test_model_init_and_tiny_hidden():
    from bstrain.models.lstm import SparseLSTM
    dense = SparseLSTM(hidden=64, block_size=32, sparse=False, init="identity")
    torch.testing.assert_close(dense.w_hm.weight, torch.eye(64))
    with pytest.raises(ValueError, match="model.init"):
        SparseLSTM(hidden=64, block_size=32, init="orthgonal")
    with pytest.raises(TypeError, match="unexpected argument 'hiden'"):
        SparseLSTM(hiden=64)
    for kind in ("barabasi_albert", "watts_strogatz", "random"):
        SparseLSTM(hidden=32, block_size=32, layout=kind)                  # one block: dense layout
        SparseLSTM(hidden=64, block_size=32, layout=kind, density=1.0)


def test_enwik8_experiment_config_on_a_small_enwik8_file(make_cfg, tmp_path):
    """config=lstm_enwik8 composes and trains (shrunk) on a file named enwik8 (proportional split)."""
    text = (Path(__file__).read_bytes() * 40)[:200_000]
    (tmp_path / "enwik8").write_bytes(text)
    cfg = make_cfg("config=lstm_enwik8", f"data.path={tmp_path / 'enwik8'}", trainer__max_steps=2,
                   optim__warmup_steps=1)
    assert cfg.data.name == "enwik8" and cfg.trainer.precision == "bf16" and cfg.optim.ema == 0.999
    out = train(cfg)
    assert out["steps"] == 2 and math.isfinite(out["valid_bpb"])
    assert "180,000 / 10,000 / 10,000 bytes (train / valid / test)" in out["data"], out["data"]


@pytest.mark.gpu
def test_cuda_graph_follows_the_eager_trajectory(make_cfg):
    """Replaying a captured step trains exactly like the eager loop, across evals, checkpoints
    and a resume (the warm-up steps before capture are undone)."""
    common = dict(trainer__max_steps=10, trainer__device="cuda", trainer__eval_every=5)
    eager = train(make_cfg(**common, trainer__cuda_graph=False, run="eager"))
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


def test_density_is_honoured_or_warned(make_cfg):
    from bstrain.models.lstm import SparseLSTM
    for density in (0.1, 0.2, 0.4):
        model = SparseLSTM(hidden=512, block_size=32, density=density)         # the default layout: random
        for name, lay in model.block_sparse_layouts().items():
            assert abs(lay.mean() - density) <= 0.5 / 256 + 1e-9, (name, lay.mean(), density)
            assert np.diag(lay[:, :16]).all(), "the diagonal stays live (identity init)"
    with pytest.warns(UserWarning, match=r"model.density: asked for 0.05, but the barabasi_albert layout of 8x8 "
                                         r"blocks has density 0.344"):
        SparseLSTM(hidden=256, block_size=32, density=0.05, layout="barabasi_albert")
    cfg = make_cfg("model.density=0.2", "model.hidden=256", "model.block_size=32")
    assert cfg.model.layout.value == "random"


def test_resume_with_a_different_model_is_an_error(make_cfg):
    out = train(make_cfg(trainer__max_steps=4, model__hidden=128, model__density=0.5, run="a"))
    path = Path(out["run_dir"]) / "ckpt" / "step_00000004.pt"
    with pytest.raises(UserError, match=r"w_hm.weight has shape \(32, 16, 16\) there and \(13, 16, 16\)"):
        train(make_cfg(f"trainer.resume={path}", trainer__max_steps=6, model__hidden=128, model__density=0.2,
                       run="b"))
    with pytest.raises(UserError, match="lacks 'deep.1.weight'"):
        train(make_cfg(f"trainer.resume={path}", trainer__max_steps=6, model__hidden=128, model__density=0.5,
                       model__depth=3, run="c"))


def test_same_loss_curve_as_the_code_before_the_trainer_refactor(make_cfg):
    """The issue-4 trainer's losses for this seed and config (tests/train/golden_lstm.json, written
    by that code on torch 2.13 CPU): the new task/step/checkpoint path reproduces them."""
    golden = json.loads((Path(__file__).parent / "golden_lstm.json").read_text())
    if not torch.__version__.startswith("2.13"):
        pytest.skip(f"the golden losses were recorded with torch 2.13 on CPU, this is torch {torch.__version__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # barabasi_albert at 4x4 blocks misses density 0.4
        out = train(make_cfg("model.layout=barabasi_albert", "trainer.device=cpu", trainer__max_steps=20,
                             trainer__eval_every=10,
                             trainer__ckpt_every=0, trainer__log_every=2))
    got, want = dict(out["history"]), dict(golden["history"])
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    assert out["valid_bpb"] == pytest.approx(golden["valid_bpb"], rel=1e-5)


def test_models_import_neither_hydra_nor_the_cli_schema():
    code = ("import sys, bstrain.models.lstm, bstrain.nn; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf') "
            "or m == 'bstrain.configs.schema']; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_loop_reads_the_host_only_at_log_steps(make_cfg, monkeypatch):
    """Losses and gradient norms stay on the device: bstrain/train reads tensors on the host only in
    log_window (two reads per log step) and in evaluation."""
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1)
            if "bstrain/train" in caller.f_code.co_filename.replace(os.sep, "/"):
                reads.append((_name, caller.f_code.co_name))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    train(make_cfg(trainer__max_steps=10, trainer__log_every=5, trainer__eval_every=0, trainer__ckpt_every=0))
    outside_eval = [r for r in reads if r[1] not in ("evaluate", "evaluation_metrics")]
    assert sorted(outside_eval) == [("tolist", "log_window")] * 4, reads


def test_eval_progress_bar_only_on_a_terminal(monkeypatch):
    from bstrain.train.tasks import eval_progress
    assert isinstance(eval_progress(5, True, "eval"), range)            # pytest's stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = eval_progress(5, True, "eval valid")
    assert list(bar) == list(range(5)) and type(bar).__name__ == "tqdm"
    assert isinstance(eval_progress(5, False, "eval"), range)


def test_eval_reads_a_checkpoint_written_before_target_configs(make_cfg, command_cfg, tmp_path):
    """Checkpoints of the first trainer (model.name: lstm, no _target_, no task) still evaluate."""
    from bstrain.train.commands import evaluate_checkpoint
    out = train(make_cfg(trainer__max_steps=2))
    ckpt = torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000002.pt", weights_only=True)
    config = ckpt["config"]
    config["model"] = {"name": "lstm", **{k: v for k, v in config["model"].items() if k != "_target_"}}
    config["data"] = {k: v for k, v in config["data"].items() if k not in ("_target_", "max_bytes")}
    del config["task"]
    torch.save(ckpt, tmp_path / "old.pt")
    res = evaluate_checkpoint(command_cfg("eval", f"ckpt={tmp_path / 'old.pt'}", "batches=1", "device=cpu"))
    new = evaluate_checkpoint(command_cfg("eval", f"ckpt={out['run_dir']}", "batches=1", "device=cpu"))
    assert res == new, "the old config builds the same model on the same data"


def test_resume_rules_for_run_dirs_precision_and_old_checkpoints(make_cfg, tmp_path):
    first = train(make_cfg(trainer__max_steps=8, trainer__ckpt_every=4, trainer__keep_ckpts=5, run="a"))
    run = Path(first["run_dir"])
    # an earlier checkpoint of the same run dir would mix two trajectories
    with pytest.raises(UserError, match="holds a later checkpoint"):
        train(make_cfg(f"trainer.resume={run / 'ckpt' / 'step_00000004.pt'}", trainer__max_steps=10, run="a"))
    # the run dir itself names its latest checkpoint; fp32 -> fp16 starts a fresh loss scale
    more = train(make_cfg(f"trainer.resume={run}", trainer__max_steps=10, trainer__precision="fp16",
                          trainer__loss_scale_window=50, run="a"))
    assert [s for s, _ in more["history"]] == [9, 10]
    scaler = torch.load(run / "ckpt" / "step_00000010.pt", weights_only=True)["scaler"]
    assert scaler["scale"] == 2.0**16 and scaler["growth_interval"] == 50
    # fp16 -> fp16 with another window: the config's window wins over the checkpoint's
    again = train(make_cfg(f"trainer.resume={run}", trainer__max_steps=12, trainer__precision="fp16",
                           trainer__loss_scale_window=7, run="a"))
    assert again["steps"] == 12
    assert torch.load(run / "ckpt" / "step_00000012.pt", weights_only=True)["scaler"]["growth_interval"] == 7
    # a checkpoint without the newer entries can be evaluated, not resumed
    old = torch.load(run / "ckpt" / "step_00000012.pt", weights_only=True)
    old["data"] = old.pop("task")["batches"]
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(UserError, match="no task entries .* not resumed"):
        train(make_cfg(f"trainer.resume={tmp_path / 'old.pt'}", trainer__max_steps=14, run="b"))


def test_resume_with_another_seq_len_starts_a_fresh_state(make_cfg, caplog):
    first = train(make_cfg(trainer__max_steps=4, run="a"))
    path = Path(first["run_dir"]) / "ckpt" / "step_00000004.pt"
    out = train(make_cfg(f"trainer.resume={path}", trainer__max_steps=6, data__seq_len=8, run="b"))
    assert out["steps"] == 6
    assert "with a fresh carried state" in (Path(out["run_dir"]) / "train.log").read_text()


def test_eval_adopts_the_checkpoints_layouts(make_cfg, command_cfg, tmp_path):
    """A checkpoint whose layouts another draw would not give (other block counts) still evaluates."""
    from bstrain.train.commands import evaluate_checkpoint
    out = train(make_cfg(trainer__max_steps=2, model__density=0.5))
    ckpt = torch.load(Path(out["run_dir"]) / "ckpt" / "step_00000002.pt", weights_only=True)
    ckpt["config"]["model"]["density"] = 0.25                           # the config would draw fewer blocks
    torch.save(ckpt, tmp_path / "other.pt")
    res = evaluate_checkpoint(command_cfg("eval", f"ckpt={tmp_path / 'other.pt'}", "batches=1", "device=cpu"))
    same = evaluate_checkpoint(command_cfg("eval", f"ckpt={out['run_dir']}", "batches=1", "device=cpu"))
    assert res == same, "the checkpoint's layouts, not the config's draw, are evaluated"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_eval_device_error_names_its_own_key(command_cfg, tmp_path):
    from bstrain.train.commands import evaluate_checkpoint
    with pytest.raises(UserError, match=r"^device: 'cuda' was asked for"):
        evaluate_checkpoint(command_cfg("eval", f"ckpt={tmp_path}", "device=cuda"))


def test_compiled_model_follows_the_eager_trajectory(make_cfg):
    """trainer.compile=true: the same losses as the eager loop (the sparse LSTM on CPU, whose
    block-sparse matmuls trace as PyTorch ops there)."""
    common = dict(trainer__max_steps=4, trainer__eval_every=100, data__seq_len=4, model__depth=1, model__hidden=32)
    eager = train(make_cfg(**common, run="eager"))
    compiled = train(make_cfg(**common, trainer__compile=True, run="compiled"))
    got, want = dict(compiled["history"]), dict(eager["history"])
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), f"step {step}: {got[step]} != {want[step]}"


@pytest.mark.gpu
def test_compiled_model_on_cuda_follows_the_eager_trajectory(make_cfg):
    """On CUDA the compiled graph calls the Triton kernels as torch.ops.bstrain.* custom ops."""
    common = dict(trainer__max_steps=6, trainer__eval_every=3, trainer__device="cuda", data__seq_len=8,
                  trainer__cuda_graph=False)
    eager = train(make_cfg(**common, run="eager"))
    compiled = train(make_cfg(**common, trainer__compile=True, run="compiled"))
    got, want = dict(compiled["history"]), dict(eager["history"])
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-4), f"step {step}: {got[step]} != {want[step]}"
    assert compiled["valid_bpb"] == pytest.approx(eager["valid_bpb"], rel=2e-4)


def test_a_failed_start_leaves_no_run_dir(make_cfg, tmp_path):
    with pytest.raises(UserError, match="missing.txt"):
        train(make_cfg(data__path=str(tmp_path / "missing.txt"), run="new/run"))
    assert not (tmp_path / "new").exists(), "neither the run dir nor the parent this start made"
    (tmp_path / "mine").mkdir()
    with pytest.raises(UserError, match="missing.txt"):
        train(make_cfg(data__path=str(tmp_path / "missing.txt"), run="mine"))
    assert (tmp_path / "mine").is_dir(), "a directory that was there stays"


def test_resume_with_more_steps_keeps_the_learning_rate_continuous(make_cfg, monkeypatch):
    """Resuming at step 8 of 12 with trainer.max_steps=24: the lr of step 8 is the one the run had
    (a new horizon would jump it up), then it decays to min_lr at step 24; the checkpoint keeps
    this, so a later resume follows the same curve."""
    lrs = []
    real_set_lr = trainer_mod.set_lr
    monkeypatch.setattr(trainer_mod, "set_lr", lambda opt, lr: (lrs.append(lr), real_set_lr(opt, lr)))

    def lrs_of(*overrides, **shrink):
        lrs.clear()
        out = train(make_cfg(*overrides, trainer__ckpt_every=4, trainer__eval_every=0, **shrink))
        return list(lrs), Path(out["run_dir"])
    first, run_a = lrs_of(trainer__max_steps=12, run="a")
    longer, run_b = lrs_of(f"trainer.resume={run_a / 'ckpt' / 'step_00000008.pt'}", trainer__max_steps=24, run="b")
    assert len(longer) == 16 and longer[0] == pytest.approx(first[8], rel=1e-12)
    assert all(b < a for a, b in zip(longer, longer[1:])), longer
    floor = 3e-3 * 0.1                                          # optim.lr x min_lr_ratio
    assert floor < longer[-1] < floor * 1.05                     # the last step, 23, is 1/16 of the way short
    assert "trainer.max_steps: 12 -> 24 at step 8: the learning rate decays on from" in (run_b / "train.log").read_text()
    again, _ = lrs_of(f"trainer.resume={run_b / 'ckpt' / 'step_00000016.pt'}", trainer__max_steps=24, run="c")
    assert again == pytest.approx(longer[8:], rel=1e-12)


def test_a_second_signal_stops_at_once_keeping_the_last_checkpoint(make_cfg, monkeypatch):
    """A first SIGINT at step 6 asks for a stop and a checkpoint; a second one arrives while that
    checkpoint is half written: the run stops there, and step 4's checkpoint is the last, whole."""
    from bstrain.errors import RunAborted
    real_step, real_save = trainer_mod.one_step, torch.save

    def step(run, *args):
        if run.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(run, *args)

    def save_then_signal(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 6:
            f.write(b"half a checkpoint")
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(trainer_mod, "one_step", step)
    monkeypatch.setattr(torch, "save", save_then_signal)
    handler = signal.getsignal(signal.SIGINT)
    cfg = make_cfg(trainer__max_steps=100, trainer__ckpt_every=4, trainer__eval_every=0)
    with pytest.raises(RunAborted, match=r"^stopped by a second SIGINT at step 6, without a new checkpoint; the "
                                         r"last one is \S+step_00000004\.pt; continue with python -m bstrain train "
                                         r"trainer\.resume=true hydra\.run\.dir="):
        train(cfg)
    ckpt = Path(cfg.trainer.run_dir) / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004.pt"], "no half-written file left"
    assert ckpt_mod.load_checkpoint(ckpt)["step"] == 4
    assert signal.getsignal(signal.SIGINT) is handler
