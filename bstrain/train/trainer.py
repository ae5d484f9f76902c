"""The training loop: ``train(cfg) -> dict``, called by ``python -m bstrain train`` and by tests.

It knows no model family and no metric by name. The model, data and task are built from the
config by their ``_target_``; the task (bstrain/train/tasks) owns batches, loss, metrics and
evaluation; a model is stateless (``forward(x)``) or stateful (``init_state`` and
``forward(x, state)``), see bstrain/train/step.py. One step function
(:func:`bstrain.train.step.train_step`) serves the eager loop, the CUDA-graph replay and the
benchmarks, and one object built once (:class:`bstrain.train.stepper.Stepper`) decides how each
step runs (a graph, a graph armed for a sparsity update, or eager); one pair of functions
(:func:`bstrain.train.state.capture` / ``restore``) writes and reads checkpoints.

Here: the loop (:func:`fit`, flat as nanoGPT's) and :func:`train`. A run's config is checked and
its parts built in bstrain/train/run.py (the optimizer in optim.py); the logged window is
window.py, validation evaluate.py, signals and the time limit stopping.py.

Precision: fp32 master weights always. fp16 runs the forward under autocast with dynamic loss
scaling (torch.amp.GradScaler: starts at 2**16, halves and skips the step on inf/NaN, doubles
after ``trainer.loss_scale_window`` clean steps), so no NaN ever reaches the weights; bf16 runs
under autocast without scaling.

Host syncs: the loop keeps losses and gradient norms on the device and reads them once per
``trainer.log_every`` steps (fp16's GradScaler still checks for inf at every step).
"""
from __future__ import annotations

import gc
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.errors import RunInterrupted, UserCodeError
from bstrain.nn import block_sparse_layouts
from bstrain.train import sparsity
from bstrain.train.distributed import barrier, broadcast, device_for, finish, init_world
from bstrain.train.evaluate import valid_label, validate
from bstrain.train.fsdp import class_name
from bstrain.train.optim import _match_graph_mode, make_optimizer  # noqa: F401 (read from here by tests)
from bstrain.train.progress import Board, Progress, log, remove_logging, setup_logging
from bstrain.train.run import Run, Settings, _run_dir, build, check_config, instantiate, resolve_device, set_threads
from bstrain.train.rundir import missing_dirs, remove_failed_start
from bstrain.train.schedule import set_lr
from bstrain.train.state import capture
from bstrain.train.step import is_stateful, unwrap
from bstrain.train.stopping import _agree_to_stop, resume_hint, stop_on_signals
from bstrain.train.window import Window, log_window

__all__ = [  # the names scripts and tests import from here; most live in the modules above
    "PRECISIONS", "Run", "Settings", "Window", "build", "check_config", "fit", "instantiate", "log_window",
    "make_optimizer", "next_batch", "one_step", "resolve_device", "resume_hint", "save", "set_threads",
    "stop_on_signals", "train", "valid_label", "validate"]


def __getattr__(name: str):
    if name == "PRECISIONS":                            # (deprecated: bstrain.configs.schema.Precision)
        from bstrain.train import run
        return run.PRECISIONS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- one step ------------------------------------------------------------------------------------
def next_batch(run: Run) -> tuple:
    """(inputs, targets, fresh): the batch the start checked, then the task's next ones."""
    batch, run.state.first_batch = run.state.first_batch, None
    return batch if batch is not None else run.task.next_batch(run.device)


def _place_state(run: Run, x: torch.Tensor) -> None:
    """A checkpoint's carried states, split for this world; a different global batch starts fresh."""
    states, run.state.pending = run.state.pending, None
    if not states or not is_stateful(run.model):
        return
    rows = [torch.cat(ts, 0) for ts in zip(*states)]               # every rank's rows, in rank order
    per_rank = x.shape[0]
    if rows[0].shape[0] != per_rank * run.world.size:
        log.warning("checkpoint: carried states for %d sequences, this run trains %d x %d: starting from a fresh "
                    "state", rows[0].shape[0], run.world.size, per_rank)
        return
    mine = [r[run.world.rank * per_rank:(run.world.rank + 1) * per_rank].to(run.device) for r in rows]
    template = unwrap(run.model).init_state(per_rank, run.device)
    run.state.carried = _like(template, iter(mine))
    run.stepper.load_state(run.state.carried, x)


def _like(template, tensors):
    """``template``'s structure (a tensor or nested tuples) filled from an iterator of tensors."""
    if isinstance(template, torch.Tensor):
        return next(tensors).to(template.dtype)
    return type(template)(_like(t, tensors) for t in template)


def one_step(run: Run, x: torch.Tensor, y: torch.Tensor, fresh: bool):
    """One optimizer step at this step's learning rate (:class:`bstrain.train.stepper.Stepper`);
    returns (loss, grad norm, the task's batch metrics), all on the device."""
    state = run.state
    set_lr(run.optimizer, run.schedule.lr(state.step))
    if state.pending is not None:
        _place_state(run, x)
    if fresh:
        state.carried = None                            # the data stream restarts: so does the state
    loss, grad_norm, metrics, state.carried, skipped = run.stepper.step(x, y, state.carried, run.stepper.armed)
    if skipped is not None:                             # fp16: the steps skipped since the last log
        state.skipped = state.skipped + skipped
    return loss, grad_norm, metrics



# --- checkpoints ---------------------------------------------------------------------------------
def save(run: Run) -> Path:
    """A checkpoint of this step, as the strategy writes it (collective; a file rank 0 writes, or
    under fsdp every rank's shards: bstrain/train/sharded.py); returns its path."""
    return run.strategy.save(run.run_dir / "ckpt", run.state.step, lambda weights: capture(run, weights), run.model,
                             run.optimizer, run.ema, run.settings.keep_ckpts)


# --- the loop --------------------------------------------------------------------------------------------
def _header(run: Run) -> dict:
    """Logs what is being trained; returns the model's block-sparse layouts (for TensorBoard)."""
    own = getattr(run.model, "block_sparse_layouts", None)
    layouts = dict(own()) if callable(own) else dict(block_sparse_layouts(run.model))
    params = sum(p.numel() for p in run.model.parameters())
    sparse = ", ".join(f"{name} {lay.shape[0]}x{lay.shape[1]} blocks at density {lay.mean():.3f}"
                       for name, lay in layouts.items()) or "no block-sparse layers"
    log.info("run dir %s | device %s x %d%s | precision %s | %s | %s parameters (%s) | %s", run.run_dir, run.device,
             run.world.size, f" | {run.strategy}" if run.world.active else "", run.settings.precision.value,
             class_name(unwrap(run.model)), f"{params:,}", sparse, run.task.describe())
    return layouts


def _flat_hparams(run: Run) -> dict:
    """Scalar settings of the model section and a few run settings, for TensorBoard's hparams view."""
    model = run.config["model"]
    out = {f"model.{k}": v for k, v in model.items() if isinstance(v, (int, float, str, bool)) and k != "_target_"}
    out.update({"model": model["_target_"].rsplit(".", 1)[-1], "lr": run.config["optim"]["lr"],
                "precision": run.settings.precision.value, **run.task.hparams()})
    return out


def _finished(step: int, max_steps: int) -> bool:
    if step < max_steps:
        return False
    log.info("run already finished: step %d of trainer.max_steps=%d; raise trainer.max_steps to train on",
             step, max_steps)
    return True


def _compilations() -> int:
    """Frames torch.compile has compiled in this process so far (0 where torch keeps no such count)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["frames"]["total"])
    except Exception:                       # a private counter: its absence only costs the detection
        return 0


def _begin_step(run: Run, window: Window, first: bool) -> tuple:
    """Starts timing a step; at a compiled run's first step, says that compilation starts."""
    compiled = run.stepper.mode.compiled
    if first and compiled:
        log.info("compiling the model with torch.compile (trainer.compile=true): the first step takes minutes on a "
                 "CPU ...")
    window.meter.begin_step()
    return first, _compilations() if compiled else 0, time.perf_counter()


def _end_step(run: Run, window: Window, began: tuple) -> None:
    """Counts the step's units in the throughput, or leaves it out as warm-up: the run's first step
    (compilation, graph capture, kernels loading), the first capture of each graph, a step that
    compiled. A graph captured again (a sparsity update that took new layout tables) counts, as
    the cost of that update."""
    first, compilations, t0 = began
    compiled = run.stepper.mode.compiled
    warm_up = run.stepper.pop_warm_up() or first or (compiled and _compilations() != compilations)
    if warm_up and run.device.type == "cuda":
        torch.cuda.synchronize(run.device)          # its queued device work inside the left-out time too
    if first and compiled:
        log.info("compiled: the first step took %.0f s (not counted in %s/s)", time.perf_counter() - t0,
                 run.task.unit)
    window.meter.end_step(run.task.units_per_batch() * run.world.size, warm_up=warm_up)


def _open_outputs(run: Run) -> tuple[Board, Progress]:
    """TensorBoard (the config, the command line and the layouts, once at start) and the progress bar."""
    board = Board(run.run_dir, run.world.rank)
    board.start(OmegaConf.to_yaml(run.config), " ".join(sys.argv), _header(run))
    return board, Progress(run.settings.max_steps, run.state.step, run.settings.progress, run.world.rank)


def _due(every: int, step: int, stop_at: int) -> bool:
    """Whether ``step`` logs (evaluates, checkpoints): every ``every`` steps (0: never) and at the last."""
    return bool(every) and step % every == 0 or step == stop_at


def fit(run: Run) -> dict:
    """Trains from run.step to trainer.max_steps (or the time limit, or a signal). Each step, as in
    nanoGPT's loop: a batch, the step at the schedule's learning rate, the sparsity policy's
    layout update, then logging, evaluation and a checkpoint when due."""
    settings, state = run.settings, run.state
    if _finished(state.step, settings.max_steps):
        return _result(run)
    board, progress = _open_outputs(run)
    window, t_start, stop_at, start_step = Window(), time.perf_counter(), settings.max_steps, state.step
    try:
        with stop_on_signals(state, run.run_dir, run.world, run.config):
            while state.step < stop_at:
                began = _begin_step(run, window, first=state.step == start_step)
                x, y, fresh = next_batch(run)
                window.add(*one_step(run, x, y, fresh))
                state.step += 1
                if run.sparsity is not None:
                    sparsity.after_step(run.sparsity, state.step, run.stepper, board)
                _end_step(run, window, began)
                progress.tick()
                log_step = _due(settings.log_every, state.step, stop_at)
                limit = settings.time_limit_s
                reason = _agree_to_stop(state.stop, run.world, log_step,
                                        bool(limit) and time.perf_counter() - t_start > limit)
                if reason is not None:
                    stop_at = state.step                        # finish as a last step: log, eval, checkpoint
                if log_step or reason:
                    log_window(run, window, progress, board)
                with window.pause():                            # not counted in the throughput
                    if _due(settings.eval_every, state.step, stop_at):
                        validate(run, progress, board, time.perf_counter() - t_start)
                    if _due(settings.ckpt_every, state.step, stop_at):
                        path = save(run)
                if reason not in (None, "time"):
                    raise RunInterrupted(f"stopped by {reason} at step {state.step}; checkpoint {path}; "
                                         f"{resume_hint(run.run_dir, run.config)}")
    except BaseException:
        board.close()                                   # no writer thread left behind
        raise
    finally:
        progress.close()
    return _finish(run, board)


def _finish(run: Run, board: Board) -> dict:
    """The run's hparams and final metric to TensorBoard, the last log line; returns the result."""
    state = run.state
    board.finish(_flat_hparams(run), {f"hparam/valid_{run.task.metric}": state.valid.get(run.task.metric, math.nan)},
                 state.step)
    result = _result(run)
    log.info("done: %d steps, train loss %.4f (avg%d), %s %s", state.step, result["train_loss"],
             state.train_loss_steps, valid_label(run.ema),
             ", ".join(f"{k} {v:.4f}" for k, v in state.valid.items() if isinstance(v, float)))
    return result


def _result(run: Run) -> dict:
    """The run's numbers; ``train_loss`` is the mean of the last logged window (``train_loss_steps`` steps)."""
    state = run.state
    out = {"steps": state.step, "train_loss": state.train_loss, "train_loss_steps": state.train_loss_steps,
           "run_dir": str(run.run_dir), "history": state.history, "valid_history": state.valid_history,
           "valid": dict(state.valid),
           "params": sum(p.numel() for p in run.model.parameters()), "data": run.task.describe(),
           "step_mode": run.step_mode, "throughput": list(state.throughput), "unit": run.task.unit}
    out.update({f"valid_{k}": v for k, v in state.valid.items()})
    out.setdefault("valid_loss", math.nan)
    out.setdefault(f"valid_{run.task.metric}", math.nan)
    return out


def train(cfg: DictConfig) -> dict:
    """Trains the configured model; returns final metrics and the run directory.

    Under torchrun each process trains on its slice of every batch with DDP; rank 0 writes.
    """
    settings = check_config(cfg)
    device = resolve_device(cfg.trainer.device)
    set_threads(cfg.trainer.threads)
    world = init_world(device)
    handlers = []
    try:
        run_dir = Path(broadcast(str(_run_dir(cfg)), world))        # one run dir for every rank
        created = missing_dirs(run_dir) if world.main else []
        if world.main:
            run_dir.mkdir(parents=True, exist_ok=True)
        barrier(world)
        handlers = setup_logging(run_dir if world.main else None, world.rank)
        try:
            run = build(cfg, run_dir, device_for(world, device), world, settings)
        except BaseException as exc:                    # a start that fails leaves no run dir of its own behind ...
            remove_logging(handlers)
            handlers = []
            if not isinstance(exc, UserCodeError):      # ... but the one whose train.log holds the traceback
                remove_failed_start(run_dir, created)
            raise
        result = fit(run)
        if world.active:
            # Release the DDP model (it holds the process group) while the interpreter is whole, and
            # let every rank arrive before any tears the group down: a gloo group destroyed under a
            # peer that is still exiting can abort that peer.
            del run
            gc.collect()
            barrier(world)
        return result
    finally:
        remove_logging(handlers)
        finish(world)
