"""The CLI's pieces in process: argv rewriting (path quoting, resume on the saved config), one-line
errors for the exceptions composition raises, and --help. tests/train/test_cli.py runs the real
command for the output a user sees."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

from bstrain.cli import one_line, quote_path, rewrite
from bstrain.configs import schema
from bstrain.errors import UserError
from bstrain.train.trainer import train

REPO = Path(__file__).parents[2]


def composed(*overrides):
    schema.register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def error_line(*argv) -> str:
    """The line the CLI prints for ``train ARGV`` when composing fails."""
    with pytest.raises(Exception) as info:
        composed(*rewrite("train", list(argv)))
    line = one_line(info.value)
    assert line is not None, f"{type(info.value).__name__} taken for a bug: {info.value}"
    assert "\n" not in line
    return line


@pytest.mark.parametrize("argv, want", [
    (["trainer.max_step=5"], "trainer.max_step: no such key; did you mean trainer.max_steps?"),
    (["max_steps=5"], "max_steps: no such key; did you mean trainer.max_steps?"),
    (["model.hiden=3"], "model.hiden: no such key; did you mean model.hidden?"),
    ([f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.widht=3"],
     "model.widht: no such key; did you mean model.width?"),
    ([f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.kernal=3"],      # an argument the YAML leaves out
     "model.kernal: no such key; did you mean model.kernel?"),
    ([f"config={REPO / 'examples' / 'my_lm.yaml'}", "model.xyzzy=3"],
     "model.xyzzy: no such key; my_lm.ConvLM takes width, kernel, density, block_size"),
    (["model.widht=3"], "model.widht: no such key; model has _target_, hidden, embed, depth, sparse, block_size, "
                        "density, layout, layout_seed, layer_norm, init"),
], ids=["section-key", "no-section", "model-key", "user-model", "user-model-argument", "user-model-no-match",
        "no-match"])
def test_a_misspelled_key_is_one_line_naming_the_closest(argv, want, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))        # as `cd examples` makes my_lm importable
    assert error_line(*argv) == want


@pytest.mark.parametrize("arg, want", [
    ("optim.lr=abc", "optim.lr: expected a number, got 'abc'"),
    ("trainer.precision=fp8", "trainer.precision: expected one of fp32, fp16, bf16, got 'fp8'"),
    ("trainer.max_steps=abc", "trainer.max_steps: expected an integer, got 'abc'"),
    ("trainer.progress=maybe", "trainer.progress: expected true or false, got 'maybe'"),
    ("data.name=enwik9", "data.name: expected one of auto, bytes, enwik8, text8, got 'enwik9'"),
    ("model=foo", "model=foo: no such option; options: convnet, lstm, transformer"),
    ("max_steps", "max_steps: expected key=value"),
], ids=["float", "enum", "int", "bool", "enum-data", "group", "no-value"])
def test_a_bad_value_is_one_line_naming_key_value_and_expectation(arg, want):
    assert error_line(arg) == want


def test_user_errors_and_bugs():
    assert one_line(UserError("data path 'x'\n does not exist")) == "data path 'x' does not exist"
    assert one_line(RuntimeError("a bug")) is None
    assert one_line(TypeError("f() got an unexpected keyword argument")) is None


@pytest.mark.parametrize("value", ["~/src/**/*.py", "/data/a b/c,d.txt", "/d/it's", "/d/back\\slash'x", "/d/end\\",
                                   "/d/[x]=y#z", "runs/plain-name_1.2", "/d/${now:%H}"],
                         ids=["readme-glob", "space-comma", "quote", "backslash-quote", "trailing-backslash",
                              "brackets", "plain", "interpolation"])
def test_path_values_reach_the_config_as_typed(value, monkeypatch, tmp_path):
    """Hydra's grammar would reject or change these; the CLI quotes them, and expands ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    want = str(tmp_path) + value[1:] if value.startswith("~") else value
    for key in ("data.path", "hydra.run.dir", "trainer.resume"):
        parsed = OverridesParser.create().parse_override(f"{key}={quote_path(value)}")
        assert parsed.value() == want, (key, quote_path(value))
    assert quote_path("null") == "null" and quote_path("'quoted already'") == "'quoted already'"


def test_the_readme_glob_example_trains(make_cfg, monkeypatch, tmp_path):
    """`train "data.path=~/src/**/*.py"` as the README writes it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for i in range(60):
        pkg = tmp_path / "src" / f"pkg{i % 3}" / ("sub" if i % 2 else "")
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    argv = rewrite("train", ["data.path=~/src/**/*.py", "data.max_bytes=100000"])
    out = train(make_cfg(*argv, trainer__max_steps=2, trainer__eval_every=0))
    assert out["data"].startswith(f"byte LM on {tmp_path}/src/**/*.py: "), out["data"]
    sizes = [int(n.replace(",", "")) for n in re.findall(r"[\d,]+", out["data"].split(": ")[-1])[:3]]
    assert sum(sizes) == sum(f.stat().st_size for f in tmp_path.glob("src/**/*.py")), "every file, sub/ too"


def _transformer(run_dir, steps):
    cfg = composed("config=transformer_tiny", "model.d_model=32", "model.n_layer=1", "model.context=32",
                   "model.window=16", "model.summary=2", "model.block_size=16", "data.seq_len=32", "data.batch_size=2",
                   f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.eval_batches=1",
                   "trainer.progress=false")
    return cfg


def _cnn(run_dir, steps):
    cfg = composed("data=images", "task=classify", "data.synthetic_size=200", "data.batch_size=16",
                   "data.augment=false", f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}",
                   "trainer.progress=false")
    with open_dict(cfg):
        cfg.model = OmegaConf.create({"_target_": "my_cnn.SmallCNN", "width": 4})
    return cfg


@pytest.mark.parametrize("make,trusted", [(_transformer, []), (_cnn, ["trust=[my_cnn.*]"])],
                         ids=["transformer", "user-cnn"])
def test_resume_without_config_composes_on_the_checkpoints_config(make, trusted, tmp_path, monkeypatch):
    """`trainer.resume=true hydra.run.dir=X`, as the Ctrl-C hint prints it: the run's own model,
    data and task (not the default experiment's), with this command line's overrides on top (a
    model of the user's own once trusted: bstrain/train/trust.py)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    run = tmp_path / "run"
    first = make(run, 2)
    train(first)
    cfg = composed(*rewrite("train", ["trainer.resume=true", f"hydra.run.dir={run}", "trainer.max_steps=3",
                                      "trainer.log_every=1", *trusted]))
    for section in ("model", "data", "task", "optim"):
        assert OmegaConf.to_container(cfg[section]) == OmegaConf.to_container(first[section]), section
    assert OmegaConf.get_type(cfg.model) == OmegaConf.get_type(first.model), "the schema types the model again"
    assert (cfg.trainer.max_steps, cfg.trainer.log_every, cfg.trainer.run_dir) == (3, 1, str(run))
    out = train(cfg)
    assert [s for s, _ in out["history"]] == [3]
    assert "resumed from" in (run / "train.log").read_text()
    # an explicit config= composes as usual; no checkpoint: composes as usual (the trainer then says so)
    assert "config=resumed_run" not in rewrite("train", ["config=lstm_tiny", "trainer.resume=true",
                                                         f"hydra.run.dir={run}"])
    assert rewrite("train", ["trainer.resume=true", f"hydra.run.dir={tmp_path / 'none'}"])[0] == "trainer.resume=true"


def test_every_option_has_help():
    nodes = [*schema.GROUP_SCHEMAS.values(), schema.OptimConfig, schema.TrainerConfig, schema.EvalConfig,
             schema.SampleConfig]
    missing = [f"{node.__name__}.{f.name}" for node in nodes for f in dataclasses.fields(node)
               if not f.metadata.get("help", "").strip()]
    assert not missing, missing


# --- issue 43: commas, commands, messages that say what is true --------------------------------------
def test_a_comma_value_of_a_string_key_is_the_string():
    cfg = composed(*rewrite("train", ["config=transformer_tiny", "model.attention=strided,fixed"]))
    assert cfg.model.attention == "strided,fixed"
    line = error_line("model.nope=a,b")            # a key no schema types: the quoting, in one line
    assert line == ("model.nope=a,b: Hydra reads a comma value as a list or a sweep; for the string, quote it: "
                    "\"model.nope='a,b'\"; for a list: model.nope=[a,b]")


def _main(*argv):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "bstrain", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_a_misspelt_or_missing_command():
    out = _main("trian")
    assert (out.returncode, out.stdout, out.stderr) == (2, "", "error: unknown command 'trian'; did you mean train?\n")
    out = _main()
    assert out.returncode == 2 and out.stderr.startswith("usage: python -m bstrain COMMAND")


@pytest.mark.parametrize("env, want", [
    ({}, "continue with python -m bstrain train trainer.resume=true hydra.run.dir=r"),
    ({"BSTRAIN_NPROC": "2", "WORLD_SIZE": "2"},
     "continue with python -m bstrain train trainer.nproc=2 trainer.resume=true hydra.run.dir=r"),
    ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
     "continue with torchrun --standalone --nproc_per_node=2 -m bstrain train trainer.resume=true hydra.run.dir=r")],
    ids=["one-process", "nproc", "torchrun"])
def test_the_resume_hint_keeps_the_process_count(env, want, monkeypatch):
    from bstrain.train.stopping import resume_hint
    for key in ("BSTRAIN_NPROC", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resume_hint(Path("r")) == want


def test_the_density_warning_reports_the_layout_asked_for(recwarn):
    import warnings

    from bstrain.models.lstm import small_world_layout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert small_world_layout(2, 0.5, "random", 0).mean() == 0.5      # 2x2 blocks: the diagonal, exactly
    with pytest.warns(UserWarning) as got:
        lay = small_world_layout(2, 0.3, "random", 0)
    text = str(got[0].message)
    assert lay.mean() == 0.5 and "random layout of 2x2 blocks has density 0.500" in text
    assert "model.layout=random" not in text and "model.block_size" in text
    with pytest.warns(UserWarning, match="barabasi_albert layout of 2x2 blocks has density 1.000.*model.layout=random"):
        small_world_layout(2, 0.5, "barabasi_albert", 0)


def test_warnings_and_the_closing_line_reach_train_log(make_cfg, tmp_path):
    """The model's density warning (raised while the run builds) is in train.log, once; the line a
    run ends with is appended after its logging closed."""
    from bstrain.train import rundir
    out = train(make_cfg(trainer__max_steps=1, model__density=0.05, trainer__eval_every=0, trainer__ckpt_every=0))
    log = (Path(out["run_dir"]) / "train.log").read_text()
    assert "[rank0] WARNING warning: model.density: asked for 0.05, but the random layout of 4x4 blocks" in log
    rundir.append_to_log(out["run_dir"], "interrupted: stopped by SIGINT at step 1; continue with ...")
    assert (Path(out["run_dir"]) / "train.log").read_text().splitlines()[-1].endswith(
        "[rank0] WARNING interrupted: stopped by SIGINT at step 1; continue with ...")


def test_a_text_file_given_to_the_image_task_says_what_it_expects(tmp_path):
    from bstrain.data.images import _load
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(UserError) as info:
        _load(str(tmp_path / "notes.txt"))
    assert "not an .npz file; the image task expects an .npz with x_train" in str(info.value)
    assert "pickle" not in str(info.value)


def test_convert_to_dcp_prints_no_torch_warning(tmp_path):
    import warnings

    import torch

    from bstrain.train import sharded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharded.write_whole(tmp_path / "x.dcp", {"w": torch.ones(2)}, {}, {"step": 1})
    assert (tmp_path / "x.dcp").is_dir()


def test_a_full_disk_while_checkpointing_is_one_line(tmp_path, monkeypatch):
    """torch.save failing with ENOSPC: one UserError line naming the checkpoint not written, the last
    one intact (and loadable), trainer.keep_ckpts; no partial file."""
    import errno

    import torch

    from bstrain.train import checkpoint
    first = checkpoint.save_checkpoint(tmp_path / "ckpt" / "step_00000001.pt", {"step": 1, "w": torch.ones(3)})

    def full(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial")
        raise RuntimeError("unexpected pos 64") from OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(UserError) as info:
        checkpoint.save_checkpoint(tmp_path / "ckpt" / "step_00000002.pt", {"step": 2})
    assert str(info.value) == (f"checkpoint {tmp_path / 'ckpt' / 'step_00000002.pt'} not written: no space left on "
                               f"device; the last one, {first}, is intact; free space, or keep fewer checkpoints with "
                               f"a lower trainer.keep_ckpts")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001.pt"]
    monkeypatch.undo()
    assert torch.equal(torch.load(first, weights_only=True)["w"], torch.ones(3))
