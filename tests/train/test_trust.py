"""A checkpoint is data, not code (bstrain/train/trust.py): a stored config's ``_target_``s outside
bstrain are refused by eval, sample, convert and a resume on the saved config unless the user
trusts them, before anything is built; a DCP directory's pickles are read without running code."""
from __future__ import annotations

import pathlib
import pickle
import shutil
import warnings

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from bstrain.cli import _resumed_config, rewrite
from bstrain.configs.schema import register
from bstrain.errors import CheckpointError
from bstrain.train import trust
from bstrain.train.commands import convert_checkpoint, evaluate_checkpoint, sample
from bstrain.train.trainer import train

COMMANDS = {
    "eval": lambda command_cfg, ckpt, *more: evaluate_checkpoint(
        command_cfg("eval", f"ckpt={ckpt}", "device=cpu", "batches=1", *more)),
    "sample": lambda command_cfg, ckpt, *more: sample(
        command_cfg("sample", f"ckpt={ckpt}", "device=cpu", "length=2", *more)),
    "convert": lambda command_cfg, ckpt, *more: convert_checkpoint(
        command_cfg("convert", f"ckpt={ckpt}", f"out={pathlib.Path(ckpt).parent / 'converted.pt'}", *more)),
}


def _train(run_dir, model=None):
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["config=lstm_tiny"])
    with open_dict(cfg):
        if model is not None:
            cfg.model = model
        else:
            cfg.model.hidden, cfg.model.embed, cfg.model.block_size = 64, 16, 16
        cfg.data.seq_len, cfg.data.batch_size = 8, 2
        cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.ckpt_every = 2, 0, 2
        cfg.trainer.run_dir, cfg.trainer.progress = str(run_dir), False
    train(cfg)
    return run_dir / "ckpt" / "step_00000002.pt"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A checkpoint of bstrain's own LSTM, 2 steps."""
    return _train(tmp_path_factory.mktemp("genuine") / "run")


def _edited(src, dst, **sections):
    """``src`` with its stored config's sections replaced, written to ``dst``."""
    state = torch.load(src, weights_only=True)
    state["config"].update(sections)
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, dst)
    return dst


def _writer(target: str, victim: pathlib.Path, source: pathlib.Path) -> dict:
    """A config section whose _target_, built, writes ``victim``."""
    if target == "shutil.copyfile":
        return {"_target_": target, "src": str(source), "dst": str(victim)}
    return {"_target_": target, "obj": [1, 2], "f": str(victim)}                      # torch.save


def _with_writer(genuine, tmp_path, key: str, target: str):
    """A copy of ``genuine`` whose ``key`` (model, data, task or model.config) builds ``target``;
    the file it would write."""
    victim, source = tmp_path / "written_by_the_checkpoint", tmp_path / "source"
    source.write_text("anything")
    config = torch.load(genuine, weights_only=True)["config"]
    section, _, nested = key.partition(".")
    node = _writer(target, victim, source)
    node = {**config[section], nested: node} if nested else node
    return _edited(genuine, tmp_path / "their" / "step_00000002.pt", **{section: node}), victim


WRITERS = [("task", "shutil.copyfile"), ("data", "torch.save"), ("model", "shutil.copyfile"),
           ("model.config", "torch.save")]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("key,target", WRITERS, ids=[f"{k}-{t}" for k, t in WRITERS])
def test_a_target_outside_bstrain_is_refused_and_nothing_is_written(genuine, tmp_path, command_cfg, command, key,
                                                                    target):
    ckpt, victim = _with_writer(genuine, tmp_path, key, target)
    glob = target.split(".")[0] + ".*"
    with pytest.raises(CheckpointError, match=rf"its config's {key}\._target_ is {target}, .*trust=\[{glob}\]"):
        COMMANDS[command](command_cfg, ckpt)
    assert not victim.exists()


def test_the_cli_refuses_in_one_line(genuine, tmp_path):
    from tests.train.test_cli import one_line_error, run
    ckpt, victim = _with_writer(genuine, tmp_path, "task", "shutil.copyfile")
    line = one_line_error(run("eval", f"ckpt={ckpt}", cwd=tmp_path), "task._target_ is shutil.copyfile",
                          "'trust=[shutil.*]'", str(ckpt))
    assert line.startswith("error: checkpoint ") and not victim.exists()


def test_the_trust_key_admits_a_target_by_glob(genuine, tmp_path, command_cfg):
    ckpt, victim = _with_writer(genuine, tmp_path, "task", "shutil.copyfile")
    with pytest.raises(AttributeError, match="'str' object has no attribute 'setup'"):
        COMMANDS["eval"](command_cfg, ckpt, "trust=[shutil.*]")     # built (the user said so): it is no task
    assert victim.read_text() == "anything"
    config = torch.load(ckpt, weights_only=True)["config"]
    trust.check_config(config, ckpt, ["shutil.copyfile"])
    for other in (["os.*"], ["shutil.copy"], ["shutil"]):
        with pytest.raises(CheckpointError, match="task._target_ is shutil.copyfile"):
            trust.check_config(config, ckpt, other)


@pytest.mark.parametrize("target", ["bstrain.cli.shutil.copyfile", "bstrain.train.checkpoint.save_checkpoint",
                                    "bstrain.train.checkpoint.torch.save"])
def test_only_classes_bstrain_defines_are_its_own(genuine, tmp_path, target):
    """A bstrain path that reaches another module's function (an import of a bstrain module), or a
    bstrain function that writes files, is not one of the classes a config builds."""
    config = torch.load(genuine, weights_only=True)["config"]
    trust.check_config(config, genuine)                           # model, data, task: bstrain's own classes
    with pytest.raises(CheckpointError, match=rf"task._target_ is {target}, .*'trust=\[{target}\]'"):
        trust.check_config({**config, "task": {"_target_": target}}, genuine)


def test_an_interpolation_in_a_stored_config_is_refused(genuine):
    """oc.create would make a mapping with a _target_ out of a string when Hydra resolves it."""
    config = torch.load(genuine, weights_only=True)["config"]
    sneaky = {**config["task"], "extra": "${oc.create:'{_target_: shutil.copyfile, src: a, dst: b}'}"}
    with pytest.raises(CheckpointError, match="task.extra holds an interpolation"):
        trust.check_config({**config, "task": sneaky}, genuine)


def test_a_users_model_evaluates_once_trusted(tmp_path, command_cfg):
    ckpt = _train(tmp_path / "run", {"_target_": "tests.train.user_models.VocabLM", "width": 8})
    with pytest.raises(CheckpointError, match=r"model._target_ is tests.train.user_models.VocabLM, .*"
                                              r"trust=\[tests\.\*\]"):
        COMMANDS["eval"](command_cfg, ckpt)
    by_package = COMMANDS["eval"](command_cfg, ckpt, "trust=[tests.train.user_models.*]")
    by_name = COMMANDS["eval"](command_cfg, ckpt, "trust=[tests.train.user_models.VocabLM,transformers.*]")
    assert by_package == by_name and by_package["step"] == 2


# --- a resume on the saved config (the CLI composes on it) ------------------------------------------------
def test_resume_on_a_saved_config_is_checked_before_hydra_runs(genuine, tmp_path):
    ckpt, victim = _with_writer(genuine, tmp_path, "task", "shutil.copyfile")
    with pytest.raises(CheckpointError, match=r"task._target_ is shutil.copyfile, .*trust=\[shutil\.\*\]"):
        rewrite("train", [f"trainer.resume={ckpt}"])
    assert not victim.exists()
    rewrite("train", [f"trainer.resume={ckpt}", "trust=[shutil.*]"])
    rewrite("train", [f"trainer.resume={ckpt}", "task._target_=my_package.Task"])   # the user's own, named here
    rewrite("train", [f"trainer.resume={genuine}"])
    rewrite("train", [f"trainer.resume={ckpt}", "config=lstm_tiny"])                 # the user's config: not read


def test_the_resume_hint_trusts_the_runs_own_targets(tmp_path):
    from omegaconf import OmegaConf

    from bstrain.train.stopping import resume_hint
    ours = OmegaConf.create({"model": {"_target_": "bstrain.models.lstm.SparseLSTM"}})
    assert resume_hint(tmp_path, ours) == resume_hint(tmp_path)
    theirs = OmegaConf.create({"model": {"_target_": "my_lm.ConvLM", "config": {"_target_": "transformers.X"}}})
    assert resume_hint(tmp_path, theirs) == resume_hint(tmp_path) + " 'trust=[my_lm.*,transformers.*]'"


def test_resume_takes_only_a_train_configs_sections_from_a_checkpoint(genuine):
    """A saved ``hydra`` or ``defaults`` entry would reconfigure Hydra itself (its callbacks, its
    search path): the YAML a resume composes on leaves them out, and the saved ``trust``."""
    config = torch.load(genuine, weights_only=True)["config"]
    theirs = {**config, "hydra": {"searchpath": ["file:///theirs"]}, "defaults": ["/config: theirs"],
              "trust": ["*"]}
    assert _resumed_config(theirs) == _resumed_config(config)
    assert "theirs" not in _resumed_config(theirs) and "trust" not in _resumed_config(theirs)


# --- DCP directories: their pickles are data ------------------------------------------------------------
class _Touch:
    """Unpickled, creates ``path`` (what a hostile pickle could do, harmlessly)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


@pytest.fixture(scope="module")
def genuine_dcp(genuine, tmp_path_factory):
    register()
    out = tmp_path_factory.mktemp("dcp") / "step_00000002.dcp"
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")          # (DCP written by one process)
        convert_checkpoint(compose(config_name="convert", overrides=[f"ckpt={genuine}", f"out={out}"]))
    return out


def test_a_genuine_dcp_checkpoint_evaluates_as_its_file(genuine, genuine_dcp, command_cfg):
    assert COMMANDS["eval"](command_cfg, genuine_dcp) == COMMANDS["eval"](command_cfg, genuine)


@pytest.mark.parametrize("command", [*COMMANDS, "resume"])
def test_dcp_metadata_that_runs_code_is_refused(genuine_dcp, tmp_path, command_cfg, make_cfg, command):
    hostile, victim = tmp_path / "their" / "step_00000002.dcp", tmp_path / "touched"
    shutil.copytree(genuine_dcp, hostile)
    (hostile / ".metadata").write_bytes(pickle.dumps(_Touch(victim)))
    with pytest.raises(CheckpointError, match=r"\.metadata holds the global pathlib.Path.touch, .*refused"):
        if command == "resume":
            train(make_cfg(trainer__resume=str(hostile)))
        else:
            COMMANDS[command](command_cfg, hostile)
    assert not victim.exists()


def test_a_dcp_item_that_runs_code_is_refused(genuine, genuine_dcp, tmp_path, command_cfg):
    """DCP unpickles a non-tensor item (an optimizer's lr, betas ...) with weights_only=False."""
    import torch.distributed.checkpoint as dcp
    hostile, victim = tmp_path / "their" / "step_00000002.dcp", tmp_path / "touched"
    hostile.mkdir(parents=True)
    state = torch.load(genuine, weights_only=True)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": state["model"], "optimizer": {"lr": _Touch(victim)}}, checkpoint_id=str(hostile),
                 no_dist=True)
    shutil.copy(genuine_dcp / "extra.pt", hostile / "extra.pt")
    with pytest.raises(CheckpointError, match=r"item 'optimizer.lr' needs code to unpickle \(Unsupported global"):
        COMMANDS["eval"](command_cfg, hostile)
    assert not victim.exists()
