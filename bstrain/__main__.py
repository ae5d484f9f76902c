"""``python -m bstrain {train,eval,sample,convert} [config=NAME|PATH] [key=value ...]``, and
``python -m bstrain advise in_features=N out_features=N ...`` (:mod:`bstrain.advise`, no Hydra).

Each command is a thin Hydra entry over a plain function (train(cfg) -> dict, ...). ``config=``
names an experiment in bstrain/configs/config/ or gives the path of your own YAML file.

Errors: a user's error (a misspelled key, a value of the wrong type, an override Hydra cannot
parse, a :class:`bstrain.errors.UserError` for data, config or checkpoint problems) is printed as
one line and exits with status 1 (an exception raised in a user model's constructor too, its
traceback in the run's train.log); a run stopped by SIGINT/SIGTERM prints one line saying how to
resume and exits with 130; anything else is a bug and keeps its traceback. Hydra reports nothing
itself (HYDRA_FULL_ERROR=1): every error comes here, see :func:`bstrain.cli.one_line`.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import sys
import traceback
import typing

from bstrain.cli import experiments, one_line, rewrite, with_constructor_argument

USAGE = """usage: python -m bstrain COMMAND [config=NAME|PATH] [key=value ...]

commands:
  train    train a model (default: config=lstm_tiny, a sparse LSTM on an embedded corpus)
  eval     evaluate a checkpoint: ckpt=PATH [split=valid|test]
  sample   generate text: ckpt=PATH [prompt=...|prompt_file=PATH] [length=N] [temperature=T]
  convert  a checkpoint in the other format: ckpt=PATH out=NEW.dcp (sharded, DCP) or out=NEW.pt (a file)
  advise   block sizes and densities for a layer, from measurements: in_features=N out_features=N [tokens=N]

Hydra overrides work as usual, e.g. trainer.max_steps=100 trainer.precision=bf16
hydra.run.dir=runs/mine. `python -m bstrain COMMAND --help` lists every key."""


# --- --help from the schemas ----------------------------------------------------------------------------
def _type_name(tp) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "choice"
    if typing.get_origin(tp) is list:
        return "list"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (_type_name(args[0]) + " or null") if args else getattr(tp, "__name__", str(tp))


def _rows(prefix: str, schema) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) of each field of a schema; a choice's help names every option."""
    rows = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name == "_target_":
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        default = getattr(default, "value", default)
        default = {"???": "(required)", None: "null", True: "true", False: "false"}.get(default, default) \
            if isinstance(default, (str, bool, type(None))) else default
        text = f.metadata.get("help", "")
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, enum.Enum) and not all(m.value in text for m in tp):
            text += f" ({' | '.join(m.value for m in tp)})"
        rows.append((prefix + f.name, _type_name(tp), str(default), text))
    return rows


def _table(blocks: list) -> str:
    """Text lines and blocks of (key, type, default, help) rows: every block's rows in the same
    columns, help wrapped to the terminal's width under its own column."""
    import shutil
    import textwrap
    rows = [("KEY", "TYPE", "DEFAULT", "MEANING")] + [r for b in blocks if not isinstance(b, str) for r in b]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    indent = 2 + sum(w + 2 for w in widths)
    width = max(indent + 30, shutil.get_terminal_size((100, 24)).columns - 1)
    out, header = [], [rows[0]]
    for block in blocks:
        if isinstance(block, str):
            out.append(block)
            continue
        for row in header + block:
            cells = "  " + "  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  "
            lines = textwrap.wrap(row[3], width - indent) or [""]
            out.append((cells + lines[0]).rstrip())
            out += [" " * indent + line for line in lines[1:]]
        header = []
    return "\n".join(out)


def _help(command: str) -> str:
    from bstrain.configs import schema
    if command != "train":
        node = {"eval": schema.EvalConfig, "convert": schema.ConvertConfig}.get(command, schema.SampleConfig)
        return _table([f"usage: python -m bstrain {command} ckpt=PATH [key=value ...]\n\nkeys:", _rows("", node)])
    import textwrap
    intro = (f"config=NAME picks an experiment ({', '.join(experiments())}; default lstm_tiny) or config=PATH.yaml "
             f"your own YAML. A section's _target_ names the class to build: model._target_=my_package.MyLM trains "
             f"your model (its keys are its constructor's arguments). The built-in options and their keys:")
    blocks: list = ["usage: python -m bstrain train [config=NAME|PATH.yaml] [key=value ...]\n\n"
                    + textwrap.fill(intro, 100)]
    for (group, name), node in schema.GROUP_SCHEMAS.items():
        blocks += [f"\n{group}={name}  ({node._target_})", _rows(f"{group}.", node)]
    blocks += ["\nsparsity=static|set|rigl  (bstrain.sparsity)", _rows("sparsity.", schema.SparsityConfig)]
    blocks += ["\nsparsify  (bstrain.nn.sparsify on the model as built, any model: sparsify.include=GLOB turns it on)",
               _rows("sparsify.", schema.SparsifyConfig)]
    for section, node in (("optim", schema.OptimConfig), ("trainer", schema.TrainerConfig)):
        blocks += [f"\n{section}", _rows(f"{section}.", node)]
    blocks += ["\ntrust", [r for r in _rows("", schema.TrainConfig) if r[0] == "trust"]]
    blocks.append("\nHydra: hydra.run.dir=DIR (the run directory); `--cfg job` prints the composed config.")
    return _table(blocks)


# --- commands ------------------------------------------------------------------------------------------
def _hydra_command(config_name: str, fn):
    import hydra

    from bstrain.configs.schema import register
    register()

    @hydra.main(config_path="configs", config_name=config_name, version_base="1.3")
    def entry(cfg):
        try:                            # an exception raised here, Hydra reports with a line of its own first
            return fn(cfg)
        except BaseException as exc:
            _exit_if_users(exc)
            raise
    return entry


_TRAIN_ARGV: list[str] = []
"""The train command's arguments as the user gave them: the workers of ``trainer.nproc`` get them."""


def _rank() -> int:
    """This process's rank under torchrun or ``trainer.nproc``; 0 in a process of its own."""
    return int(os.environ.get("RANK", "0"))


def _train(cfg):
    """Trains, in this process or on ``trainer.nproc`` workers. Rank 0 (or the launcher) leaves no run
    dir of its own making that holds nothing but what a start writes (a start that failed, or a
    finished run resumed), and writes the closing message into train.log."""
    from hydra.core.hydra_config import HydraConfig

    from bstrain.errors import UserCodeError
    from bstrain.train import rundir
    run_dir, created = HydraConfig.get().runtime.output_dir, rundir.created_by_hydra()
    try:
        result = _train_or_launch(cfg, run_dir)
    except BaseException as exc:
        if _rank() != 0:
            pass                            # (its Hydra dir is a temporary one, see _away_from_the_run_dir)
        elif isinstance(exc, SystemExit):
            rundir.remove_failed_start(run_dir, created)
        elif isinstance(exc, UserCodeError) or not rundir.remove_failed_start(run_dir, created):
            # (a user's constructor's traceback is in train.log already: that run dir stays)
            rundir.append_to_log(run_dir, _closing_line(exc) or "".join(traceback.format_exception(exc)).rstrip())
        raise
    if _rank() == 0:
        rundir.remove_failed_start(run_dir, created)
    return result


def _train_or_launch(cfg, run_dir: str):
    from bstrain.train import launch
    nproc = int(cfg.trainer.get("nproc", 1))
    if nproc <= 1 or launch.started_by_a_launcher():
        from bstrain.train.trainer import train
        return train(cfg)
    from bstrain.train.run import check_config
    check_config(cfg)                       # a bad value in one line here, before any worker starts
    status = launch.launch(nproc, _TRAIN_ARGV, run_dir)
    if status:
        raise SystemExit(status)            # the workers have said why
    return None


def _eval(cfg):
    from bstrain.train.commands import evaluate_checkpoint
    return evaluate_checkpoint(cfg)


def _convert(cfg):
    from bstrain.train.commands import convert_checkpoint
    return convert_checkpoint(cfg)


def _sample(cfg):
    from bstrain.train.commands import sample
    return sample(cfg)


COMMANDS = {"train": ("train", _train), "eval": ("eval", _eval), "sample": ("sample", _sample),
            "convert": ("convert", _convert)}


def _closing_line(exc: BaseException) -> str | None:
    """What a run that ends with ``exc`` prints: the interrupted line or ``error: ...`` for a user's
    error; None for a bug (its traceback) or an exit."""
    from bstrain.errors import RunInterrupted
    if isinstance(exc, (RunInterrupted, KeyboardInterrupt)):
        return f"interrupted: {exc}" if str(exc) else "interrupted"
    line = one_line(exc) if isinstance(exc, Exception) else None
    return None if line is None else f"error: {line}"


def _exit_if_users(exc: BaseException) -> None:
    """A user's error exits with one line (status 1), a signal with one line (status 130); a bug
    returns, for its traceback. Under torchrun or ``trainer.nproc`` only rank 0 prints the line (the
    others exit with the same status, silently); a worker of ``trainer.nproc`` hands its bug's
    traceback to the launcher, which prints the first one."""
    from bstrain.errors import RunInterrupted
    from bstrain.train.distributed import RankFailed
    from bstrain.train.launch import LAUNCHED
    if isinstance(exc, SystemExit):
        return
    line = _closing_line(exc)
    if line is None and isinstance(exc, RankFailed):
        sys.exit(1)                                     # rank 0 said what failed
    if line is None:
        _record_bug(exc)
        if LAUNCHED in os.environ:
            sys.exit(1)
        return
    code = RunInterrupted.exit_code if line.startswith("interrupted") else 1
    if _rank() == 0:
        print(line, file=sys.stderr)
    sys.exit(code)


def _record_bug(exc: BaseException) -> None:
    """The traceback into torchelastic's error file, where torchrun and ``trainer.nproc`` read a
    worker's root cause (what torch's ``@record`` does)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)


def run(command: str, argv: list[str]) -> None:
    """Runs a command on its key=value arguments (see the module's docstring for errors)."""
    from hydra.errors import ConfigCompositionException
    config_name, fn = COMMANDS[command]
    if _rank() != 0:                        # rank 0 says it, once
        import warnings
        warnings.simplefilter("ignore")
    try:
        _TRAIN_ARGV[:] = argv
        args: list[str] | None = rewrite(command, argv)
        if _rank() != 0 and command == "train":
            args = _away_from_the_run_dir(args)
        os.environ["HYDRA_FULL_ERROR"] = "1"          # Hydra raises its errors, for _exit_if_users
        while True:
            sys.argv[1:] = args
            try:
                return _hydra_command(config_name, fn)()
            except ConfigCompositionException as exc:
                # model.NAME=VALUE that a user's model takes but its YAML does not list: +model.NAME=VALUE
                args = with_constructor_argument(exc, args)
                if args is None:
                    raise
    except BaseException as exc:
        _exit_if_users(exc)
        raise


def _away_from_the_run_dir(args: list[str]) -> list[str]:
    """A rank other than 0 lets its Hydra make an empty temporary directory, not one beside rank
    0's (runs/DATE/TIME can differ by a second between ranks); the trainer takes rank 0's run dir
    (``trainer.run_dir``, or the one rank 0 broadcasts)."""
    import atexit
    import shutil
    import tempfile
    scratch = tempfile.mkdtemp(prefix="bstrain-rank-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    kept = [a for a in args if a.partition("=")[0].lstrip("+") not in ("hydra.run.dir", "hydra.output_subdir")]
    return [*kept, f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]


def _unknown_command(command: str) -> str:
    import difflib
    names = [*COMMANDS, "advise"]
    close = difflib.get_close_matches(command, names, n=1)
    return (f"error: unknown command {command!r}; "
            + (f"did you mean {close[0]}?" if close else f"commands: {', '.join(names)}"))


def main() -> None:
    if len(sys.argv) < 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)                             # as argparse does for a missing command
    if sys.argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command = sys.argv.pop(1)
    if command == "advise":                     # no Hydra: a table from bstrain/measurements/
        from bstrain.advise import main as advise
        advise(sys.argv[1:])
        return
    if command not in COMMANDS:
        print(_unknown_command(command), file=sys.stderr)
        sys.exit(2)
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(_help(command))
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:      # a worker of trainer.nproc or torchrun
        _leave_as_a_worker(command, sys.argv[1:])
    run(command, sys.argv[1:])


def _leave_as_a_worker(command: str, argv: list[str]) -> None:
    """Runs the command, then ends the process without freeing what the run left: a DDP reducer
    freed after a stop destroys its gloo process group, joining a worker thread that may be waiting
    for the GIL the freeing thread holds (a hang after the run has stopped and said so). The
    exception, whose traceback holds the run, is kept until the end; logs, streams and atexit
    functions are flushed and run first."""
    import atexit
    import logging
    import traceback
    code: int = 0
    held = None                                           # kept alive: nothing of the run is freed
    try:
        run(command, argv)
    except SystemExit as exc:
        held = exc
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:                          # a bug: its traceback, as Python would print it
        held = exc
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    del held                                              # (os._exit frees nothing)
    os._exit(code)


if __name__ == "__main__":
    main()
