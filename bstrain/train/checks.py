"""Does the model fit the data? Checked when a run starts, before its run directory fills.

Two checks, both through the task protocol (bstrain/train/tasks), so that every task and a
user's own model are covered alike:

- :func:`check_model_config`: the model's config keys whose values the data fixes, by the names
  models commonly give them (``in_channels``, ``classes``, ``vocab_size``, ``context`` ...):
  a mismatch names the key and the value to set;
- :func:`check_first_batch`: one forward, in eval mode and without gradients, on two rows of
  the run's first training batch, whose output the task's ``loss`` checks (shape: ``(B, T,
  256)`` for the byte LM, ``(B, classes)`` for classification).

Either raises one :class:`bstrain.errors.UserError` line instead of a traceback from inside the
first step. An exception of another kind from the model's forward may be a bug in it: it keeps
its traceback, with a note saying which batch the model failed on.
"""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from bstrain.errors import UserError
from bstrain.train.step import Forward

ROWS = 2
"""Rows of the first batch the check's forward runs on (a fraction of a step's cost)."""


def _target(node) -> str:
    return str(node.get("_target_", "?")) if OmegaConf.is_dict(node) else "?"


def check_model_config(task, model_cfg) -> None:
    """The task's ``check_model_config(model: dict)``, on the model section as plain values."""
    check = getattr(task, "check_model_config", None)
    if callable(check) and OmegaConf.is_dict(model_cfg):
        check(OmegaConf.to_container(model_cfg, resolve=True, enum_to_str=True))


def _rows(t, n: int = ROWS):
    """The first ``n`` rows of a tensor or of each tensor in a tuple/list/dict (batch on dim 0)."""
    if isinstance(t, torch.Tensor):
        return t[:n] if t.dim() > 0 else t
    if isinstance(t, (tuple, list)):
        return type(t)(_rows(v, n) for v in t)
    if isinstance(t, dict):
        return {k: _rows(v, n) for k, v in t.items()}
    return t


def describe(t) -> str:
    """'(2, 3, 32, 32) float32' for a tensor; the type's name otherwise."""
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return type(t).__name__


def check_first_batch(model: torch.nn.Module, task, batch, amp_dtype, device: torch.device, cfg) -> None:
    """One forward of ``model`` (the plain module: not compiled, not DDP) on the first rows of
    ``batch`` = (inputs, targets, fresh), and the task's loss on its output. The model's training
    mode, parameters, buffers and the RNG streams are left as they were."""
    x, y = _rows(batch[0]), _rows(batch[1])
    model_name, task_name = _target(cfg.model), _target(cfg.task)
    was_training = model.training
    model.eval()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            try:
                output, _ = Forward(model, amp_dtype, device)(x, None)
            except UserError:
                raise
            except ValueError as exc:           # the model's own check of its input
                raise UserError(f"model ({model_name}) rejects a batch of the data (inputs {describe(x)}): "
                                f"{' '.join(str(exc).split())}") from exc
            except RuntimeError as exc:
                if "mixed torch.Tensor and DTensor" in str(exc):     # FSDP: a unit's parameter used outside it
                    raise UserError(_cross_unit(model, model_name, exc)) from exc
                _note(exc, model_name, x, task)
                raise
            except Exception as exc:
                _note(exc, model_name, x, task)
                raise
            try:
                task.loss(output, y)
            except (TypeError, ValueError) as exc:
                raise UserError(f"model ({model_name}) does not fit the task ({task_name}): "
                                f"{' '.join(str(exc).split())}") from exc
    finally:
        model.train(was_training)


def _note(exc: BaseException, model_name: str, x, task) -> None:
    exc.add_note(f"bstrain: the model ({model_name}) failed before training started, on {ROWS} rows of "
                 f"the first training batch: inputs {describe(x)}, from the {task.describe()}")


def _cross_unit(model: torch.nn.Module, model_name: str, exc: BaseException) -> str:
    """The line for FSDP's 'mixed torch.Tensor and DTensor': a parameter of one sharded unit read
    outside that unit's forward (in another unit's, or the root's), named by the model's code line
    that read it, with the units and the fix."""
    import linecache
    import traceback
    from torch.distributed.fsdp import FSDPModule
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/bstrain/" not in f.filename]
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} " \
            f"`{linecache.getline(frames[-1].filename, frames[-1].lineno).strip()}`" if frames else ""
    units = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    return (f"model ({model_name}): a parameter of an FSDP unit is used outside that unit's forward{where}; "
            f"the units are {', '.join(units[:6])}{' ...' if len(units) > 6 else ''} (model.shard); shard a "
            f"module that holds every use of the parameter, or pass it through its unit's forward")
