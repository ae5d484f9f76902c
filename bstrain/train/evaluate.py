"""Evaluation during training: rank 0 evaluates the model (or its EMA) on the valid split through
the task, with the evaluation forward graphed where the step is; every rank gets the result."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bstrain.train.distributed import broadcast, on_main
from bstrain.train.fsdp import reshard
from bstrain.train.graphs import GraphedForward
from bstrain.train.progress import Board, Progress, log
from bstrain.train.step import Forward

if TYPE_CHECKING:
    from bstrain.train.run import Run


def validate(run: Run, progress: Progress, board: Board, elapsed: float) -> None:
    """Rank 0 evaluates (the EMA weights when kept, and the log line says so) on the valid split;
    every rank gets the result."""
    def evaluate():
        model = run.ema.module if run.ema is not None else run.model
        model.eval()
        try:
            forward = Forward(model, run.forward.amp_dtype, run.device)
            if run.stepper.graphed:                     # static shapes: the evaluation forward is graphed too
                forward = run.eval_forwards.setdefault(id(model), GraphedForward(forward))
            with torch.no_grad():
                valid = run.task.evaluate(forward, "valid", run.cfg.trainer.eval_batches, progress.active)
        finally:
            model.train()
            if run.strategy == "fsdp":
                reshard(model)          # a forward without backward leaves units gathered that keep their gathers
        if run.world.main:
            board.scalars(run.step, {f"valid/{k}": v for k, v in valid.items()})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in valid.items() if isinstance(v, float))
            log.info("step %d: %s %s", run.step, valid_label(run), shown)
            run.valid_history.append((run.step, elapsed, valid.get(run.task.metric, valid["loss"])))
        return valid
    if run.strategy == "fsdp":              # every rank runs the sharded forward (its gathers are collective)
        run.valid = broadcast(evaluate(), run.world)
    else:
        run.valid = broadcast(on_main(run.world, evaluate), run.world)


def valid_label(run: Run) -> str:
    """'valid', or 'valid (EMA weights)' when evaluation reads the EMA of the weights."""
    return "valid (EMA weights)" if run.ema is not None else "valid"
