"""``python -m bstrain {train,eval,sample} [config=NAME|PATH] [key=value ...]``.

Each command is a thin Hydra entry over a plain function (train(cfg) -> dict, ...). ``config=``
names an experiment in bstrain/configs/config/ or gives the path of your own YAML file.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

USAGE = """usage: python -m bstrain COMMAND [config=NAME|PATH] [key=value ...]

commands:
  train    train a model (default: config=lstm_tiny, a sparse LSTM on an embedded corpus)
  eval     evaluate a checkpoint: ckpt=PATH [split=valid|test]
  sample   generate text: ckpt=PATH [prompt=...] [length=N] [temperature=T]

Hydra overrides work as usual, e.g. trainer.max_steps=100 trainer.precision=bf16
hydra.run.dir=runs/mine. `python -m bstrain train --help` lists every key."""


def _user_yaml(argv: list[str]) -> list[str]:
    """config=PATH.yaml -> a temporary search path holding config/NAME.yaml, and config=NAME."""
    out = []
    for arg in argv:
        if arg.startswith("config=") and (arg.endswith((".yaml", ".yml")) or os.sep in arg[7:]):
            path = arg[len("config="):]
            if not os.path.isfile(path):
                sys.exit(f"config: no such file {path}")
            root = tempfile.mkdtemp(prefix="bstrain-config-")
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            os.makedirs(os.path.join(root, "config"))
            # a name of its own, so it can't be shadowed by a shipped experiment of the same name
            name = "user_" + os.path.splitext(os.path.basename(path))[0]
            shutil.copy(path, os.path.join(root, "config", name + ".yaml"))
            out += [f"config={name}", f"hydra.searchpath=[file://{root}]"]
        else:
            out.append(arg)
    return out


def _hydra_command(config_name: str, fn):
    import hydra

    from bstrain.configs.schema import register
    register()

    @hydra.main(config_path="configs", config_name=config_name, version_base="1.3")
    def entry(cfg):
        try:
            return fn(cfg)
        except ValueError as exc:                      # data and config problems: one line, no traceback
            sys.exit(f"error: {exc}")
    return entry


def _train():
    from bstrain.train.trainer import train
    _hydra_command("train", train)()


def _eval():
    from bstrain.train.commands import evaluate_checkpoint
    _hydra_command("eval", evaluate_checkpoint)()


def _sample():
    from bstrain.train.commands import sample
    _hydra_command("sample", sample)()


COMMANDS = {"train": _train, "eval": _eval, "sample": _sample}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command = sys.argv.pop(1)
    if command not in COMMANDS:
        sys.exit(f"unknown command {command!r}\n\n{USAGE}")
    sys.argv[1:] = _user_yaml(sys.argv[1:])
    COMMANDS[command]()


if __name__ == "__main__":
    main()
