"""python -m bstrain as a new user meets it: config names, help, errors in one line, run directories,
resume, signals, output. Each case runs the real command in a subprocess."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path


from bstrain.train import checkpoint as ckpt_mod

REPO = Path(__file__).parents[2]
SMALL = ["model.hidden=64", "model.embed=16", "model.block_size=16", "data.seq_len=8", "data.batch_size=2",
         "trainer.progress=false"]


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "bstrain", *args], capture_output=True, text=True, env=env(),
                          cwd=cwd, timeout=300)


def one_line_error(out, *needles):
    """Exit status 1, no traceback, and the last stderr line holds every needle."""
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"
    return last


def test_help_lists_commands_and_keys():
    out = run("--help")
    assert out.returncode == 0
    for command in ("train", "eval", "sample"):
        assert command in out.stdout
    train_help = run("train", "--help")
    assert train_help.returncode == 0
    for text in ("trainer.max_steps", "optimizer steps", "model.density", "fraction of live blocks", "data.path",
                 "_target_", "optim.beta2", "AdamW's decay"):
        assert text in train_help.stdout, text
    flat = " ".join(train_help.stdout.split())                   # wrapped meanings joined again
    assert "trainer.precision choice fp32 fp32 | fp16 (dynamic loss scaling) | bf16 trainer." in flat
    assert "data.name choice auto auto | bytes | enwik8 | text8 data." in flat
    assert_columns_aligned(train_help.stdout)
    eval_help = run("eval", "--help")
    assert eval_help.returncode == 0 and "ckpt" in eval_help.stdout and "valid | test" in eval_help.stdout
    assert "Hydra" not in eval_help.stdout and "model" not in eval_help.stdout
    assert_columns_aligned(eval_help.stdout)


def assert_columns_aligned(text: str) -> None:
    """Every key's row starts its type, default and meaning at the header's columns; wrapped
    meanings continue at the meaning column."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("  KEY "))
    starts = [header.index(name) for name in ("TYPE", "DEFAULT", "MEANING")]
    rows = [line for line in lines[lines.index(header) + 1:] if line.startswith("  ") and line.strip()]
    assert len(rows) > 5
    for line in rows:
        if line.startswith(" " * starts[2]):                     # a wrapped meaning
            continue
        assert not line[2].isspace(), line
        for col in starts:
            assert line[col - 2:col] == "  " and not line[col].isspace(), (col, line)


def test_config_names(tmp_path):
    one_line_error(run("train", "config=nonexistent", cwd=tmp_path), "no experiment named 'nonexistent'",
                   "lstm_tiny")
    one_line_error(run("train", "config=lstm_enwk8", cwd=tmp_path), "lstm_enwk8", "lstm_enwik8")
    one_line_error(run("train", "config=lstm_enwik8", "trainer.max_steps=1", cwd=tmp_path), "data.path",
                   "data.name=enwik8")
    one_line_error(run("train", "config=/no/such.yaml", cwd=tmp_path), "no such file /no/such.yaml")


def test_misspelled_keys_and_bad_values_are_one_line(tmp_path):
    """The whole of stderr is one line naming the key (tests/train/test_cli_args.py has more cases)."""
    for args, line in [
            (["trainer.max_step=5"], "error: trainer.max_step: no such key; did you mean trainer.max_steps?"),
            (["+trainer.max_stepz=3"], "error: trainer.max_stepz: no such key; did you mean trainer.max_steps?"),
            ([f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.widht=3"],      # (my_lm not importable here)
             "error: model.widht: no such key; did you mean model.width?; to add a constructor argument of "
             "my_lm.ConvLM, write +model.widht=3"),
            (["optim.lr=abc"], "error: optim.lr: expected a number, got 'abc'"),
            (["trainer.precision=fp8"], "error: trainer.precision: expected one of fp32, fp16, bf16, got 'fp8'")]:
        out = run("train", *args, cwd=tmp_path)
        assert (out.returncode, out.stderr) == (1, line + "\n"), (args, out.returncode, out.stderr[-2000:])
    assert not list(tmp_path.iterdir()), "no run dir"


def test_value_and_data_errors_are_one_line(tmp_path):
    one_line_error(run("eval", cwd=tmp_path), "ckpt: expected the checkpoint")
    one_line_error(run("sample", "ckpt=no/run", cwd=tmp_path), "no/run")
    assert not list(tmp_path.iterdir()), "eval and sample write nothing into the working directory"
    one_line_error(run("train", "data.path=no/such/corpus.txt", cwd=tmp_path), "no/such/corpus.txt")
    one_line_error(run("train", "optim.lr=-1", cwd=tmp_path), "optim.lr", "-1")
    assert not list(tmp_path.iterdir()), "a start that stops on an error leaves no run dir (runs/DATE/TIME) behind"
    kept = tmp_path / "mine"
    (kept / "notes").mkdir(parents=True)
    one_line_error(run("train", "optim.lr=-1", f"hydra.run.dir={kept}", cwd=tmp_path), "optim.lr")
    assert sorted(p.name for p in kept.iterdir()) == [".hydra", "notes"], "a directory the run did not make stays"


def test_user_yaml_without_package_line_and_eval(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("defaults:\n  - /model: lstm\nmodel:\n  hidden: 64\n  embed: 16\n  block_size: 16\n"
                    "data:\n  seq_len: 8\n  batch_size: 2\ntrainer:\n  max_steps: 3\n  progress: false\n")
    run_dir = tmp_path / "run"
    out = run("train", f"config={mine}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (run_dir / "ckpt" / "step_00000003.pt").is_file()
    assert "hidden: 64" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "ckpt", "tb", "train.log"], "one log per run"
    ev = run("eval", f"ckpt={run_dir}", "batches=1", cwd=tmp_path)
    assert ev.returncode == 0 and "bpb" in ev.stdout, ev.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml", "run"], "eval writes no __main__.log"


def test_user_yaml_named_like_a_shipped_experiment_wins(tmp_path):
    mine = tmp_path / "lstm_tiny.yaml"
    mine.write_text("# @package _global_\ndefaults:\n  - /model: lstm\nmodel:\n  hidden: 64\ntrainer:\n"
                    "  max_steps: 7\n")
    out = run("train", f"config={mine}", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "hidden: 64" in out.stdout and "max_steps: 7" in out.stdout


def test_run_directories_and_resume(tmp_path):
    a = tmp_path / "a"
    one_line_error(run("train", *SMALL, f"trainer.run_dir={a}", "trainer.resume=true", cwd=tmp_path),
                   "trainer.resume=true: no checkpoint in")
    first = run("train", *SMALL, f"trainer.run_dir={a}", "trainer.max_steps=4", "trainer.eval_every=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (a / ".hydra").is_dir() and (a / "ckpt" / "step_00000004.pt").is_file(), "one directory per run"
    assert not (tmp_path / "runs").exists()
    one_line_error(run("train", *SMALL, f"hydra.run.dir={a}", "trainer.max_steps=4", cwd=tmp_path),
                   "already holds checkpoints", "trainer.resume=true")
    one_line_error(run("train", *SMALL, f"hydra.run.dir={a}", f"trainer.run_dir={tmp_path / 'b'}", cwd=tmp_path),
                   "one run has one directory")
    done = run("train", *SMALL, f"hydra.run.dir={a}", "trainer.max_steps=4", "trainer.resume=true", cwd=tmp_path)
    assert done.returncode == 0 and "nan" not in done.stderr, done.stderr[-2000:]
    assert "run already finished: step 4 of trainer.max_steps=4" in done.stderr
    again = run("train", *SMALL, f"trainer.resume={a / 'ckpt' / 'step_00000004.pt'}", "trainer.max_steps=4",
                cwd=tmp_path)
    assert again.returncode == 0 and "run already finished" in again.stderr, again.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "a run that finished at once leaves no run dir"


TINY_TRANSFORMER = ["config=transformer_tiny", "model.d_model=32", "model.n_layer=1", "model.context=32",
                    "model.window=16", "model.summary=2", "model.block_size=16", "data.seq_len=32", "data.batch_size=2",
                    "trainer.progress=false", "trainer.eval_batches=1"]


def start_training(run_dir, *args, cwd):
    """A training process, returned once it has logged a step."""
    proc = subprocess.Popen([sys.executable, "-m", "bstrain", "train", f"hydra.run.dir={run_dir}", *args],
                            env=env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run_dir / "train.log").is_file() or " step " not in (run_dir / "train.log").read_text():
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)
    return proc


def test_sigint_checkpoints_and_the_printed_hint_resumes(tmp_path):
    """The hint resumes the run's own model (here not the default experiment's) with nothing but
    the run dir; overrides given with it apply on top."""
    a = tmp_path / "a"
    proc = start_training(a, *TINY_TRANSFORMER, "trainer.max_steps=100000", "trainer.ckpt_every=1000",
                          "trainer.eval_every=0", "trainer.log_every=1", cwd=tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped by SIGINT at step ") and "trainer.resume=true" in last, last
    step = int(last.split("at step ")[1].split(";")[0])
    assert ckpt_mod.latest_checkpoint(a / "ckpt").name == f"step_{step:08d}.pt"
    hint = shlex.split(last.split("continue with ")[1])
    assert hint[:4] == ["python", "-m", "bstrain", "train"], hint
    more = run(*hint[3:], f"trainer.max_steps={step + 2}", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    assert f"resumed from {a / 'ckpt' / f'step_{step:08d}.pt'} at step {step}" in more.stderr
    assert "SparseTransformer" in more.stderr and ckpt_mod.latest_checkpoint(a / "ckpt").name == \
        f"step_{step + 2:08d}.pt"


def test_a_second_sigint_stops_at_once_in_one_line(tmp_path):
    """The second Ctrl-C lands in the long validation the first one started (the whole valid
    split): the run stops there, prints one line, and the last complete checkpoint stays intact."""
    a = tmp_path / "a"
    proc = start_training(a, *SMALL, "trainer.max_steps=100000", "trainer.ckpt_every=1", "trainer.eval_every=0",
                          "trainer.eval_batches=0", "trainer.log_every=1", cwd=tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)                                 # the step finishes in milliseconds; validation takes minutes
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"interrupted: stopped by a second SIGINT at step \d+, without a new checkpoint; the last "
                        r"one is \S+step_\d+\.pt; continue with python -m bstrain train trainer\.resume=true "
                        r"hydra\.run\.dir=\S+", last), last
    latest = ckpt_mod.latest_checkpoint(a / "ckpt")
    assert str(latest) in last and not list((a / "ckpt").glob("*.tmp"))
    assert ckpt_mod.load_checkpoint(latest)["step"] >= 1


def _run_in_terminal(args, cwd, timeout=240) -> str:
    """Runs the command with stderr (and stdout) on a pseudo-terminal; returns what it printed."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))     # 40 rows, 160 columns
    proc = subprocess.Popen([sys.executable, "-m", "bstrain", *args], env=dict(env(), COLUMNS="200"), cwd=cwd,
                            stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    chunks, deadline = [], time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode("utf-8", "replace")


def test_terminal_output_prints_each_line_once(tmp_path):
    a = tmp_path / "a"
    shown = _run_in_terminal(["train", *SMALL[:-1], f"hydra.run.dir={a}", "trainer.max_steps=6",
                              "trainer.eval_every=3", "trainer.log_every=2"], tmp_path)
    assert shown.count("valid loss") == 2 + 1, shown         # two validations and the final summary
    assert "train: 100%" in shown and "6/6" in shown, "the tqdm bar"
    for line in shown.replace("\r", "\n").splitlines():
        assert not ("valid loss" in line and "train:" in line), f"a line glued onto the bar: {line!r}"
    log = (a / "train.log").read_text()
    assert len(re.findall(r" INFO step \d+ loss \S+ \(avg\d+\) ", log)) == 3 and log.count(": valid loss") == 2, log


def test_non_ascii_prompt_and_trailing_space(tmp_path):
    a = tmp_path / "a"
    assert run("train", *SMALL, f"hydra.run.dir={a}", "trainer.max_steps=2", cwd=tmp_path).returncode == 0
    for prompt in ("héllo wörld ", "def ", "it's \"quoted\" = 1 ", "a\\nb ${y} end\\"):
        out = run("sample", f"ckpt={a}", f"prompt={prompt}", "length=5", cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith(prompt), (prompt, out.stdout, out.stderr[-1000:])
    (tmp_path / "p.txt").write_bytes("naïve\n  indented ".encode())
    out = run("sample", f"ckpt={a}", f"prompt_file={tmp_path / 'p.txt'}", "length=5", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("naïve\n  indented "), out.stderr[-1000:]
    one_line_error(run("sample", f"ckpt={a}", "prompt=x", f"prompt_file={tmp_path / 'p.txt'}", cwd=tmp_path),
                   "prompt, prompt_file: give one of them")


def test_a_bug_keeps_its_traceback(tmp_path):
    (tmp_path / "broken.yaml").write_text("model:\n  _target_: tests.train.user_models.Broken\n")
    out = run("train", f"config={tmp_path / 'broken.yaml'}", f"hydra.run.dir={tmp_path / 'r'}",
              "trainer.progress=false", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr and "a bug in the model" in out.stderr
    out = run("train", "config=" + str(tmp_path / "broken.yaml"), "model.nope=1", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
