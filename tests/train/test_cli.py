"""python -m bstrain: commands, Hydra errors as one short message, user YAML configs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "bstrain", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("train", "eval", "sample"):
        assert command in out.stdout


def test_misspelled_key_fails_with_hydras_message(tmp_path):
    out = run("train", "trainer.max_stepz=3", cwd=tmp_path)
    assert out.returncode != 0
    assert "max_stepz" in out.stderr and "Traceback" not in out.stderr


def test_wrong_type_fails_naming_the_key(tmp_path):
    out = run("train", "trainer.max_steps=abc", cwd=tmp_path)
    assert out.returncode != 0 and "trainer.max_steps" in out.stderr and "Traceback" not in out.stderr


def test_missing_data_path_is_one_line(tmp_path):
    out = run("train", "data.path=/no/such/corpus.txt", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "/no/such/corpus.txt" in out.stderr.strip().splitlines()[-1]


def test_user_yaml_config_and_eval(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("# @package _global_\nmodel:\n  hidden: 64\n  embed: 16\n  block_size: 16\n"
                    "data:\n  seq_len: 8\n  batch_size: 2\ntrainer:\n  max_steps: 3\n  progress: false\n")
    run_dir = tmp_path / "run"
    out = run("train", f"config={mine}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (run_dir / "ckpt" / "step_00000003.pt").is_file()
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "hidden: 64" in saved
    ev = run("eval", f"ckpt={run_dir}", "batches=1", cwd=tmp_path)
    assert ev.returncode == 0 and "bits/byte" in ev.stdout, ev.stderr[-2000:]


def test_user_yaml_named_like_a_shipped_experiment_wins(tmp_path):
    mine = tmp_path / "lstm_tiny.yaml"
    mine.write_text("# @package _global_\nmodel:\n  hidden: 64\ntrainer:\n  max_steps: 7\n")
    out = run("train", f"config={mine}", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "hidden: 64" in out.stdout and "max_steps: 7" in out.stdout
