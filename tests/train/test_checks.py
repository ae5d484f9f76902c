"""A model that does not fit the data fails at start, before any step: one line naming the key to
set (or the task with the expected and the got shape), and no run directory left behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from bstrain.configs.schema import register
from bstrain.errors import UserError
from bstrain.train.trainer import train

REPO = Path(__file__).parents[2]


def gray_npz(path: Path, channels: int = 1, classes: int = 10) -> Path:
    """A tiny image set of ``channels``-channel 16x16 images (what data.path=mnist5k gives: 1 channel)."""
    rng = np.random.default_rng(0)
    x = lambda n: rng.integers(0, 255, (n, channels, 16, 16), dtype=np.uint8)          # noqa: E731
    y = lambda n: np.arange(n) % classes                                                # noqa: E731
    np.savez(path, x_train=x(96), y_train=y(96), x_test=x(16), y_test=y(16))
    return path


def composed(tmp_path, *overrides, run: str = "run"):
    """The CLI's config for ``overrides``, made small: 2 steps, no evaluation before the end."""
    small = {"trainer.run_dir": str(tmp_path / run), "trainer.progress": "false", "trainer.max_steps": "2",
             "trainer.eval_every": "0", "trainer.eval_batches": "1", "trainer.ckpt_every": "0",
             "trainer.log_every": "1"}
    small.update(o.split("=", 1) for o in overrides)
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=[f"{k}={v}" for k, v in small.items()])


def images_cfg(tmp_path, *overrides, run: str = "run"):
    return composed(tmp_path, "config=convnet_tiny", "data.batch_size=8", "data.synthetic_size=64",
                    "model.widths=16", "model.block_size=8", *overrides, run=run)


def user_model(cfg, target: str, **kwargs):
    with open_dict(cfg):
        cfg.model = OmegaConf.create({"_target_": target, **kwargs})
    return cfg


def fails_at_start(cfg, tmp_path, *needles) -> str:
    """train(cfg) raises one UserError line holding every needle, and leaves no run dir."""
    with pytest.raises(UserError) as info:
        train(cfg)
    line = str(info.value)
    assert "\n" not in line, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert not Path(cfg.trainer.run_dir).exists(), "a start that stops on a mismatch leaves no run dir"
    assert not (Path(cfg.trainer.run_dir) / "tb").exists()
    return line


@pytest.mark.parametrize("case", ["model3_data1", "model1_data3"])
def test_image_channels(tmp_path, case):
    if case == "model3_data1":                       # config=convnet_tiny data.path=mnist5k, as it were
        cfg = images_cfg(tmp_path, f"data.path={gray_npz(tmp_path / 'gray.npz')}", "data.valid_size=16")
        fails_at_start(cfg, tmp_path, "model.in_channels=3", "have 1 channel:", "set model.in_channels=1")
    else:
        cfg = images_cfg(tmp_path, "model.in_channels=1")
        fails_at_start(cfg, tmp_path, "model.in_channels=1", "have 3 channels", "set model.in_channels=3")


def test_number_of_classes(tmp_path):
    fails_at_start(images_cfg(tmp_path, "model.classes=7"), tmp_path, "model.classes=7", "10 classes",
                   "set model.classes=10")
    fails_at_start(images_cfg(tmp_path, "data.synthetic_classes=12"), tmp_path, "model.classes=10", "12 classes",
                   "set model.classes=12")


def test_a_head_wider_than_the_labels_trains(tmp_path):
    """More classes than the labels name (a set on disk may lack the top label): cross-entropy takes
    it, and so do the checks."""
    result = train(images_cfg(tmp_path, "model.classes=12"))
    ckpt = torch.load(Path(result["run_dir"]) / "ckpt" / "step_00000002.pt", weights_only=True)
    assert ckpt["model"]["head.bias"].shape == (12,)
    # labels 10 and 11 never occur: the 12-way softmax alone gives them a positive gradient
    momentum = [s["exp_avg"] for s in ckpt["optimizer"]["state"].values() if s["exp_avg"].shape == (12,)]
    assert len(momentum) == 1 and (momentum[0][10:] > 0).all(), momentum


def test_user_classifier_without_keys_is_checked_by_its_output(tmp_path):
    """No key names the classes: the task's check of the output shape, naming the task and both shapes."""
    cfg = user_model(images_cfg(tmp_path), "tests.train.user_models.RGBNet", outputs=5)
    fails_at_start(cfg, tmp_path, "tests.train.user_models.RGBNet",
                   "bstrain.train.tasks.classify.Classification", "expected (B, classes) = (2, >= 10)", "got (2, 5)")


def test_user_classifier_with_fixed_channels_keeps_its_traceback_with_a_note(tmp_path):
    """A RuntimeError inside a user's forward may be a bug: it keeps its traceback, with a note naming
    the batch; the start still leaves no run dir."""
    cfg = user_model(images_cfg(tmp_path, f"data.path={gray_npz(tmp_path / 'gray.npz')}", "data.valid_size=16"),
                     "tests.train.user_models.RGBNet")
    with pytest.raises(RuntimeError, match="channels") as info:
        train(cfg)
    assert any("(2, 1, 16, 16) float32" in note for note in info.value.__notes__), info.value.__notes__
    assert not Path(cfg.trainer.run_dir).exists()


@pytest.mark.parametrize("model", ["key", "output"])
def test_lm_vocabulary(make_cfg, tmp_path, model):
    if model == "key":
        cfg = user_model(make_cfg(), "tests.train.user_models.VocabLM", vocab_size=128)
        fails_at_start(cfg, tmp_path, "model.vocab_size=128", "256 byte values", "set model.vocab_size=256")
    else:
        cfg = user_model(make_cfg(), "tests.train.user_models.HeadLM", outputs=300)
        fails_at_start(cfg, tmp_path, "tests.train.user_models.HeadLM", "bstrain.train.tasks.lm.ByteLM",
                       "expected (B, T, 256)", "got (2, 16, 300)")


def test_transformer_context_shorter_than_the_sequences(tmp_path):
    cfg = composed(tmp_path, "config=transformer_tiny", "model.context=32", "data.seq_len=64", "model.d_model=32",
                   "model.n_layer=1", "model.n_head=2")
    fails_at_start(cfg, tmp_path, "model.context=32", "data.seq_len=64", "at least 64", "at most 32")


def test_a_models_value_error_on_the_first_batch_is_one_line(make_cfg, tmp_path):
    cfg = user_model(make_cfg(), "tests.train.user_models.LimitLM", limit=8)
    fails_at_start(cfg, tmp_path, "tests.train.user_models.LimitLM", "inputs (2, 16) int64",
                   "expected at most 8 positions, got 16")


def test_the_check_changes_nothing_it_ran_on(tmp_path, monkeypatch):
    """The checked batch is the first step's; the model's training mode and batch-norm statistics,
    and the RNG, are as they were: the same losses as a run whose check is skipped."""
    import bstrain.train.checks as checks_mod
    checked = train(images_cfg(tmp_path, "trainer.max_steps=3", run="checked"))
    monkeypatch.setattr(checks_mod, "check_first_batch", lambda *args: None)
    unchecked = train(images_cfg(tmp_path, "trainer.max_steps=3", run="unchecked"))
    assert len(checked["history"]) == 3 and checked["history"] == unchecked["history"]


def test_cli_mismatch_is_one_line_and_leaves_no_run_dir(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "bstrain", "train", "config=convnet_tiny", "model.in_channels=1",
                          "trainer.progress=false"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=env)
    assert (out.returncode, out.stderr) == (1, "error: model.in_channels=1, but the images of the synthetic set "
                                               "(data.path=null) have 3 channels: set model.in_channels=3\n"), \
        out.stderr[-2000:]
    assert not list(tmp_path.iterdir()), "no runs/DATE/TIME left behind"


def test_a_resumed_runs_dir_stays(tmp_path):
    """A resume that stops on a mismatch keeps the run dir and its checkpoints."""
    first = train(images_cfg(tmp_path, run="r"))
    run = Path(first["run_dir"])
    with pytest.raises(UserError, match="model.in_channels=3"):
        train(images_cfg(tmp_path, "trainer.resume=true", f"data.path={gray_npz(tmp_path / 'gray.npz')}",
                         "data.valid_size=16", "trainer.max_steps=4", run="r"))
    assert (run / "ckpt" / "step_00000002.pt").is_file() and (run / "tb").is_dir()
