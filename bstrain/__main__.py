"""``python -m bstrain {train,eval,sample} [config=NAME|PATH] [key=value ...]``.

Each command is a thin Hydra entry over a plain function (train(cfg) -> dict, ...). ``config=``
names an experiment in bstrain/configs/config/ or gives the path of your own YAML file.

Errors: a :class:`bstrain.errors.UserError` (data, config, checkpoint) is printed as one line and
exits with status 1; a run stopped by SIGINT/SIGTERM prints how to resume and exits with 130;
anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path

USAGE = """usage: python -m bstrain COMMAND [config=NAME|PATH] [key=value ...]

commands:
  train    train a model (default: config=lstm_tiny, a sparse LSTM on an embedded corpus)
  eval     evaluate a checkpoint: ckpt=PATH [split=valid|test]
  sample   generate text: ckpt=PATH [prompt=...|prompt_file=PATH] [length=N] [temperature=T]

Hydra overrides work as usual, e.g. trainer.max_steps=100 trainer.precision=bf16
hydra.run.dir=runs/mine. `python -m bstrain COMMAND --help` lists every key."""

CONFIGS = Path(__file__).parent / "configs"


class _Exit(Exception):
    """A one-line problem with the command line itself, found before Hydra runs."""


def _experiments() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "config").glob("*.yaml"))


def _user_yaml(path: str) -> list[str]:
    """config=PATH.yaml -> a temporary search path holding config/NAME.yaml, and config=NAME.

    The copy gets ``# @package _global_`` when the file has no package line, so a plain YAML of
    top-level sections (model:, data:, trainer: ...) works as written.
    """
    if not os.path.isfile(path):
        raise _Exit(f"config: no such file {path}")
    root = tempfile.mkdtemp(prefix="bstrain-config-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.makedirs(os.path.join(root, "config"))
    # a name of its own, so it can't be shadowed by a shipped experiment of the same name
    name = "user_" + os.path.splitext(os.path.basename(path))[0]
    text = Path(path).read_text(encoding="utf-8")
    if not any(line.startswith("# @package") for line in text.splitlines()[:3]):
        text = "# @package _global_\n" + text
    Path(root, "config", name + ".yaml").write_text(text, encoding="utf-8")
    return [f"config={name}", f"hydra.searchpath=[file://{root}]"]


def _prompt_file(value: str) -> str:
    """A sample prompt, any characters, passed to the command through a temporary file: Hydra's
    override parser would drop trailing spaces, unescape backslashes and resolve ``${...}``."""
    fd, path = tempfile.mkstemp(prefix="bstrain-prompt-", suffix=".txt")
    atexit.register(os.unlink, path)
    with os.fdopen(fd, "wb") as f:
        f.write(os.fsencode(value))                     # the bytes the shell passed, undecodable ones too
    return path


def _rewrite(command: str, argv: list[str]) -> list[str]:
    """The command line Hydra gets: user YAML paths, quoted prompts, run_dir = hydra.run.dir."""
    out: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key == "config" and eq:
            if value.endswith((".yaml", ".yml")) or os.sep in value:
                out += _user_yaml(value)
                continue
            if command == "train" and value not in _experiments():
                raise _Exit(f"config: no experiment named {value!r}; shipped: {', '.join(_experiments())}; or pass "
                            f"the path of a YAML file")
        if key == "prompt" and eq and command == "sample":
            if any(a.startswith("prompt_file=") for a in argv):
                raise _Exit("prompt, prompt_file: give one of them")
            arg = "prompt_file=" + _prompt_file(value)
        out.append(arg)
    if command == "train":
        runs = {k: v for k, _, v in (a.partition("=") for a in out) if k in ("trainer.run_dir", "hydra.run.dir")}
        if len(runs) == 2 and os.path.abspath(runs["trainer.run_dir"]) != os.path.abspath(runs["hydra.run.dir"]):
            raise _Exit(f"trainer.run_dir={runs['trainer.run_dir']} and hydra.run.dir={runs['hydra.run.dir']}: "
                        f"one run has one directory; give one of them")
        if len(runs) == 1:
            value = next(iter(runs.values()))
            out += [f"hydra.run.dir={value}"] if "trainer.run_dir" in runs else [f"trainer.run_dir={value}"]
    return out


# --- --help from the schemas ----------------------------------------------------------------------------
def _type_name(tp) -> str:
    if isinstance(tp, type) and issubclass(tp, __import__("enum").Enum):
        return " | ".join(m.value for m in tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (_type_name(args[0]) + " or null") if args else getattr(tp, "__name__", str(tp))


def _describe(prefix: str, schema) -> list[str]:
    lines = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name == "_target_":
            continue
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        default = getattr(default, "value", default)
        default = "(required)" if default == "???" else default
        lines.append(f"  {prefix}{f.name:<20} {_type_name(hints[f.name]):<24} default {default!s:<10} "
                     f"{f.metadata.get('help', '')}".rstrip())
    return lines


def _help(command: str) -> str:
    from bstrain.configs import schema
    if command != "train":
        node = schema.EvalConfig if command == "eval" else schema.SampleConfig
        keys = "\n".join(_describe("", node))
        return f"usage: python -m bstrain {command} ckpt=PATH [key=value ...]\n\nkeys:\n{keys}"
    parts = [f"usage: python -m bstrain train [config=NAME|PATH.yaml] [key=value ...]\n\n"
             f"config=NAME picks an experiment ({', '.join(_experiments())}; default lstm_tiny) or your own YAML. "
             f"A section's\n_target_ names the class to build: model._target_=my_package.MyLM trains your model "
             f"(its keys are\nits constructor's arguments). The built-in options and their keys:"]
    for (group, name), node in schema.GROUP_SCHEMAS.items():
        parts.append(f"\n{group}={name}  ({node._target_ if hasattr(node, '_target_') else ''})")
        parts += _describe(f"{group}.", node)
    for section, node in (("optim", schema.OptimConfig), ("trainer", schema.TrainerConfig)):
        parts.append(f"\n{section}")
        parts += _describe(f"{section}.", node)
    parts.append("\nHydra: hydra.run.dir=DIR (the run directory); `--cfg job` prints the composed config.")
    return "\n".join(parts)


# --- commands ------------------------------------------------------------------------------------------
def _hydra_command(config_name: str, fn):
    import hydra

    from bstrain.configs.schema import register
    register()

    from bstrain.errors import RunInterrupted, UserError

    @hydra.main(config_path="configs", config_name=config_name, version_base="1.3")
    def entry(cfg):
        # Hydra reports any Exception from here with its own handler; SystemExit passes through.
        try:
            return fn(cfg)
        except UserError as exc:
            sys.exit(f"error: {exc}")
        except RunInterrupted as exc:
            print(f"interrupted: {exc}", file=sys.stderr)
            sys.exit(RunInterrupted.exit_code)
    return entry


def _train(cfg):
    from bstrain.train.trainer import train
    return train(cfg)


def _eval(cfg):
    from bstrain.train.commands import evaluate_checkpoint
    return evaluate_checkpoint(cfg)


def _sample(cfg):
    from bstrain.train.commands import sample
    return sample(cfg)


COMMANDS = {"train": ("train", _train), "eval": ("eval", _eval), "sample": ("sample", _sample)}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command = sys.argv.pop(1)
    if command not in COMMANDS:
        sys.exit(f"unknown command {command!r}\n\n{USAGE}")
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(_help(command))
        return
    try:
        sys.argv[1:] = _rewrite(command, sys.argv[1:])
    except _Exit as exc:
        sys.exit(f"error: {exc}")
    config_name, fn = COMMANDS[command]
    _hydra_command(config_name, fn)()


if __name__ == "__main__":
    main()
