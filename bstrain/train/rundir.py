"""Run directories that a failed start leaves behind: which part of one a start created, and
removing it again when the start stops on an error before training.

The trainer creates the run directory itself when called as a library; under the CLI, Hydra
creates it before the command runs, and :class:`RecordCreatedDirs` (a Hydra callback named in
bstrain/configs/train.yaml) notes which directories that will make.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from hydra.experimental.callback import Callback

# What a start writes before its first training step: Hydra's copy of the config and the log.
START_FILES = frozenset({".hydra", "train.log"})

_created_by_hydra: list[Path] = []


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first (absolute)."""
    out = []
    for p in [Path(path).absolute(), *Path(path).absolute().parents]:
        if p.exists():
            break
        out.append(p)
    return out


class RecordCreatedDirs(Callback):
    """Before Hydra makes the run directory: the directories it is about to create."""

    def on_run_start(self, config, **kwargs) -> None:
        _created_by_hydra[:] = missing_dirs(str(config.hydra.run.dir))


def created_by_hydra() -> list[Path]:
    return list(_created_by_hydra)


def remove_failed_start(run_dir: str | Path, created: list[Path]) -> bool:
    """Removes ``run_dir`` when this start created it (it is in ``created``) and it holds nothing but
    what a start writes (:data:`START_FILES`), then the parents in ``created`` left empty. True when
    the run directory was removed."""
    run_dir = Path(run_dir).absolute()
    if run_dir not in created or not run_dir.is_dir():
        return False
    if any(p.name not in START_FILES for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in created:
        if parent != run_dir and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    return not run_dir.exists()


def append_to_log(run_dir: str | Path, message: str | None, rank: int = 0) -> None:
    """``message`` at the end of run_dir/train.log, as the run's own lines read, when the run
    has a log: how the run ended (an error, the interruption and how to resume), printed
    after the run's logging closed."""
    log = Path(run_dir) / "train.log"
    if message is None or not log.is_file():        # (a start that never logged writes no log for it)
        return
    import logging
    level = logging.WARNING if message.startswith("interrupted") else logging.ERROR
    record = logging.LogRecord("bstrain", level, __file__, 0, message, None, None)
    line = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s").format(record)
    with open(log, "a", encoding="utf-8") as f:
        f.write(line + "\n")


_PLAIN = re.compile(r"[\w./:@+-]*", re.ASCII)       # values Hydra's grammar takes unquoted, as they are


def quote_path(value: str) -> str:
    """A path as Hydra's override grammar reads it back unchanged: ``~`` expanded, and single-quoted
    when it holds characters the grammar gives a meaning (``*``, ``,``, spaces, ``[``, quotes ...).
    ``null`` and values already quoted stay as they are; ``${...}`` still interpolates."""
    if value[:1] in ("'", '"') or _PLAIN.fullmatch(value):
        return value
    if value.startswith("~"):
        value = os.path.expanduser(value)
        if _PLAIN.fullmatch(value):
            return value
    return _quoted(value)


def _quoted(value: str) -> str:
    """``value`` single-quoted for Hydra's override grammar, which then reads it back unchanged."""
    # in a quoted value, only backslashes before a quote (or before the closing one) are escapes
    value = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    value = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, value)
    return f"'{value}'"
