"""The log window: the device-side losses, gradient norms and task metrics of the steps since the
last log line, read once per ``trainer.log_every`` steps (the loop's only host sync) into the
log line, the progress bar and TensorBoard."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from bstrain.train.distributed import all_mean, gather
from bstrain.train.progress import Board, Progress, Throughput, log

if TYPE_CHECKING:
    from bstrain.train.run import Run


class Window:
    """The device-side losses, gradient norms and task metrics of the steps since the last log line,
    and their throughput (:class:`bstrain.train.progress.Throughput`: warm-up steps and paused
    time left out)."""

    def __init__(self):
        self.meter = Throughput()
        self.reset()

    def reset(self) -> None:
        self.losses, self.norms, self.metrics = [], [], []
        self.meter.reset()

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, metrics: dict) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.metrics.append(metrics)

    def stacked(self) -> tuple[torch.Tensor, list[str]]:
        """(1 + metrics, steps) float64 on the device: each step's loss, then each task metric;
        and the metrics' names."""
        names = sorted(self.metrics[0]) if self.metrics else []
        rows = [torch.stack(self.losses).double()] + [torch.stack([m[k] for m in self.metrics]).double()
                                                      for k in names]
        return torch.stack(rows), names

    def pause(self):
        """Time spent here (validation, checkpoints) does not count against the throughput."""
        return self.meter.pause()


def log_window(run: Run, window: Window, progress: Progress, board: Board) -> None:
    """The only host sync of the loop: the window's losses and task metrics (averaged over ranks),
    norms and skips."""
    n = len(window.losses)
    if n == 0:
        return
    rows, names = window.stacked()
    losses, *rest = all_mean(rows, run.world).tolist()                   # one read: losses and task metrics
    task_metrics = {k: sum(v) / n for k, v in zip(names, rest)}
    norms = torch.stack(window.norms).float().tolist()
    state = run.state
    skipped = int(state.skipped) if isinstance(state.skipped, torch.Tensor) else state.skipped
    state.skipped = 0
    first = state.step - n + 1
    state.history.extend(zip(range(first, state.step + 1), losses))
    finite = [g for g in norms if math.isfinite(g)]
    mean_loss = sum(losses) / n
    state.train_loss, state.train_loss_steps = mean_loss, n
    unit = run.task.unit
    metrics = {"loss": mean_loss, **run.task.train_metrics(mean_loss), **task_metrics,
               "lr": run.schedule.lr(state.step - 1),
               "grad_norm": sum(finite) / len(finite) if finite else float("nan")}
    rate = window.meter.rate()                      # after the read above: the device's work is done
    if math.isfinite(rate):                         # (NaN: only warm-up steps in this window)
        metrics[f"{unit}_per_s"] = rate
        state.throughput.append(rate)
    if run.scaler.is_enabled():
        metrics["loss_scale"] = run.scaler.get_scale()
        _check_same_scale(metrics["loss_scale"], run.world, state.step)
        if skipped:
            log.info("step %d: %d of the last %d steps skipped (fp16 overflow: inf/NaN gradients); loss scale now "
                     "%g", state.step, skipped, n, metrics["loss_scale"])
    if run.device.type == "cuda":
        metrics["gpu_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    progress.show(state.step, metrics, run.task.metric, unit, steps=n)
    board.scalars(state.step, {f"train/{k}": v for k, v in metrics.items()})
    window.reset()


def _check_same_scale(scale: float, world, step: int) -> None:
    """Under DDP every rank sees the all-reduced gradients, so all skip together and keep one scale."""
    scales = gather(scale, world)
    if len(set(scales)) > 1:
        raise RuntimeError(f"fp16 loss scales differ across ranks at step {step}: {scales}")
