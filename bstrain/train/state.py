"""What a run's checkpoint saves and restores, and the run's changing state.

:class:`TrainState` is what changes as a run trains (step, the carried model state, the metrics);
the rest of a run (:class:`bstrain.train.run.Run`) is built once. A checkpoint's entries
(:data:`KEYS`) are written by :func:`capture` and read by :func:`restore`, both from one table
(:data:`_ENTRIES`) in which each entry's capture and restore stand side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from bstrain.errors import CheckpointError
from bstrain.train.distributed import gather
from bstrain.train.step import state_tensors

Run = Any      # bstrain.train.run.Run (not imported: run builds on this module)


@dataclass
class TrainState:
    """What changes as the run trains; a checkpoint holds the entries marked (ckpt)."""
    step: int = 0                         # (ckpt) optimizer steps taken
    carried: Any = None                   # the stateful model's carried state (ckpt: every rank's)
    pending: Any = None                   # a checkpoint's carried states, placed at the first batch
    train_loss: float = math.nan          # (ckpt) the mean loss of the last logged window ...
    train_loss_steps: int = 0             # (ckpt) ... of this many steps
    valid: dict = field(default_factory=dict)           # (ckpt) the last evaluation's metrics
    history: list = field(default_factory=list)         # (step, loss) of every logged step
    valid_history: list = field(default_factory=list)   # (step, seconds, metric) of every evaluation
    throughput: list = field(default_factory=list)      # units/s of each logged window
    skipped: Any = 0                      # fp16 steps skipped since the last log (a device tensor)
    stop: str | None = None               # the signal that asked the run to stop
    first_batch: tuple | None = None      # the batch the start's check ran on: the first step trains on it


class _Entry(NamedTuple):
    capture: Callable[[Run, bool], Any]           # (run, weights) -> the entry
    restore: Callable[[Run, Any, dict], None]     # (run, the entry, the whole checkpoint)


def _restore_step(run: Run, value, ckpt: dict) -> None:
    run.state.step = int(value)


def _restore_scaler(run: Run, value, ckpt: dict) -> None:
    if not run.scaler.is_enabled():
        return
    if value:
        run.scaler.load_state_dict(value)
        run.scaler.set_growth_interval(run.settings.loss_scale_window)     # this run's setting wins
    else:
        from bstrain.train.progress import log
        log.info("checkpoint %s: no fp16 loss scale in it; scaling starts at %g", ckpt["path"], run.scaler.get_scale())


def _restore_ema(run: Run, value, ckpt: dict) -> None:
    if run.ema is not None and value is not None:
        run.strategy.load_ema(run.ema, value)


def _restore_model(run: Run, value, ckpt: dict) -> None:
    """The model and optimizer entries (None: a sharded checkpoint, loaded in place already)."""
    from bstrain.train.checkpoint import check_model_entries
    if value is None:
        return
    check_model_entries(run.model, value, ckpt["path"])
    before = [id(p) for p in run.model.parameters()]
    run.strategy.load_weights(run.model, run.optimizer, ckpt)
    if [id(p) for p in run.model.parameters()] != before:
        raise RuntimeError("loading the checkpoint replaced a parameter the optimizer holds")


def _restore_rng(run: Run, value, ckpt: dict) -> None:
    torch.set_rng_state(value["cpu"])
    if run.device.type == "cuda" and value.get("cuda") is not None:
        torch.cuda.set_rng_state(value["cuda"], run.device)


def _capture_rng(run: Run, weights: bool) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None}


def _restore_carried(run: Run, value, ckpt: dict) -> None:
    run.state.pending = value if run.task.state_continues else None     # placed at the first batch


def _restore_metrics(run: Run, value, ckpt: dict) -> None:
    metrics = value or {}
    run.state.train_loss = metrics.get("train_loss", math.nan)
    run.state.train_loss_steps = int(metrics.get("train_loss_steps", 0))
    run.state.valid = dict(metrics.get("valid") or {})


def _restore_schedule(run: Run, value, ckpt: dict) -> None:
    step = run.state.step
    saved = value or {"max_steps": ckpt["config"].get("trainer", {}).get("max_steps", step)}
    change = run.schedule.resume(saved, step)
    if change:
        from bstrain.train.progress import log
        log.info("%s", change)


def _nothing(run: Run, value, ckpt: dict) -> None:
    """The config: read before the run is built (resuming reads the checkpoint's config)."""


_ENTRIES: dict[str, _Entry] = {
    "step": _Entry(lambda run, weights: run.state.step, _restore_step),
    "model": _Entry(lambda run, weights: run.model.state_dict() if weights else None, _restore_model),
    "optimizer": _Entry(lambda run, weights: run.optimizer.state_dict() if weights else None, _nothing),  # (with model)
    "scaler": _Entry(lambda run, weights: run.scaler.state_dict(), _restore_scaler),
    "ema": _Entry(lambda run, weights: run.ema.state_dict() if run.ema is not None and weights else None,
                  _restore_ema),
    "task": _Entry(lambda run, weights: run.task.state_dict(),
                   lambda run, value, ckpt: run.task.load_state_dict(value, run.world)),
    "rng": _Entry(_capture_rng, _restore_rng),
    "state": _Entry(lambda run, weights: None, _restore_carried),         # (gathered in capture: collective)
    "metrics": _Entry(lambda run, weights: {"train_loss": run.state.train_loss,
                                            "train_loss_steps": run.state.train_loss_steps,
                                            "valid": dict(run.state.valid)}, _restore_metrics),
    "config": _Entry(lambda run, weights: run.config, _nothing),
    "schedule": _Entry(lambda run, weights: run.schedule.state_dict(), _restore_schedule),
}
KEYS = tuple(_ENTRIES)
"""Every entry of a training checkpoint. ``state``: each rank's carried model state (stateful
models), in rank order; ``task``: the data position; ``metrics``: the last train loss (the mean of
the last logged window, and its number of steps) and validation results, so resuming a finished
run can report them; ``schedule``: the learning-rate schedule's horizon and restart
(:class:`bstrain.train.schedule.LRSchedule`)."""
_LATER_KEYS = ("schedule",)
"""Entries that checkpoints of earlier versions lack and a resume does without."""


def capture(run: Run, weights: bool = True) -> dict | None:
    """The checkpoint of a run. Collective under DDP (the carried states are gathered); returns
    the dict on rank 0 and None elsewhere. ``weights=False`` leaves the model, optimizer and EMA
    out (None): a sharded checkpoint writes them through DCP."""
    states = gather([t.detach().cpu() for t in state_tensors(run.state.carried)] or None, run.world)
    if not run.world.main:
        return None
    out = {key: entry.capture(run, weights) for key, entry in _ENTRIES.items()}
    out["state"] = states if any(s is not None for s in states) else None
    return out


def restore(run: Run, ckpt: dict) -> None:
    """Loads a checkpoint into a freshly built run, checking the model's entries first. The
    carried state waits in ``run.state.pending`` until the first batch shows this rank's batch size."""
    if missing := [k for k in KEYS if k not in ckpt and k not in _LATER_KEYS]:
        raise CheckpointError(f"checkpoint {ckpt['path']}: no {', '.join(missing)} entries (written by an older "
                              f"bstrain?); it can be evaluated and sampled, not resumed")
    for key, entry in _ENTRIES.items():
        entry.restore(run, ckpt.get(key), ckpt)
