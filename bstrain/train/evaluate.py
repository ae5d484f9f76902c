"""Evaluation during training: the model (or its EMA) on the valid split through the task, as the
strategy evaluates (rank 0 alone, or under fsdp every rank its share: bstrain/train/strategy.py),
with the evaluation forward graphed where the step is; every rank gets the result."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bstrain.train.progress import Board, Progress, log
from bstrain.train.step import Forward

if TYPE_CHECKING:
    from bstrain.train.run import Run


def validate(run: Run, progress: Progress, board: Board, elapsed: float) -> None:
    """Evaluates on the valid split (the EMA weights when kept, and the log line says so); rank 0
    logs the result, every rank keeps it in ``run.state.valid``."""
    state = run.state
    model = run.ema.module if run.ema is not None else run.model
    model.eval()
    try:
        forward = run.stepper.eval_forward(Forward(model, run.forward.amp_dtype, run.device), model)
        with torch.no_grad():
            valid = run.strategy.evaluate(run.task, forward, "valid", run.settings.eval_batches, progress.active)
    finally:
        model.train()
        run.strategy.settle(model)
    state.valid = valid
    if run.world.main:
        board.scalars(state.step, {f"valid/{k}": v for k, v in valid.items()})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in valid.items() if isinstance(v, float))
        log.info("step %d: %s %s", state.step, valid_label(run.ema), shown)
        state.valid_history.append((state.step, elapsed, valid.get(run.task.metric, valid["loss"])))


def valid_label(ema) -> str:
    """'valid', or 'valid (EMA weights)' when evaluation reads the EMA of the weights (``ema`` not None)."""
    return "valid (EMA weights)" if ema is not None else "valid"
