"""What the logs and TensorBoard say: the throughput meter (warm-up steps and pauses left out, on a
fake clock), the labels of averaged and EMA numbers, one evaluation counter for every task, and
one TensorBoard run per training run."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import bstrain.train.trainer as trainer_mod
from bstrain.train.progress import Throughput
from bstrain.train.trainer import train


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_leaves_out_warm_up_steps_and_pauses():
    clock = FakeClock()
    meter = Throughput(clock)

    def step(seconds, warm_up=False, units=64):
        meter.begin_step()
        clock.now += seconds
        meter.end_step(units, warm_up=warm_up)
    step(300.0, warm_up=True)                    # compilation: counted, it would read 0.2 units/s
    assert math.isnan(meter.rate()), "no step counted yet"
    step(0.5)
    step(1.5)
    with meter.pause():                          # validation
        clock.now += 100.0
    clock.now += 2.0                             # between steps (the window's host sync): counted
    assert meter.rate() == 64 * 2 / 4.0
    step(50.0, warm_up=True)                     # a later capture or recompilation
    step(4.0)
    assert meter.rate() == 64 * 3 / 8.0 and meter.steps == 3
    meter.reset()
    assert math.isnan(meter.rate()) and meter.steps == 0
    step(1.0, units=10)
    assert meter.rate() == 10.0


def test_fit_leaves_out_the_first_step_and_compiling_steps(make_cfg, monkeypatch):
    """On a fake clock: step 1 (compilation) takes 100 s, step 6 compiles again for 50 s, the
    others 0.5 s and 1.5 s in turn, validations 100 s. Each logged rate is batch x seq_len (64
    bytes) per 1 s: the mean over the counted steps of its window."""
    clock = {"t": 0.0, "n": 0, "compiled": 0}
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(torch, "compile", lambda net, **kwargs: net)            # stands for the real one
    monkeypatch.setattr(trainer_mod, "_compilations", lambda: clock["compiled"])
    real_step, real_validate = trainer_mod.one_step, trainer_mod.validate

    def step(*args):
        clock["n"] += 1
        n = clock["n"]
        clock["t"] += {1: 100.0, 6: 50.0}.get(n, 0.5 if n % 2 == 0 else 1.5)
        clock["compiled"] += n in (1, 6)
        return real_step(*args)

    def validate(*args):
        clock["t"] += 100.0
        return real_validate(*args)
    monkeypatch.setattr(trainer_mod, "one_step", step)
    monkeypatch.setattr(trainer_mod, "validate", validate)
    out = train(make_cfg(trainer__max_steps=10, trainer__log_every=5, trainer__eval_every=2, trainer__compile=True))
    log = (Path(out["run_dir"]) / "train.log").read_text()
    assert re.findall(r" INFO step \d+ loss .* tokens/s (\d+)", log) == ["64", "64"], log
    assert out["throughput"] == [64.0, 64.0]
    assert "compiling the model with torch.compile" in log and "compiled: the first step took 100 s" in log


def test_logged_losses_say_they_are_window_means(make_cfg):
    """Each progress line's loss is the mean of its window, and says so; the final train loss is the
    last window's mean, labelled the same way."""
    out = train(make_cfg(trainer__max_steps=5, trainer__log_every=2, trainer__eval_every=0))
    log = (Path(out["run_dir"]) / "train.log").read_text()
    lines = re.findall(r" INFO step (\d+) loss (\S+) \(avg(\d+)\) ", log)
    assert [(int(s), int(n)) for s, _, n in lines] == [(2, 2), (4, 2), (5, 1)], log
    losses = dict(out["history"])
    for step, shown, n in lines:
        want = sum(losses[s] for s in range(int(step) - int(n) + 1, int(step) + 1)) / int(n)
        assert float(shown) == pytest.approx(want, abs=1e-4)
    assert out["train_loss"] == pytest.approx(losses[5]) and out["train_loss_steps"] == 1
    done = re.search(r"done: 5 steps, train loss (\S+) \(avg1\),", log)
    assert done and float(done.group(1)) == pytest.approx(out["train_loss"], abs=1e-4)


def _board(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    return EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0}).Reload()


def test_one_tensorboard_run_with_its_hparams(make_cfg):
    out = train(make_cfg(trainer__max_steps=2, trainer__eval_every=0))
    run = Path(out["run_dir"])
    assert {p.parent for p in run.rglob("events.out.tfevents.*")} == {run / "tb"}, "one run in TensorBoard's list"
    board = _board(run)
    assert set(board.PluginTagToContent("hparams")) == {"_hparams_/experiment", "_hparams_/session_start_info",
                                                        "_hparams_/session_end_info"}
    (final,) = board.Scalars("hparam/valid_bpb")
    assert final.step == 2 and final.value == pytest.approx(out["valid_bpb"])


def test_every_task_counts_evaluation_in_batches(make_cfg, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "examples"))
    lm = train(make_cfg(trainer__max_steps=2, trainer__eval_every=0, run="lm"))
    cfg = make_cfg("data=images", "task=classify", lm=False, trainer__max_steps=2, trainer__eval_every=0,
                   data__batch_size=16, data__synthetic_size=200, run="cnn")
    with open_dict(cfg):
        cfg.model = OmegaConf.create({"_target_": "my_cnn.SmallCNN", "width": 4})
    cnn = train(cfg)
    assert lm["valid"]["batches"] == 2 and cnn["valid"]["batches"] == 2       # trainer.eval_batches=2
    for out, metric in ((lm, "bpb"), (cnn, "acc")):
        tags = set(_board(Path(out["run_dir"])).Tags()["scalars"])
        assert {"valid/batches", "valid/loss", f"valid/{metric}"} <= tags and "valid/images" not in tags, tags
