"""The model section as a user meets it: sparsified by the ``sparsify`` section (a shipped model
and a user's own ``_target_``), a user model's constructor argument given without ``+``, and an
exception raised in a user's constructor, each in one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from bstrain.__main__ import run as cli_run
from bstrain.cli import rewrite
from bstrain.configs.schema import register
from bstrain.nn import BlockSparseLinear, block_sparse_layouts
from bstrain.train.checkpoint import load_checkpoint
from bstrain.train.commands import convert_checkpoint, evaluate_checkpoint
from bstrain.train.trainer import train

REPO = Path(__file__).parents[2]
RUN = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.ckpt_every=2", "trainer.eval_batches=2",
       "trainer.log_every=2", "trainer.progress=false", "trainer.device=cpu", "optim.warmup_steps=1"]
MODELS = {   # (argv, the sparsify glob, the layers it replaces)
    "transformer": (["config=transformer_tiny", "model.d_model=64", "model.n_layer=2", "model.context=32",
                     "model.window=16", "data.seq_len=32", "data.batch_size=4"],
                    "blocks.*.fc*", ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]),
    "user-convlm": ([f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.width=64", "data.seq_len=16",
                     "data.batch_size=4"], "head", ["head"]),
}


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    """examples/ importable, as it is for `cd examples && python -m bstrain train ...`."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))


def composed(*argv, name="train"):
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name=name, overrides=rewrite(name, list(argv)) if name == "train" else list(argv))


def cli_error(capsys, *argv) -> str:
    """The CLI's one line for ``train ARGV`` (run in this process), its exit status checked."""
    with pytest.raises(SystemExit) as info:
        cli_run("train", list(argv))
    assert isinstance(info.value.code, str), (info.value.code, capsys.readouterr().err[-2000:])
    assert info.value.code.startswith("error: ") and "\n" not in info.value.code
    return info.value.code.removeprefix("error: ")


@pytest.mark.parametrize("model", list(MODELS))
def test_sparsify_from_config_trains_resumes_and_evaluates_alike(model, tmp_path):
    """sparsify.include replaces the layers in the run, its checkpoints and everything rebuilt from
    them: a resume from step 2 ends on the uninterrupted run's eval loss, and `eval` of the last
    checkpoint on the same batches gives the run's last eval loss; both exactly (same ops, same
    weights, same batches on the CPU)."""
    argv, glob, replaced = MODELS[model]
    sparsify = [f"sparsify.include={glob}", "sparsify.density=0.5", "sparsify.block_size=16"]
    whole = train(composed(*argv, *sparsify, *RUN, f"trainer.run_dir={tmp_path / 'whole'}"))
    ckpt = load_checkpoint(tmp_path / "whole" / "ckpt" / "step_00000002.pt")
    assert ckpt["config"]["sparsify"]["include"] == glob
    layouts = {n: lay for n, lay in block_sparse_layouts(_rebuilt(ckpt))}
    assert [n for n in replaced if n in layouts] == replaced
    assert all(layouts[n].sum() == layouts[n].size // 2 for n in replaced)         # density 0.5, kept weights
    assert all(ckpt["model"][f"{n}.layout"].shape == layouts[n].shape for n in replaced)

    resumed = train(composed(*argv, *sparsify, *RUN, f"trainer.run_dir={tmp_path / 'resumed'}",
                             f"trainer.resume={tmp_path / 'whole' / 'ckpt' / 'step_00000002.pt'}"))
    assert resumed["valid_loss"] == whole["valid_loss"]
    assert resumed["train_loss"] == whole["train_loss"]
    trust = ["trust=[my_lm.*]"] if model == "user-convlm" else []         # a user's class: trusted by name
    evaluated = evaluate_checkpoint(composed(f"ckpt={tmp_path / 'whole'}", "batches=2", "device=cpu", *trust,
                                             name="eval"))
    assert evaluated["loss"] == whole["valid_loss"] and evaluated["step"] == 4


def _rebuilt(ckpt) -> torch.nn.Module:
    """The model a checkpoint's config builds, with its weights (what eval and sample load)."""
    from omegaconf import OmegaConf

    from bstrain.train.model import build_model
    model, _ = build_model(OmegaConf.create(ckpt["config"]), rebuild=True)
    model.load_state_dict(ckpt["model"], assign=True)
    return model


def test_convert_rebuilds_the_sparsified_model_on_meta(tmp_path):
    """convert builds the model on the meta device: sparsify there draws its layouts (no weights to keep)."""
    argv, glob, replaced = MODELS["user-convlm"]
    train(composed(*argv, f"sparsify.include={glob}", "sparsify.block_size=16", *RUN, "trainer.max_steps=2",
                   f"trainer.run_dir={tmp_path / 'run'}"))
    trust = "trust=[my_lm.*]"
    out = convert_checkpoint(composed(f"ckpt={tmp_path / 'run'}", f"out={tmp_path / 'c.dcp'}", trust, name="convert"))
    back = convert_checkpoint(composed(f"ckpt={out}", f"out={tmp_path / 'back.pt'}", trust, name="convert"))
    ckpt, again = load_checkpoint(tmp_path / "run"), load_checkpoint(back)
    assert torch.equal(again["model"]["head.layout"], ckpt["model"]["head.layout"])
    assert torch.equal(again["model"]["head.weight"], ckpt["model"]["head.weight"])


@pytest.mark.parametrize("args, want", [
    (["sparsify.include=blocks.*.mlp*"], "sparsify.include='blocks.*.mlp*': expected a glob matching module names of SparseTransformer, it "
                                       "matches none; the closest are"),
    (["sparsify.include=blocks.*.fc*", "sparsify.density=1.5"], "sparsify.density: expected in (0, 1], got 1.5"),
    (["sparsify.include=blocks.*.fc*", "sparsify.block_size=48"], "sparsify.block_size: expected one of"),
    (["sparsify.include=blocks.0.fc1", "sparsify.block_size=128"],
     "sparsify.block_size: blocks.0.fc1: expected in/out features that are multiples of block_size=128"),
    (["sparsify.include=blocks.*.fc*", "sparsify.errors=maybe"], "sparsify.errors: expected one of raise, skip"),
], ids=["glob-matches-nothing", "density", "block-size", "block-size-divides", "errors"])
def test_a_bad_sparsify_value_is_one_line_naming_the_key(args, want, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "one"
    line = cli_error(capsys, *MODELS["transformer"][0], *args, *RUN, f"hydra.run.dir={run_dir}")
    assert line.startswith(want), line
    assert not (tmp_path / "runs").exists()                     # a failed start leaves no run dir


def test_a_user_models_constructor_argument_needs_no_plus(tmp_path, capsys):
    """model.kernel=4: an argument of ConvLM that my_lm.yaml leaves out reaches the constructor; a
    misspelt one is one line naming the closest argument."""
    argv = [f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.width=32", "data.seq_len=16", "data.batch_size=2",
            *RUN, "trainer.max_steps=2"]
    cli_run("train", [*argv, "model.kernel=4", f"hydra.run.dir={tmp_path / 'run'}"])
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["config"]["model"]["kernel"] == 4 and ckpt["model"]["conv.weight"].shape == (32, 32, 4)
    line = cli_error(capsys, *argv, "model.kernal=4", f"hydra.run.dir={tmp_path / 'typo'}")
    assert line == "model.kernal: no such key; did you mean model.kernel?"


def test_an_argument_of_a_model_that_cannot_be_imported_says_how_to_add_it(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text("model:\n  _target_: no_such_package.Model\n")
    line = cli_error(capsys, f"config={tmp_path / 'm.yaml'}", "model.width=3", f"hydra.run.dir={tmp_path / 'r'}")
    assert line == ("model.width: no such key; to add a constructor argument of no_such_package.Model, write "
                    "+model.width=3")


def test_an_exception_in_a_users_constructor_is_one_line_and_the_traceback_is_in_train_log(tmp_path, capsys):
    (tmp_path / "f.yaml").write_text("model:\n  _target_: tests.train.user_models.FailsToBuild\n")
    run_dir = tmp_path / "run"
    line = cli_error(capsys, f"config={tmp_path / 'f.yaml'}", f"hydra.run.dir={run_dir}", "trainer.progress=false")
    assert line == (f"model (tests.train.user_models.FailsToBuild): ZeroDivisionError: division by zero; the "
                    f"traceback is in {run_dir / 'train.log'}")
    assert "Traceback" not in capsys.readouterr().err
    log = (run_dir / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "self.scale = 1 / (width - 32)" in log


@pytest.mark.slow                   # two processes of torchrun: about 20 s on 2 CPU cores
def test_under_torchrun_rank_0_says_it_once(tmp_path):
    from tests.train.test_distributed import torchrun
    (tmp_path / "f.yaml").write_text("model:\n  _target_: tests.train.user_models.FailsToBuild\n")
    out = torchrun(tmp_path / "run", tmp_path, f"config={tmp_path / 'f.yaml'}")
    assert out.returncode != 0
    assert out.stderr.count("error: model (tests.train.user_models.FailsToBuild): ZeroDivisionError") == 1, \
        out.stderr[-3000:]
    assert "self.scale = 1 / (width - 32)" in (tmp_path / "run" / "train.log").read_text()
