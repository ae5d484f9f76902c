"""The trainer as objects: choices typed once, the distributed strategy as an object chosen once
(and never asked which one it is elsewhere), the run's checkpointed state captured and restored
over one list of keys, evaluation shared by ranks equal to one process's."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bstrain.configs.schema import Policy, Precision, Schedule, Strategy
from bstrain.train.distributed import World
from bstrain.train.stepper import GraphMode

TRAIN = Path(__file__).parents[2] / "bstrain" / "train"
_STRING_TEST = re.compile(r"""(==|!=|\bin\b|\bis\b)\s*[(\[{]?\s*["'](single|ddp|fsdp)["']|"""
                          r"""["'](single|ddp|fsdp)["']\s*(==|!=|\bin\b)""")


def test_no_strategy_string_tests_outside_the_strategy_module():
    """Which strategy a run has is asked in bstrain/train/strategy.py only."""
    found = [f"{path.relative_to(TRAIN)}:{n}: {line.strip()}"
             for path in sorted(TRAIN.rglob("*.py")) if path.name != "strategy.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if _STRING_TEST.search(line.split("#")[0])]
    assert not found, "strategy tested by name outside strategy.py:\n" + "\n".join(found)


def test_check_config_types_every_choice(make_cfg):
    from bstrain.train.run import check_config
    cfg = make_cfg("sparsity=rigl", trainer__precision="bf16", optim__schedule="linear", trainer__cuda_graph="off")
    got = check_config(cfg)
    assert (got.precision, got.strategy, got.graph_mode, got.schedule, got.policy) == (
        Precision.bf16, Strategy.auto, GraphMode.false, Schedule.linear, Policy.rigl)
    assert got.amp_dtype is torch.bfloat16 and got.max_steps == cfg.trainer.max_steps


def test_precisions_moved_with_a_warning():
    from bstrain.train import trainer
    with pytest.warns(DeprecationWarning, match="Precision"):
        assert trainer.PRECISIONS == {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("asked,size,want", [("auto", 1, "Single"), ("single", 1, "Single"), ("auto", 2, "DDP"),
                                             ("ddp", 2, "DDP"), ("fsdp", 2, "FSDP")])
def test_the_strategy_is_chosen_once_from_the_typed_config(asked, size, want):
    from bstrain.train.strategy import make_strategy
    strategy = make_strategy(Strategy(asked), World(0, size), torch.device("cpu"))
    assert type(strategy).__name__ == want and str(strategy) == want.lower()
    assert (strategy.why_not_graphed() is not None) is (want == "FSDP")


def test_single_wraps_scales_saves_and_reads(tmp_path):
    from bstrain.train.strategy import make_strategy
    single = make_strategy(Strategy.single, World(), torch.device("cpu"))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    assert single.wrap(model, graphed=False) is model
    scaler = single.scaler(enabled=True, growth_interval=7)
    assert type(scaler) is torch.amp.GradScaler and scaler.get_growth_interval() == 7
    entries = {"step": 5, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    path = single.save(tmp_path, 5, lambda weights: entries, model, optimizer, None, keep=1)
    back = single.read(path, model, optimizer, None)
    assert path.name == "step_00000005.pt" and back["step"] == 5
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())


def _same(a, b, key: str) -> None:
    """Nested dicts, lists and tensors equal, naming the first entry that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), key
        for k in a:
            _same(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{key}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, key
    else:
        assert a == b, (key, a, b)


def test_run_state_capture_restore_round_trip(make_cfg, tmp_path):
    """capture, two more steps, restore, capture again: every entry as it was (the carried state
    once placed); every key once."""
    from bstrain.train.run import build
    from bstrain.train.state import KEYS, capture, restore
    from bstrain.train.trainer import next_batch, one_step
    cfg = make_cfg(optim__ema=0.9)
    run = build(cfg, tmp_path / "run", torch.device("cpu"), World())

    def steps(n):
        for _ in range(n):
            one_step(run, *next_batch(run))
            run.state.step += 1
    steps(2)
    run.state.train_loss, run.state.train_loss_steps, run.state.valid = 1.5, 2, {"loss": 1.25}
    before = capture(run)
    assert tuple(before) == KEYS and len(set(KEYS)) == len(KEYS)
    saved = {**before, "path": "memory"}
    steps(2)
    run.state.train_loss = 9.0
    restore(run, saved)
    _same(run.state.pending, before["state"], "state")      # (the carried state waits for the first batch)
    run.state.carried, run.state.pending = run.state.pending[0], None
    _same(capture(run), before, "checkpoint")


def _lstm():
    from bstrain.models.lstm import SparseLSTM
    torch.manual_seed(0)
    return SparseLSTM(hidden=32, embed=8, block_size=8, depth=1).eval()


@pytest.mark.parametrize("size", [2, 3], ids=["2ranks", "3ranks"])
def test_evaluation_shared_by_ranks_equals_one_process(tmp_path, size):
    """The rows of every batch shared by ``size`` ranks (a stateful LM, its state carried through
    the batches): the summed loss and count over the ranks give one process's loss, to fp32
    rounding; the batch count does not depend on the number of ranks."""
    from bstrain.data.text import ByteCorpus
    from bstrain.train.step import Forward
    from bstrain.train.tasks.lm import ByteLM
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 64)
    task = ByteLM()
    task.setup(ByteCorpus(path=str(text), seq_len=16, batch_size=6), World(), 0)
    forward = Forward(_lstm(), None, torch.device("cpu"))
    with torch.no_grad():
        whole = task.evaluate(forward, "valid", 3)
        parts = [task.evaluation_sums(forward, "valid", 3, rank, size) for rank in range(size)]
    summed = task.evaluation_metrics({k: sum(p[k] for p in parts) for k in parts[0]})
    assert summed["batches"] == whole["batches"] == 3
    assert summed["loss"] == pytest.approx(whole["loss"], rel=1e-6) and summed["bpb"] == pytest.approx(whole["bpb"],
                                                                                                      rel=1e-6)


def test_a_container_in_model_shard_is_one_line():
    """model.shard naming an nn.ModuleList: one line naming it and its children's pattern."""
    from bstrain.errors import UserError
    from bstrain.train.fsdp import shard_units

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    with pytest.raises(UserError, match=r"model.shard: 'blocks' names blocks \(ModuleList\).*blocks\.\*"):
        shard_units(Net(), ["blocks"])
    assert len(shard_units(Net(), ["blocks.*"])) == 2


def test_a_parameter_used_outside_its_fsdp_unit_is_one_line(tmp_path):
    """FSDP's 'aten.mm got mixed torch.Tensor and DTensor' at start becomes one line naming the model's
    code line that read the parameter, the units and the fix (one gloo process: its units shard alike)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from bstrain.data.text import ByteCorpus
    from bstrain.errors import UserError
    from bstrain.train.checks import check_first_batch
    from bstrain.train.fsdp import shard
    from bstrain.train.tasks.lm import ByteLM
    from tests.train.user_models import CrossUnitLM
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = shard(CrossUnitLM(), World(rank=0, size=1, local_rank=0), torch.device("cpu"), None, ["blocks.*"])
        task = ByteLM()
        task.setup(ByteCorpus(seq_len=16, batch_size=2, max_bytes=20000), World(), 0)
        batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)), True)
        cfg = OmegaConf.create({"model": {"_target_": "tests.train.user_models.CrossUnitLM"}, "task": {}})
        with pytest.raises(UserError, match=r"^model \(tests.train.user_models.CrossUnitLM\): a parameter of an FSDP "
                                            r"unit is used outside that unit's forward at user_models.py:\d+ "
                                            r"`return self.head\(h @ self.blocks\[0\].fc.weight\)`; the units are "
                                            r"blocks.0, blocks.1 \(model.shard\)"):
            check_first_batch(model, task, batch, None, torch.device("cpu"), cfg)
    finally:
        dist.destroy_process_group()


def test_a_parameter_tied_across_fsdp_units_is_one_line():
    """Two units sharing a weight (or a unit's weight tied at the root): one line naming the parameter,
    its units and the fix, before any unit is sharded (FSDP said it at the first forward, as if the
    model rejected the data). Ties within the root stay legal."""
    from bstrain.errors import UserError
    from bstrain.train.fsdp import _check_ties, shard_units
    from tests.train.user_models import CrossUnitLM
    model = CrossUnitLM()
    _check_ties(model, shard_units(model, ["blocks.*"]))                  # no tie
    model.head.weight = torch.nn.Parameter(torch.zeros(256, 16))
    model.embed.weight = model.head.weight                                 # a tie at the root
    _check_ties(model, shard_units(model, ["blocks.*"]))
    model.blocks[1].fc.weight = model.blocks[0].fc.weight
    with pytest.raises(UserError, match=r"^model.shard: blocks.1.fc.weight is tied to a parameter of unit blocks.0 "
                                        r"but lies in unit blocks.1; FSDP shards a tied parameter once"):
        _check_ties(model, shard_units(model, ["blocks.*"]))
