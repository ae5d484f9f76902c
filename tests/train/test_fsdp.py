"""trainer.strategy=fsdp with CPU processes (gloo): FSDP2 equals one process at the same global
batch, sharded (DCP) checkpoints resume on the same world size and reshard onto another, eval
reads them, and what fsdp does not do yet is refused in one line."""
from __future__ import annotations

import re

import pytest
import torch

from bstrain.errors import CheckpointError, UserError
from bstrain.train.checkpoint import latest_checkpoint, load_checkpoint
from bstrain.train.distributed import World
from bstrain.train.fsdp import resolve_strategy, shard_units
from tests.train.test_cli import one_line_error
from tests.train.test_cli import run as run_cli
from tests.train.test_distributed import LSTM, losses, torchrun
from tests.train.user_models import StackLM

FSDP = "trainer.strategy=fsdp"


def valid_losses(run) -> dict[int, float]:
    """{step: validation loss} from a run's train.log."""
    found = re.findall(r"step (\d+): valid(?: \(EMA weights\))? loss ([0-9.]+)", (run / "train.log").read_text())
    return {int(k): float(v) for k, v in found}


def same_curve(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert got[step] == pytest.approx(want[step], abs=2e-4), (step, got, want)


def test_fsdp_lstm_matches_one_process_and_its_checkpoints_reshard(tmp_path):
    """2 fsdp ranks x batch 4 = 1 process x batch 8, with an EMA of the weights (sharded too, and
    what validation reads); the step-3 DCP checkpoint resumes on 2 fsdp ranks (same size; the
    strategy comes with the checkpoint's config), on 1 process (2 -> 1, the strategy given again),
    and the 1-process file checkpoint on 2 fsdp ranks (1 -> 2), each continuing the same training
    and validation curves; convert, eval and sample read the DCP checkpoint."""
    one, two = tmp_path / "one", tmp_path / "two"
    ema = "optim.ema=0.9"
    single = torchrun(one, tmp_path, *LSTM, ema, "trainer.max_steps=6", "data.batch_size=8", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    out = torchrun(two, tmp_path, *LSTM, ema, "trainer.max_steps=6", "data.batch_size=4", FSDP)
    assert out.returncode == 0, out.stderr[-3000:]
    want, want_valid = losses(one), valid_losses(one)
    same_curve(losses(two), want, range(1, 7))
    same_curve(valid_losses(two), want_valid, (3, 6))
    log = (two / "train.log").read_text()
    assert "x 2 | fsdp |" in log and log.count(": valid (EMA weights) loss") == 2
    ckpt = two / "ckpt" / "step_00000003.dcp"
    assert ckpt.is_dir() and (ckpt / "extra.pt").is_file() and (ckpt / ".metadata").is_file()
    assert not list((two / "ckpt").glob("*.tmp")), "no temp directory left behind"
    for name, nproc, batch, extra in (("same", 2, 4, []), ("to_one", 1, 8, ["trainer.strategy=auto"])):
        run = tmp_path / name
        run.mkdir()
        more = torchrun(run, tmp_path, *LSTM, "trainer.max_steps=6", f"data.batch_size={batch}",
                        f"trainer.resume={ckpt}", *extra, nproc=nproc)
        assert more.returncode == 0, (name, more.stderr[-3000:])
        assert "resumed from" in (run / "train.log").read_text()
        same_curve(losses(run), want, range(4, 7))
        same_curve(valid_losses(run), want_valid, (6,))
    back = tmp_path / "back"
    back.mkdir()
    more = torchrun(back, tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=4", FSDP,
                    f"trainer.resume={one / 'ckpt' / 'step_00000003.pt'}")
    assert more.returncode == 0, more.stderr[-3000:]
    same_curve(losses(back), want, range(4, 7))
    same_curve(valid_losses(back), want_valid, (6,))
    check_conversions(tmp_path, ckpt, one / "ckpt" / "step_00000003.pt")
    conv = tmp_path / "from_converted"             # the single run's checkpoint converted to DCP, under fsdp
    conv.mkdir()
    more = torchrun(conv, tmp_path, *LSTM, "trainer.max_steps=6", "data.batch_size=4", FSDP,
                    f"trainer.resume={tmp_path / 'conv.dcp'}")
    assert more.returncode == 0, more.stderr[-3000:]
    same_curve(losses(conv), want, range(4, 7))
    # a DCP checkpoint of another model is refused in one line, naming the first entry that differs
    from bstrain.models.lstm import SparseLSTM
    from bstrain.train.checkpoint import check_model_entries
    from bstrain.train.sharded import model_entries
    check_model_entries(SparseLSTM(hidden=64, embed=16, block_size=16), model_entries(ckpt), ckpt)
    with pytest.raises(CheckpointError, match=r"embedding has shape \(256, 16\) there and \(256, 32\) in the model"):
        check_model_entries(SparseLSTM(hidden=64, embed=32, block_size=16), model_entries(ckpt), ckpt)
    ev = run_cli("eval", f"ckpt={two}", "batches=1", cwd=tmp_path)      # the latest, step_00000006.dcp
    assert ev.returncode == 0 and "bpb" in ev.stdout, ev.stderr[-2000:]
    sample = run_cli("sample", f"ckpt={two / 'ckpt' / 'step_00000006.dcp'}", "prompt=ab", "length=4", cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr[-2000:]


def check_conversions(tmp_path, dcp_dir, pt_file):
    """``python -m bstrain convert``: DCP -> file and file -> DCP keep every tensor, the optimizer's
    state under the other keying, and the other entries."""
    from bstrain.train.checkpoint import latest_checkpoint, load_checkpoint
    as_file, as_dcp = tmp_path / "conv.pt", tmp_path / "conv.dcp"
    for src, dst in ((dcp_dir, as_file), (pt_file, as_dcp)):
        out = run_cli("convert", f"ckpt={src}", f"out={dst}", cwd=tmp_path)
        assert out.returncode == 0 and f"wrote {dst}" in out.stdout, out.stderr[-2000:]
    one_line_error(run_cli("convert", f"ckpt={pt_file}", f"out={as_dcp}", cwd=tmp_path), "out:", "exists")
    one_line_error(run_cli("convert", f"ckpt={pt_file}", f"out={tmp_path / 'x.zip'}", cwd=tmp_path),
                   "out: expected the path to write, ending in .pt (a file) or .dcp")
    for src, dst in ((dcp_dir, as_file), (pt_file, as_dcp)):
        a, b = load_checkpoint(src), load_checkpoint(dst)
        assert a["step"] == b["step"] == 3 and a["config"] == b["config"] and a["task"] == b["task"]
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        opt_a = a["optimizer"] or a["optimizer_fqn"]
        opt_b = b["optimizer"] or b["optimizer_fqn"]
        moments = lambda o: sorted(float(s["exp_avg"].double().sum()) for s in o["state"].values())   # noqa: E731
        assert len(opt_a["state"]) == len(opt_b["state"]) > 0 and moments(opt_a) == moments(opt_b)
        assert (a["optimizer"] is None) != (b["optimizer"] is None), "one keyed by index, the other by name"
        assert a["ema"].keys() == b["ema"].keys() and all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


@pytest.mark.parametrize("policy", ["set", "rigl"])
def test_fsdp_dynamic_sparsity_matches_one_process(tmp_path, policy):
    """SET and RigL on sharded weights: each update gathers the weights and their AdamW state,
    every rank takes the layouts one process takes at the same global batch (RigL's dense
    gradients averaged over the ranks), and keeps its shards; the EMA copy follows."""
    over = [*LSTM, "trainer.max_steps=6", f"sparsity={policy}", "sparsity.every=2", "sparsity.fraction=0.5",
            "sparsity.until=1.0", "model.layout=random", "optim.ema=0.9", "trainer.ckpt_every=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    single = torchrun(one, tmp_path, *over, "data.batch_size=8", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    out = torchrun(two, tmp_path, *over, "data.batch_size=4", FSDP)
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = losses(one), losses(two)
    assert sorted(got) == list(range(1, 7))
    for step in want:       # sums in another order move losses by ~1e-4 an update (as under DDP)
        assert got[step] == pytest.approx(want[step], abs=1e-3), (step, got, want)
    a, b = torch.load(one / "ckpt" / "step_00000006.pt", weights_only=True), \
        load_checkpoint(two / "ckpt" / "step_00000006.dcp")
    layouts = [k for k in a["model"] if k.endswith("layout")]
    assert layouts and all(torch.equal(a["model"][k], b["model"][k]) for k in layouts), "the same layouts"
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"] if k.endswith("layout")), "the EMA's follow"
    replaced = re.findall(r"sparsity: step (\d+), (\d+) of \d+ live blocks replaced", (two / "train.log").read_text())
    assert [s for s, _ in replaced] == ["2", "4"] and all(int(n) > 0 for _, n in replaced), replaced


def test_fsdp_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's loss overflows at its 3rd step: its shards of the gradients hold the inf, the
    sharded scaler all-reduces the finding, both ranks skip and halve the scale."""
    from bstrain.train.checkpoint import latest_checkpoint, load_checkpoint
    run, yaml = tmp_path / "fp16", tmp_path / "overflow.yaml"
    yaml.write_text("model:\n  _target_: tests.train.user_models.OverflowLM\n  width: 32\n")
    out = torchrun(run, tmp_path, f"config={yaml}", "trainer.max_steps=5", "data.batch_size=2", FSDP,
                   "trainer.precision=fp16", "trainer.eval_every=0", "trainer.ckpt_every=0",
                   extra_env={"BSTRAIN_TEST_OVERFLOW": "1:3"})
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = load_checkpoint(run / "ckpt" / "step_00000005.dcp")
    steps = [int(st["step"]) for st in ckpt["optimizer_fqn"]["state"].values()]
    assert steps and all(s == 4 for s in steps), ("one of 5 steps skipped", steps)
    assert ckpt["scaler"]["scale"] == 2.0**15
    assert "step 3: 1 of the last 1 steps skipped" in (run / "train.log").read_text()
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("model", ["transformer", "user"])
def test_fsdp_matches_one_process(tmp_path, model):
    """The transformer (its layers as units, each block checkpointed) and a user's model whose units
    ``model.shard`` names (compiled) train under fsdp as in one process at the same global batch,
    and checkpoint through DCP."""
    if model == "user":
        yaml = tmp_path / "user.yaml"
        yaml.write_text("model:\n  _target_: tests.train.user_models.StackLM\n  width: 32\n  depth: 2\n"
                        "  shard: [blocks.*]\n")
        args = [f"config={yaml}"]
    else:
        args = ["config=transformer_tiny", "model.d_model=32", "model.n_head=2", "model.context=32",
                "model.block_size=16", "model.window=16", "model.summary=2", "data.seq_len=32",
                "model.checkpoint=true"]      # each block recomputed in backward: gathered again under fsdp
    one, two = tmp_path / "one", tmp_path / "two"
    steps = ["trainer.max_steps=4", "trainer.eval_every=0", "trainer.ckpt_every=2"]
    single = torchrun(one, tmp_path, *args, *steps, "data.batch_size=4", nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    compiled = ["trainer.compile=true"] if model == "user" else []     # the step under fsdp, eager and compiled
    out = torchrun(two, tmp_path, *args, *steps, "data.batch_size=2", FSDP, *compiled)
    assert out.returncode == 0, out.stderr[-3000:]
    same_curve(losses(two), losses(one), range(1, 5))
    assert latest_checkpoint(two / "ckpt") == two / "ckpt" / "step_00000004.dcp"     # what resume=true takes
    assert ("compiled: the first step took" in (two / "train.log").read_text()) == bool(compiled)
    if model == "transformer":          # its step-2 DCP checkpoint on one process: the single run's curve
        back = tmp_path / "back"
        back.mkdir()
        more = torchrun(back, tmp_path, *args, *steps, "data.batch_size=4", "trainer.strategy=auto",
                        f"trainer.resume={two / 'ckpt' / 'step_00000002.dcp'}", nproc=1)
        assert more.returncode == 0, more.stderr[-3000:]
        same_curve(losses(back), losses(one), range(3, 5))
    if model == "user":                                 # model.shard is not the model's argument in eval either
        ev = run_cli("eval", f"ckpt={two}", "batches=1", "trust=[tests.train.user_models.*]", cwd=tmp_path)
        assert ev.returncode == 0 and "bpb" in ev.stdout, ev.stderr[-2000:]


def test_fsdp_convnet_matches_ddp(tmp_path):
    """The convnet, its residual blocks as units: under fsdp as under DDP (batch norm normalises
    each rank's own rows in both, so DDP, not one process, is its twin)."""
    args = ["config=convnet_tiny", "model.widths='16,32'", "data.synthetic_size=64", "data.augment=false",
            "trainer.max_steps=3", "data.batch_size=4", "trainer.eval_every=0", "trainer.ckpt_every=0"]
    ddp, two = tmp_path / "ddp", tmp_path / "two"
    out = torchrun(ddp, tmp_path, *args, "trainer.strategy=ddp", text=False)
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun(two, tmp_path, *args, FSDP, text=False)
    assert out.returncode == 0, out.stderr[-3000:]
    same_curve(losses(two), losses(ddp), range(1, 4))


def test_strategy_resolution():
    one, two = World(), World(0, 2, 0)
    assert resolve_strategy("auto", one) == "single" and resolve_strategy("auto", two) == "ddp"
    assert resolve_strategy("fsdp", two) == "fsdp"
    with pytest.raises(UserError, match=r"trainer.strategy=fsdp: needs more than one process"):
        resolve_strategy("fsdp", one)
    with pytest.raises(UserError, match=r"trainer.strategy=single: torchrun started 2 processes"):
        resolve_strategy("single", two)
    with pytest.raises(UserError, match=r"trainer.strategy: expected one of auto, single, ddp, fsdp, got 'zero'"):
        resolve_strategy("zero", two)


def test_shard_units_by_name_pattern_and_class():
    model = StackLM(width=32, depth=3)
    blocks = list(model.blocks)
    assert shard_units(model, ["blocks.*"]) == blocks
    assert shard_units(model, ["StackBlock"]) == blocks
    assert shard_units(model, "tests.train.user_models.StackBlock") == blocks
    assert shard_units(model, ["blocks.1"]) == [blocks[1]]
    # nested units: the inner ones first, as fully_shard needs them
    units = shard_units(model, ["blocks.*", "blocks.0.mix"])
    assert units[0] is blocks[0].mix and units[1:] == blocks
    assert shard_units(model) == []                      # no shard_units() and no model.shard: the root alone
    with pytest.raises(UserError, match=r"model.shard: 'layers.\*' matches no module of StackLM"):
        shard_units(model, ["layers.*"])
    with pytest.raises(UserError, match=r"model.shard: expected a list of module names or class names, got 3"):
        shard_units(model, [3])
    with pytest.raises(UserError, match=r"model.shard: expected a list of module names or class names, got 3"):
        shard_units(model, 3)


def test_fsdp_on_one_process_is_refused_in_one_line(tmp_path):
    out = run_cli("train", *LSTM, "data.seq_len=16", "trainer.max_steps=2", "trainer.device=cpu", FSDP,
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    one_line_error(out, "trainer.strategy=fsdp: needs more than one process")
    assert not (tmp_path / "run").exists(), "a refused start leaves no run dir"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp_on_two_gpus_matches_ddp(tmp_path):
    """NCCL on two GPUs, the transformer in bf16 (FSDP's mixed precision against DDP's autocast):
    the same loss curve to bf16 noise; the step runs eager under fsdp and says why."""
    args = ["config=transformer_tiny", "model.d_model=64", "model.n_head=2", "model.context=64", "data.seq_len=64",
            "trainer.device=cuda", "trainer.precision=bf16", "trainer.max_steps=6", "data.batch_size=4",
            "trainer.eval_every=0", "trainer.ckpt_every=0"]
    ddp, two = tmp_path / "ddp", tmp_path / "two"
    out = torchrun(ddp, tmp_path, *args, "trainer.strategy=ddp")
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun(two, tmp_path, *args, FSDP)
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = losses(ddp), losses(two)
    assert sorted(got) == list(range(1, 7))
    for step in want:       # bf16: FSDP mixed precision rounds elsewhere than DDP autocast
        assert got[step] == pytest.approx(want[step], abs=2e-2), (step, got, want)
    assert "FSDP's all-gathers and reduce-scatters run outside a whole-step CUDA graph" in (two / "train.log").read_text()
