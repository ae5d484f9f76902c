"""Checkpoints: written atomically, read without executing code.

A checkpoint is one ``torch.save`` file of plain data (tensors, numbers, strings, dicts, lists):
model, optimizer, loss scaler, EMA, RNG states, data position, the carried recurrent state, the
last metrics and the resolved config (:data:`KEYS`; :func:`capture` and :func:`restore`, in
bstrain/train/state.py, are the only code that writes or reads them). It is written to ``NAME.tmp``, flushed to disk, then renamed, so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of
one; leftover ``.tmp`` files are ignored. Reading uses ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from bstrain.errors import CheckpointError  # noqa: F401 (defined in bstrain.errors; imported from here too)

__all__ = ["CheckpointError", "check_model_entries", "save_checkpoint",
           "load_checkpoint", "find_checkpoint", "saved_config", "latest_checkpoint", "prune_checkpoints",
           "checkpoint_path"]

_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")      # a file, or a sharded (DCP) directory


def checkpoint_path(directory: str | Path, step: int, sharded: bool = False) -> Path:
    """``step_NNNNNNNN.pt``, or ``step_NNNNNNNN.dcp`` (a directory: bstrain/train/sharded.py)."""
    return Path(directory) / f"step_{step:08d}.{'dcp' if sharded else 'pt'}"


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Writes ``state`` to ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:        # a full disk, or a second Ctrl-C mid-write: no half file left behind
        tmp.unlink(missing_ok=True)
        if _disk_full(exc):
            from bstrain.errors import UserError
            last = latest_checkpoint(path.parent)
            raise UserError(f"checkpoint {path} not written: no space left on device"
                            + (f"; the last one, {last}, is intact" if last is not None else "")
                            + "; free space, or keep fewer checkpoints with a lower trainer.keep_ckpts") from None
        raise
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


def _disk_full(exc: BaseException | None) -> bool:
    """Whether a full disk (or quota) is behind ``exc``: torch's zip writer reports the OSError, then
    its own "unexpected pos" error on top of it."""
    import errno
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def load_checkpoint(path: str | Path, map_location="cpu", check_config=None) -> dict:
    """Reads a checkpoint file, or the latest one in a directory (a run dir or its ckpt/).

    check_config: called with the stored config and the checkpoint's path before this returns, and
    before a DCP directory's metadata or tensors are read (:func:`bstrain.train.trust.check_config`).
    """
    from bstrain.train.sharded import is_sharded_checkpoint, read_extra, read_full
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        found = find_checkpoint(path)
        if found is None:
            raise CheckpointError(f"checkpoint: no step_* checkpoint in {path} or {path / 'ckpt'}")
        path = found
    if is_sharded_checkpoint(path):
        try:
            extra = read_extra(path)
            if check_config is not None:
                check_config(extra.get("config") or {}, path)
            state = read_full(path, extra)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint: cannot read the sharded checkpoint {path} ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        state["path"] = str(path)
        return state
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)   # (read as needed)
    except Exception as exc:  # truncated zip, garbage, or a pickle that needs code: all unreadable
        raise CheckpointError(f"checkpoint: cannot read {path} ({type(exc).__name__}); "
                              f"the file is truncated, corrupt or not a bstrain checkpoint") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint: {path} is not a bstrain checkpoint (no model/step entries)")
    if check_config is not None:
        check_config(state.get("config") or {}, path)
    state["path"] = str(path)
    return state


def find_checkpoint(path: str | Path) -> Path | None:
    """A checkpoint file as it is, or the latest checkpoint in a directory (a run dir or its
    ckpt/); None when there is none."""
    from bstrain.train.sharded import is_sharded_checkpoint
    path = Path(path)
    if is_sharded_checkpoint(path):
        return path
    if path.is_dir():
        return latest_checkpoint(path) or latest_checkpoint(path / "ckpt")
    return path if path.is_file() else None


def saved_config(path: str | Path) -> dict | None:
    """The config a checkpoint was trained with, read without loading its tensors (a memory map);
    None when the file cannot be read that way (:func:`load_checkpoint` says why when the run loads it)."""
    from bstrain.train.sharded import EXTRA, is_sharded_checkpoint
    try:
        if is_sharded_checkpoint(path):
            state = torch.load(Path(path) / EXTRA, map_location="cpu", weights_only=True)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return state.get("config") if isinstance(state, dict) else None


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
    import shutil
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))
    for _, p in found[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in directory.glob("*.pt.tmp"):
        p.unlink(missing_ok=True)
    for p in directory.glob("*.dcp.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def check_model_entries(model: torch.nn.Module, saved: dict, path, adopt_layouts: bool = False) -> None:
    """CheckpointError naming the first parameter or buffer whose name or shape differs.

    adopt_layouts: the weight of a layer whose ``layout`` the checkpoint holds may differ in shape
    (evaluation loads the checkpoint's layouts with ``assign=True``; training may not).
    """
    own = model.state_dict()
    for name, value in saved.items():
        if name not in own:
            raise CheckpointError(f"checkpoint {path}: it holds {name!r}, which the model this config builds lacks; "
                                  f"resume with the config that wrote it")
        layer = name.rsplit(".", 1)[0] + "." if "." in name else ""
        if adopt_layouts and f"{layer}layout" in saved and name == f"{layer}weight":
            continue
        if tuple(own[name].shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(value.shape)} there and "
                                  f"{tuple(own[name].shape)} in the model this config builds (a changed model.* key?); "
                                  f"resume with the config that wrote it")
    if missing := [n for n in own if n not in saved]:
        raise CheckpointError(f"checkpoint {path}: it lacks {missing[0]!r}, which the model this config builds has; "
                              f"resume with the config that wrote it")

