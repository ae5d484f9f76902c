"""The trainer's sparsity group: sparsity=set|rigl updates every block-sparse layer of a model the
trainer does not name (the transformer's sparse FFN), logs to TensorBoard, resumes exactly across
an update, and stops on bad settings with one line."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from bstrain.errors import UserError
from bstrain.train.trainer import train
from tests.conftest import killed_then_resumed

SMALL = dict(d_model=32, n_layer=2, n_head=2, context=32, block_size=16, window=16, summary=4, ffn_density=0.5,
             ffn_block_size=16)


def _cfg(tmp_path, run, policy="rigl", resume=False, **sparsity):
    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["config=transformer_tiny", f"sparsity={policy}"])
    with open_dict(cfg):
        cfg.model.update(SMALL)
        cfg.data.seq_len, cfg.data.batch_size = 32, 4
        cfg.trainer.update(max_steps=8, eval_every=4, ckpt_every=4, eval_batches=2, log_every=1, progress=False,
                           run_dir=str(tmp_path / run), device="cpu", resume=resume)
        cfg.optim.warmup_steps = 2
        cfg.sparsity.update(dict(every=3, fraction=0.5, until=1.0), **sparsity)
    return cfg


def _layouts(run_dir) -> dict:
    ckpt = torch.load(sorted(run_dir.glob("**/*.pt"))[-1], weights_only=False)
    return {k: v.cpu().numpy() for k, v in ckpt["model"].items() if k.endswith("layout")}


@pytest.mark.parametrize("policy,balanced", [("set", False), ("rigl", False), ("rigl", True)],
                         ids=["set", "rigl", "rigl-balanced"])
def test_layouts_change_and_resume_exactly_across_an_update(tmp_path, monkeypatch, policy, balanced):
    """Updates at steps 3 and 6; a run killed after its step-4 checkpoint resumes onto the same
    loss curve, through the update at step 6 (balanced: the tables rewritten in place, and a
    resumed run's private tables take the checkpoint's layouts)."""
    full = train(_cfg(tmp_path, "full", policy, balanced=balanced))
    train(_cfg(tmp_path, "static", "static"))
    lays, base = _layouts(tmp_path / "full"), _layouts(tmp_path / "static")
    assert set(lays) == set(base) and len(lays) == 4                     # fc1 and fc2 of both blocks
    for k in lays:                          # the live-block count of every layer is kept
        assert lays[k].sum() == base[k].sum(), k
        if balanced:
            assert np.array_equal(lays[k].sum(0), base[k].sum(0)) and np.array_equal(lays[k].sum(1), base[k].sum(1)), k
    # unbalanced updates change every layer; a balanced one can only swap blocks between rows and
    # columns that both lost one, which a (2, 8) layout with one block per column may not allow
    changed = [not np.array_equal(lays[k], base[k]) for k in lays]
    assert any(changed) if balanced else all(changed), changed
    hist = dict(full["history"])
    second = killed_then_resumed(monkeypatch, lambda resume: _cfg(tmp_path, "split", policy, resume=resume,
                                                                  balanced=balanced), kill_at=4)
    got = dict(second["history"])
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(hist[step], rel=1e-6), step
    assert all(np.array_equal(a, b) for a, b in zip(_layouts(tmp_path / "split").values(), lays.values()))


def test_tensorboard_logs_the_changes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train(_cfg(tmp_path, "tb"))
    acc = EventAccumulator(str(tmp_path / "tb" / "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("sparsity/changed")] == [3, 6]
    lines = re.findall(r"sparsity: step .*", (tmp_path / "tb" / "train.log").read_text())
    assert len(lines) == 2, lines
    for line, changed, planned in zip(lines, acc.Scalars("sparsity/changed"), acc.Scalars("sparsity/planned")):
        # the realised and planned shares, as train.log states them (the counts over all layers),
        # then the two fields scripts/bench/bench_sparsity.py reads
        m = re.fullmatch(r"sparsity: step (\d), (\d+) of (\d+) live blocks replaced \((\d+\.\d)%\); planned (\d+) "
                         r"\((\d+\.\d)%\): the scheduled share \d+\.\d% of each layer's live blocks, rounded to whole "
                         r"blocks per layer(; .*)?, (tables rewritten in place|new tables), \d+ ms", line)
        assert m, line
        replaced, live, planned_n = int(m[2]), int(m[3]), int(m[5])
        # the log prints the percentage to one decimal: rounding moves it by at most 0.05
        assert float(m[4]) == pytest.approx(100 * replaced / live, abs=0.05)
        assert changed.value == pytest.approx(replaced / live)
        assert planned.value == pytest.approx(planned_n / live) and 0 < replaced <= planned_n
    assert any(t.startswith("sparsity/density/") for t in acc.Tags()["scalars"])
    assert any(len(acc.Images(t)) >= 3 for t in acc.Tags()["images"])       # at start and at each update


@pytest.mark.parametrize("over, match", [
    (dict(fraction=1.5), r"sparsity.fraction: expected a share in \(0, 1\), got 1.5"),
    (dict(every=0), "sparsity.every: expected an int >= 1, got 0"),
    (dict(until=0.0), r"sparsity.until: expected a share of trainer.max_steps in \(0, 1\]"),
])
def test_bad_settings_stop_at_start(tmp_path, over, match):
    with pytest.raises(UserError, match=match):
        train(_cfg(tmp_path, "bad", **over))


def test_grown_moments_reaches_the_policy(tmp_path):
    from bstrain.train.sparsity import make_policy
    from tests.test_sparsity import mlp
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    assert make_policy(_cfg(tmp_path, "gm", grown_moments="mean"), model, opt, None, 100).grown_moments == "mean"
    assert make_policy(_cfg(tmp_path, "gz"), model, opt, None, 100).grown_moments == "zero"


def test_a_time_limited_run_is_told_that_the_schedule_counts_max_steps(tmp_path, caplog):
    from bstrain.train.sparsity import make_policy
    from tests.test_sparsity import mlp
    cfg = _cfg(tmp_path, "tl")
    make_policy(cfg, mlp(), None, None, 8)
    assert "time_limit_s" not in caplog.text
    with open_dict(cfg):
        cfg.trainer.time_limit_s = 600.0
    make_policy(cfg, mlp(), None, None, 8)
    assert "trainer.time_limit_s=600 may end the run sooner; set trainer.max_steps" in caplog.text


def test_a_model_without_block_sparse_layers(tmp_path):
    cfg = _cfg(tmp_path, "dense")
    with open_dict(cfg):
        cfg.model.ffn_density = 1.0
        cfg.model.attention = "dense"
    with pytest.raises(UserError, match="sparsity=rigl: expected a model with block-sparse layers"):
        train(cfg)


@pytest.mark.gpu
def test_graphed_steps_follow_the_updates(tmp_path, monkeypatch):
    """On the GPU with the step in a CUDA graph, where an update makes new tables (forced here:
    the tables refuse every in-place switch): RigL's gradient step replays its own capture (hooks
    armed), each update drops both graphs and they are captured again on the new tables; the
    loss curve and the layouts are the eager run's."""
    from bstrain.ops.matmul import MatmulTables

    def refuse(self, layout, block_size):
        raise ValueError("layout: refused (test)")
    monkeypatch.setattr(MatmulTables, "check_rewrite", refuse)

    def cfg(run, graph):
        c = _cfg(tmp_path, run)
        with open_dict(c):
            c.trainer.update(device="cuda", cuda_graph=graph)
        return c
    eager, graphed = train(cfg("eager", "false")), train(cfg("graph", "true"))
    assert graphed["step_mode"].startswith("graph")
    for (s1, a), (s2, b) in zip(eager["history"], graphed["history"]):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-4, abs=1e-5), s1
    assert all(np.array_equal(a, b) for a, b in zip(_layouts(tmp_path / "eager").values(),
                                                    _layouts(tmp_path / "graph").values()))


@pytest.mark.parametrize("mode", ["balanced", "unbalanced", "new-tables"])
def test_graphs_are_dropped_only_for_new_tables(mode, monkeypatch):
    """after_step: an update that rewrote every table in place (balanced or not) keeps the stepper's
    graphs (the captured step and the graphed evaluation forwards); one that made new tables
    (forced here) drops them."""
    from types import SimpleNamespace

    from bstrain.ops.matmul import MatmulTables
    from bstrain.sparsity import SET
    from bstrain.train.sparsity import after_step
    from tests.test_sparsity import mlp
    if mode == "new-tables":
        def refuse(self, layout, block_size):
            raise ValueError("layout: refused (test)")
        monkeypatch.setattr(MatmulTables, "check_rewrite", refuse)
    model = mlp()
    dropped = []
    stepper = SimpleNamespace(drop_graphs=lambda: dropped.append("the step's and the evaluation's graphs"))
    policy = SET(model, None, every=1, fraction=0.5, balanced=mode == "balanced", seed=3)
    board = SimpleNamespace(scalars=lambda *a: None, layouts=lambda *a: None)
    info = after_step(policy, 1, stepper, board)
    kept = mode != "new-tables"
    assert info["in_place"] is kept
    assert (not dropped) is kept


@pytest.mark.gpu
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "unbalanced"])
@pytest.mark.parametrize("policy", ["set", "rigl"])
def test_updates_keep_the_captured_step(tmp_path, monkeypatch, policy, balanced):
    """On the GPU, balanced or not: the step is captured once for the whole run (the updates
    rewrite the tables the graph reads; RigL's gradient step has one capture of its own, hooks
    armed, on the same memory pool), and the loss curve is the eager run's."""
    from bstrain.train.graphs import CapturedStep
    captures = []
    real = CapturedStep.prepare

    def prepare(self, x, y):
        captures.append(1)
        return real(self, x, y)

    def cfg(run, graph):
        c = _cfg(tmp_path, run, policy, balanced=balanced)
        with open_dict(c):
            c.trainer.update(device="cuda", cuda_graph=graph)
        return c
    eager = train(cfg("eager", "false"))
    monkeypatch.setattr(CapturedStep, "prepare", prepare)
    graphed = train(cfg("graph", "true"))
    assert graphed["step_mode"].startswith("graph")
    assert len(captures) == (2 if policy == "rigl" else 1)      # RigL: the armed step has its own capture
    for (s1, a), (s2, b) in zip(eager["history"], graphed["history"]):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-4, abs=1e-5), s1
    assert all(np.array_equal(a, b) for a, b in zip(_layouts(tmp_path / "eager").values(),
                                                    _layouts(tmp_path / "graph").values()))


def test_compiled_training_follows_every_update(tmp_path, caplog):
    """trainer.compile=true with an update every step for 12 steps: more updates than dynamo's
    default recompile limit (8; on CUDA, where the custom ops name their layout, each update
    is a new graph), and the run never reports the limit and matches the eager run."""
    import torch._dynamo.config as dynamo
    limit = dynamo.recompile_limit
    try:
        def cfg(run, compiled):
            c = _cfg(tmp_path, run, "set", every=1)
            with open_dict(c):
                c.trainer.update(max_steps=12, ckpt_every=0, eval_every=0, compile=compiled)
            return c
        eager, compiled = train(cfg("eager", False)), train(cfg("compiled", True))
        assert dynamo.recompile_limit >= 12
        assert not any("recompile_limit" in r.getMessage() or "cache_size_limit" in r.getMessage()
                       for r in caplog.records)
        for (s1, a), (s2, b) in zip(eager["history"], compiled["history"]):
            assert s1 == s2 and a == pytest.approx(b, rel=1e-4, abs=1e-5), s1
    finally:
        dynamo.recompile_limit = limit
        torch._dynamo.reset()


def test_ema_copy_takes_the_new_layouts(tmp_path):
    cfg = _cfg(tmp_path, "ema", "set")
    with open_dict(cfg):
        cfg.optim.ema = 0.9
    train(cfg)
    ckpt = torch.load(sorted((tmp_path / "ema").glob("**/*.pt"))[-1], weights_only=False)
    model, ema = ckpt["model"], ckpt["ema"]
    for k, v in model.items():
        if k.endswith("layout"):
            assert torch.equal(ema["module." + k], v), k


def test_rigl_under_compile_reads_the_gradients(tmp_path, recwarn):
    """trainer.compile=true: the step before each RigL update runs through the uncompiled model,
    whose hooks see the gradients (a compiled model ignores hooks added after compiling, and
    RigL would silently grow at random)."""
    try:
        cfg = _cfg(tmp_path, "rigl_compiled", "rigl", every=3)
        with open_dict(cfg):
            cfg.trainer.update(compile=True, ckpt_every=0, eval_every=0)
        train(cfg)
        assert not [w for w in recwarn.list if "grows at random" in str(w.message)]
    finally:
        torch._dynamo.reset()


def _info(model, fraction, balanced=False):
    from bstrain.sparsity import SET
    policy = SET(model, None, every=1, fraction=fraction, balanced=balanced, seed=0)
    return policy.step()


def test_the_update_line_counts_whole_blocks_over_all_layers():
    """Each layer replaces round(share x its live blocks): 13% of 4 live blocks is 1 (25%), of 16
    it is 2 (12.5%). The line counts blocks over all layers, 3 of 20 (15%), and says that the
    scheduled 13% was rounded per layer (the mean of the layers' shares, 18.8%, was logged)."""
    from bstrain.nn import BlockSparseLinear
    from bstrain.train.sparsity import describe_update
    torch.manual_seed(0)
    model = torch.nn.Sequential(BlockSparseLinear(64, 64, block_size=16, density=0.25),
                                BlockSparseLinear(64, 256, block_size=16, density=0.25))
    old = [layer.block_layout().copy() for layer in model]
    info = _info(model, 0.13)
    assert [int(o.sum()) for o in old] == [4, 16]
    assert sum(int((layer.block_layout() & ~o).sum()) for layer, o in zip(model, old)) == 3
    assert info["blocks"] == {"live": 20, "planned": 3, "pruned": 3, "replaced": 3}
    assert describe_update(info) == ("3 of 20 live blocks replaced (15.0%); planned 3 (15.0%): the scheduled share "
                                     "13.0% of each layer's live blocks, rounded to whole blocks per layer")


def test_the_update_line_says_why_fewer_were_replaced_than_planned():
    """A balanced update of a block-diagonal layout can only regrow the block it pruned; a layout
    with one dead block can prune one."""
    from bstrain.nn import BlockSparseLinear
    from bstrain.train.sparsity import describe_update
    diagonal = BlockSparseLinear(64, 64, block_size=16, layout=np.eye(4, dtype=bool))
    info = _info(diagonal, 0.25, balanced=True)
    assert np.array_equal(diagonal.block_layout(), np.eye(4, dtype=bool))
    assert describe_update(info) == ("0 of 4 live blocks replaced (0.0%); planned 1 (25.0%): the scheduled share "
                                     "25.0% of each layer's live blocks, rounded to whole blocks per layer; 1 block "
                                     "pruned and grown back in place (balanced: every block row and column keeps its "
                                     "count)")
    full = np.ones((4, 4), dtype=bool)
    full[0, 0] = False
    info = _info(BlockSparseLinear(64, 64, block_size=16, layout=full), 0.3)
    assert info["blocks"] == {"live": 15, "planned": 4, "pruned": 1, "replaced": 1}
    assert describe_update(info).endswith("; 3 of them not pruned: too few dead blocks to grow")


def test_layers_a_balanced_update_cannot_move_are_named_in_the_log(tmp_path, caplog):
    from bstrain.train.sparsity import make_policy
    from tests.test_sparsity_balanced import model
    make_policy(_cfg(tmp_path, "fixed", balanced=True), model(), None, None, 8)
    assert re.search(r"sparsity=rigl: RigL\(balanced=True\): a balanced update can never move a block of layers "
                     r"'0' \(its layout is the only one .*\); '1' \(an update prunes 1 of its 2 live blocks", caplog.text)
