"""Models and tasks the trainer knows nothing about: the README's example (a user's stateless LM
named by _target_ in a YAML), trained, evaluated, resumed and sampled through the CLI; an image
classifier on the classification task; the model protocol's stateful/stateless split."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from bstrain.train.trainer import train

REPO = Path(__file__).parents[2]


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "bstrain", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_readme_example_trains_evaluates_resumes_and_samples(tmp_path):
    """examples/my_lm.yaml names examples/my_lm.py's ConvLM by _target_: the whole user path."""
    cwd, run = REPO / "examples", tmp_path / "run"
    small = ["model.width=64", "data.seq_len=16", "data.batch_size=4", "trainer.eval_every=3", "trainer.ckpt_every=3",
             "trainer.eval_batches=2", "trainer.progress=false"]
    first = run_cli("train", "config=my_lm.yaml", f"hydra.run.dir={run}", "trainer.max_steps=6", *small, cwd=cwd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ConvLM" in (run / "train.log").read_text()
    ckpt = torch.load(run / "ckpt" / "step_00000006.pt", weights_only=True)
    assert ckpt["config"]["model"]["_target_"] == "my_lm.ConvLM" and ckpt["state"] is None
    ev = run_cli("eval", f"ckpt={run}", "batches=2", "split=test", "trust=[my_lm.*]", cwd=cwd)
    assert ev.returncode == 0 and "test at step 6: loss" in ev.stdout and "bpb" in ev.stdout, ev.stderr[-2000:]
    more = run_cli("train", "config=my_lm.yaml", f"hydra.run.dir={run}", "trainer.max_steps=9", "trainer.resume=true",
                   *small, cwd=cwd)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in (run / "train.log").read_text() and (run / "ckpt" / "step_00000009.pt").is_file()
    sample = run_cli("sample", f"ckpt={run}", "prompt=import ", "length=40", "trust=[my_lm.*]", cwd=cwd)
    assert sample.returncode == 0 and sample.stdout.startswith("import "), sample.stderr[-2000:]
    assert len(sample.stdout.encode()) >= len("import ") + 30


def _user_model(cfg, target: str, **kwargs):
    with open_dict(cfg):
        cfg.model = OmegaConf.create({"_target_": target, **kwargs})
    return cfg


@pytest.fixture
def examples_on_path(monkeypatch):
    """examples/ importable, as it is for `cd examples && python -m bstrain train ...`."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))


def test_classification_task_learns_the_synthetic_set(make_cfg, examples_on_path):
    cfg = _user_model(make_cfg("data=images", "task=classify", "data.augment=false", lm=False, trainer__max_steps=150,
                               trainer__eval_every=50, trainer__eval_batches=0, optim__lr=3e-3, optim__warmup_steps=20,
                               data__batch_size=32, data__synthetic_size=1000),
                      "my_cnn.SmallCNN", width=8)
    out = train(cfg)
    assert out["valid_acc"] > 0.6, out["valid"]                   # 10 classes: chance is 0.1; measured 0.93
    assert 0 <= out["valid_acc"] <= out["valid_top5"] <= 1 and math.isfinite(out["valid_loss"])
    assert "acc" in (Path(out["run_dir"]) / "train.log").read_text()


def test_classification_logs_images_per_second_and_training_accuracy(make_cfg, examples_on_path):
    cfg = _user_model(make_cfg("data=images", "task=classify", lm=False, trainer__max_steps=4, trainer__log_every=2,
                               trainer__eval_every=0, data__batch_size=16, data__synthetic_size=200),
                      "my_cnn.SmallCNN", width=4)
    run = Path(train(cfg)["run_dir"])
    log = (run / "train.log").read_text()
    lines = re.findall(r" INFO (step \d+ loss .*)", log)
    assert len(lines) == 2 and all(re.fullmatch(r"step \d+ loss \S+ \(avg2\) acc [01]\.\d{4} lr \S+ grad_norm \S+ "
                                                r"images/s \d+", line) for line in lines), lines
    assert "tokens" not in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set(EventAccumulator(str(run / "tb")).Reload().Tags()["scalars"])
    assert {"train/images_per_s", "train/acc", "valid/acc"} <= tags and "train/tokens_per_s" not in tags, tags


def test_classification_resume_is_exact(make_cfg, examples_on_path):
    def cfg(run, *extra, steps=8):
        return _user_model(make_cfg("data=images", "task=classify", "optim.schedule=constant", *extra, lm=False,
                                    trainer__max_steps=steps,
                                    trainer__ckpt_every=4, data__batch_size=16, data__synthetic_size=200, run=run),
                           "my_cnn.SmallCNN", width=4)
    full = train(cfg("full"))                  # a constant schedule: stopping at 4 changes no learning rate
    train(cfg("split", steps=4))
    second = train(cfg("split", "trainer.resume=true"))
    assert [s for s, _ in second["history"]] == [5, 6, 7, 8]
    want = dict(full["history"])
    for step, loss in second["history"]:
        assert loss == pytest.approx(want[step], rel=1e-6), step


def test_stateless_lm_and_stateful_protocol():
    from bstrain.models.lstm import SparseLSTM
    from bstrain.train.step import Forward, is_stateful
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from my_lm import ConvLM
    finally:
        sys.path.pop(0)
    conv, lstm = ConvLM(width=64), SparseLSTM(hidden=64, embed=16, block_size=16)
    assert not is_stateful(conv) and is_stateful(lstm)
    x = torch.randint(0, 256, (2, 12))
    out, state = Forward(conv, None, torch.device("cpu"))(x, None)
    assert out.shape == (2, 12, 256) and state is None
    out, (c, h) = Forward(lstm, None, torch.device("cpu"))(x, None)
    assert out.shape == (2, 12, 256) and c.shape == h.shape == (2, 64)
    # causal: changing byte 8 leaves the outputs before it alone
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % 256
    torch.testing.assert_close(conv(y)[:, :8], conv(x)[:, :8])


def test_cnn_example_on_the_classification_task(tmp_path):
    """examples/my_cnn.yaml switches data and task with `override` in a user YAML."""
    out = run_cli("train", "config=my_cnn.yaml", f"hydra.run.dir={tmp_path / 'cnn'}", "trainer.max_steps=3",
                  "trainer.eval_every=3", "data.synthetic_size=200", "trainer.progress=false", cwd=REPO / "examples")
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "cnn" / "train.log").read_text()
    assert "SmallCNN" in log and "classification on synthetic gratings" in log and ", acc " in log


def test_a_task_with_the_old_tokens_per_batch_name_keeps_working():
    from bstrain.train.tasks import Task

    class OldTask(Task):
        def tokens_per_batch(self) -> int:
            return 123
    with pytest.warns(DeprecationWarning, match="units_per_batch"):
        assert OldTask().units_per_batch() == 123
