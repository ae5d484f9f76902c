"""torchrun with two CPU processes (gloo): one run dir, a checkpoint holding both ranks' states, resume."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).parents[2]


def torchrun(run: Path, tmp: Path, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "bstrain", "train",
            f"trainer.run_dir={run}", "trainer.device=cpu", "trainer.progress=false", "trainer.eval_every=3",
            "trainer.ckpt_every=3", "model.hidden=64", "model.embed=16", "model.block_size=16", "data.seq_len=16",
            "data.batch_size=4", f"hydra.run.dir={tmp / 'hydra'}", *extra]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)


def test_two_process_ddp_training_and_resume(tmp_path):
    run = tmp_path / "ddp"
    out = torchrun(run, tmp_path, "trainer.max_steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = torch.load(run / "ckpt" / "step_00000006.pt", weights_only=True)
    assert len(ckpt["state"]) == 2, "one carried recurrent state per rank"
    assert not torch.equal(ckpt["state"][0][1], ckpt["state"][1][1]), "ranks train on different shards"
    log = (run / "train.log").read_text()
    assert log.count("valid loss") == 2 and "[rank0]" in log
    more = torchrun(run, tmp_path, "trainer.max_steps=9", "trainer.resume=true")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "at step 6" in (run / "train.log").read_text()
    assert (run / "ckpt" / "step_00000009.pt").is_file()
