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


def _layouts_worker(rank: int, store: str, same: bool, results) -> None:
    import torch.distributed as dist

    from bstrain.models.layers import BlockSparseLinear
    from bstrain.train.distributed import check_same_layouts
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0 if same else rank)                  # unseeded layouts follow torch's RNG
        model = torch.nn.Sequential(BlockSparseLinear(64, 64, block_size=16, density=0.5),
                                    torch.nn.ReLU(), BlockSparseLinear(64, 64, block_size=16, density=0.5))
        try:
            check_same_layouts(model)
            results[rank] = "ok"
        except ValueError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_layouts_refuse_to_start(tmp_path):
    import torch.multiprocessing as mp
    for same in (True, False):
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_layouts_worker, args=(str(tmp_path / f"store{same}"), same, results), nprocs=2)
            got = dict(results)
        if same:
            assert got == {0: "ok", 1: "ok"}
        else:
            for rank in (0, 1):
                assert "built different block-sparse layouts for 0" in got[rank], got
