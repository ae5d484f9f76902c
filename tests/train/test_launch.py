"""trainer.nproc=2 on the CPU (gloo), and torchrun: several processes read as one. Each case starts
real processes (seconds each): a clean interrupted-and-resumed run, an error and a bug after the
workers started, torchrun's messages once. No case leaves an empty run directory."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
TINY = ["model.hidden=64", "model.embed=16", "model.block_size=16", "data.seq_len=8", "data.batch_size=2",
        "trainer.progress=false", "trainer.device=cpu", "trainer.threads=1", "optim.schedule=constant",
        "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.ckpt_every=1000", "trainer.log_every=1"]


def env():
    out = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "BSTRAIN_NPROC"):
        out.pop(key, None)
    return out


def bstrain(*args, cwd):
    return subprocess.run([sys.executable, "-m", "bstrain", "train", *args], capture_output=True, text=True,
                          env=env(), cwd=cwd, timeout=300)


def losses(run: Path) -> dict[int, str]:
    return dict((int(k), v) for k, v in re.findall(r" INFO step (\d+) loss (\S+) \(avg1\)", (run / "train.log").read_text()))


def test_nproc_two_stops_in_one_line_and_resumes_exactly(tmp_path):
    """Ctrl-C: one line, status 130, the hint keeps trainer.nproc=2 and continues the loss curve of an
    uninterrupted 2-process run step for step."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    ref = bstrain(*TINY, "trainer.nproc=2", "trainer.max_steps=30", f"hydra.run.dir={whole}", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = losses(whole)
    assert sorted(want) == list(range(1, 31)) and "x 2 | ddp" in (whole / "train.log").read_text()
    proc = subprocess.Popen([sys.executable, "-m", "bstrain", "train", *TINY, "trainer.nproc=2",
                             "trainer.max_steps=100000", f"hydra.run.dir={cut}"], env=env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 200
    while not (cut / "train.log").is_file() or " step 2 " not in (cut / "train.log").read_text():
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=200)
    assert proc.returncode == 130, err[-3000:]
    assert err.count("interrupted:") == 1 and "Traceback" not in err and "signal" not in err.lower().replace(
        "stopped by sigint", ""), err[-3000:]
    last = err.strip().splitlines()[-1]
    step = int(last.split("at step ")[1].split(";")[0])
    assert 2 <= step < 28, last
    hint = shlex.split(last.split("continue with ")[1])
    assert hint[:5] == ["python", "-m", "bstrain", "train", "trainer.nproc=2"], hint
    assert (cut / "train.log").read_text().rstrip().endswith(last), "the interruption is in train.log"
    more = bstrain(*hint[4:], "trainer.max_steps=30", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert losses(cut) == want, "the resumed 2-process run continues the uninterrupted curve"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "whole"]


def test_nproc_two_an_error_once_a_bug_once_no_run_dir(tmp_path):
    out = bstrain(*TINY, "trainer.nproc=2", "data.path=/no/such/corpus.txt", cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == "", out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "/no/such/corpus.txt" in out.stderr
    (tmp_path / "broken.yaml").write_text("model:\n  _target_: tests.train.user_models.Broken\n")
    bug = bstrain(f"config={tmp_path / 'broken.yaml'}", "trainer.nproc=2", "trainer.progress=false",
                  "trainer.device=cpu", cwd=tmp_path)
    assert bug.returncode == 1, bug.stderr[-3000:]
    assert bug.stderr.count("Traceback") == 1 and "a bug in the model" in bug.stderr, bug.stderr[-3000:]
    assert "ChildFailedError" not in bug.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.yaml"], "no run dir left"


def test_torchrun_says_it_once_from_rank_0(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                          "bstrain", "train", *TINY, "data.path=/no/such/corpus.txt"], capture_output=True,
                         text=True, env=env(), cwd=tmp_path, timeout=300)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "/no/such/corpus.txt" in lines[0], out.stderr[-3000:]
    assert not list(tmp_path.iterdir()), "no run dir left by any rank"
