"""Checkpoints: written atomically, read without executing code.

A checkpoint is one ``torch.save`` file of plain data (tensors, numbers, strings, dicts, lists):
model, optimizer, loss scaler, schedule, EMA, RNG states, data position, the carried recurrent
state and the resolved config. It is written to ``NAME.tmp``, flushed to disk, then renamed, so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of
one; leftover ``.tmp`` files are ignored. Reading uses ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "prune_checkpoints",
           "checkpoint_path"]

_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt or not one of ours."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Writes ``state`` to ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Reads a checkpoint file, or the latest one in a directory (a run dir or its ckpt/)."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path) or latest_checkpoint(path / "ckpt")
        if found is None:
            raise CheckpointError(f"checkpoint: no step_*.pt file in {path} or {path / 'ckpt'}")
        path = found
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, garbage, or a pickle that needs code: all unreadable
        raise CheckpointError(f"checkpoint: cannot read {path} ({type(exc).__name__}); "
                              f"the file is truncated, corrupt or not a bstrain checkpoint") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint: {path} is not a bstrain checkpoint (no model/step entries)")
    state["path"] = str(path)
    return state


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def prune_checkpoints(directory: str | Path, keep: int) -> None:
    """Deletes all but the newest ``keep`` checkpoints, and stale temp files."""
    directory = Path(directory)
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))
    for _, p in found[:-keep] if keep > 0 else []:
        p.unlink(missing_ok=True)
    for p in directory.glob("*.pt.tmp"):
        p.unlink(missing_ok=True)
