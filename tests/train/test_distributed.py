"""torchrun with CPU processes (gloo): 2 ranks = 1 process at the same global batch, resume across rank
counts, fp16 overflow on one rank, layouts checked across ranks."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]


def torchrun(run: Path, tmp: Path, *extra, nproc: int = 2, extra_env=None, text: bool = True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **(extra_env or {}))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
            "bstrain", "train", f"hydra.run.dir={run}", "trainer.progress=false",
            "trainer.eval_every=3", "trainer.ckpt_every=3", "trainer.log_every=1", "trainer.eval_batches=2",
            *(["data.seq_len=16"] if text else []), *extra]
    if not any(a.startswith("trainer.device=") for a in extra):
        args.append("trainer.device=cpu")
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)


LSTM = ["model.hidden=64", "model.embed=16", "model.block_size=16"]


def losses(run: Path) -> dict[int, float]:
    """{step: loss} from the per-step lines of a run's train.log (log_every=1)."""
    found = re.findall(r" INFO step (\d+) loss ([0-9.]+) \(avg1\) ", (run / "train.log").read_text())
    return {int(k): float(v) for k, v in found}


def test_two_ranks_match_one_process_and_resume_on_either(tmp_path):
    """2 ranks x batch 4 train on exactly the batches of 1 process x batch 8: same losses (to the
    log's 4 decimals), one checkpoint with both ranks' carried states, and a resume of that
    checkpoint on 1 process (batch 8) continues the 2-rank curve."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = torchrun(one, tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=8", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    out = torchrun(two, tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=4")
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = losses(one), losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-4), (step, got, want)
    ckpt = torch.load(two / "ckpt" / "step_00000006.pt", weights_only=True)
    assert len(ckpt["state"]) == 2 and ckpt["state"][0][1].shape == (4, 64), "one carried state per rank"
    assert not torch.equal(ckpt["state"][0][1], ckpt["state"][1][1]), "ranks train on different rows"
    log = (two / "train.log").read_text()
    assert log.count(": valid loss") == 2 and "[rank0]" in log and "x 2 |" in log
    # resume the 2-rank run's step-3 checkpoint on one process with the same global batch
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    path = two / "ckpt" / "step_00000003.pt"
    more = torchrun(resumed, tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=8", f"trainer.resume={path}",
                    nproc=1)
    assert more.returncode == 0, more.stderr[-3000:]
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(got[step], abs=2e-4), (step, loss, got[step])
    # and 1 -> 2 ranks: the single run's checkpoint continued on two
    back = torchrun(tmp_path / "back", tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=4",
                    f"trainer.resume={one / 'ckpt' / 'step_00000003.pt'}")
    assert back.returncode == 0, back.stderr[-3000:]
    for step, loss in losses(tmp_path / "back").items():
        assert loss == pytest.approx(want[step], abs=2e-4), (step, loss, want[step])


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's loss overflows at its 3rd step: DDP's all-reduce carries the inf to rank 0, both
    skip, and the loss scales stay equal (the trainer compares them at every log step)."""
    run, yaml = tmp_path / "fp16", tmp_path / "overflow.yaml"
    yaml.write_text("model:\n  _target_: tests.train.user_models.OverflowLM\n  width: 32\n")
    out = torchrun(run, tmp_path, f"config={yaml}", "trainer.max_steps=5", "data.batch_size=2",
                   "trainer.precision=fp16", "trainer.eval_every=0", "trainer.ckpt_every=0",
                   extra_env={"BSTRAIN_TEST_OVERFLOW": "1:3"})
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = torch.load(run / "ckpt" / "step_00000005.pt", weights_only=True)
    assert all(int(st["step"]) == 4 for st in ckpt["optimizer"]["state"].values()), "one of 5 steps skipped"
    assert ckpt["scaler"]["scale"] == 2.0**15
    assert "step 3: 1 of the last 1 steps skipped" in (run / "train.log").read_text()
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def _layouts_worker(rank: int, store: str, same: bool, results) -> None:
    import torch.distributed as dist

    from bstrain.nn import BlockSparseLinear
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_match_one(tmp_path):
    """NCCL on two GPUs: the same losses as one GPU with the whole batch (fp32)."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*LSTM, "trainer.device=cuda", "trainer.max_steps=6"]
    single = torchrun(one, tmp_path, *common, "data.batch_size=8", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    out = torchrun(two, tmp_path, *common, "data.batch_size=4")
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = losses(one), losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=5e-4), (step, got, want)


def test_rigl_two_ranks_match_one_process(tmp_path):
    """sparsity=rigl under torchrun: the ranks make the layout decisions of one process at the same
    global batch (the dense gradients are averaged), so the losses and the layouts agree."""
    over = [*LSTM, "trainer.max_steps=6", "sparsity=rigl", "sparsity.every=2", "sparsity.fraction=0.5",
            "sparsity.until=1.0", "model.layout=random"]
    one, two = tmp_path / "one", tmp_path / "two"
    single = torchrun(one, tmp_path, *over, "data.batch_size=8", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    out = torchrun(two, tmp_path, *over, "data.batch_size=4")
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = losses(one), losses(two)
    for step in want:       # sums in another order (and the host's thread count) move losses by ~1e-4 an update
        assert got[step] == pytest.approx(want[step], abs=1e-3), (step, got, want)
    a = torch.load(one / "ckpt" / "step_00000006.pt", weights_only=True)["model"]
    b = torch.load(two / "ckpt" / "step_00000006.pt", weights_only=True)["model"]
    first = torch.load(one / "ckpt" / "step_00000003.pt", weights_only=True)["model"]
    layouts = [k for k in a if k.endswith("layout")]
    assert layouts and all(torch.equal(a[k], b[k]) for k in layouts)
    assert any(not torch.equal(a[k], first[k]) for k in layouts)          # the update at step 4 or 6 changed them
