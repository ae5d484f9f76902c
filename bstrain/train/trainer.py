"""The training loop: ``train(cfg) -> dict``, called by ``python -m bstrain train`` and by tests.

It knows no model family and no metric by name. The model, data and task are built from the
config by their ``_target_``; the task (bstrain/train/tasks) owns batches, loss, metrics and
evaluation; a model is stateless (``forward(x)``) or stateful (``init_state`` and
``forward(x, state)``), see bstrain/train/step.py. One step function
(:func:`bstrain.train.step.train_step`) serves the eager loop, the CUDA-graph replay and the
benchmarks, and one object built once (:class:`bstrain.train.stepper.Stepper`) decides how each
step runs (a graph, a graph armed for a sparsity update, or eager); one pair of functions
(:func:`bstrain.train.checkpoint.capture` / ``restore``) writes and reads checkpoints.

Precision: fp32 master weights always. fp16 runs the forward under autocast with dynamic loss
scaling (torch.amp.GradScaler: starts at 2**16, halves and skips the step on inf/NaN, doubles
after ``trainer.loss_scale_window`` clean steps), so no NaN ever reaches the weights; bf16 runs
under autocast without scaling.

Host syncs: the loop keeps losses and gradient norms on the device and reads them once per
``trainer.log_every`` steps (fp16's GradScaler still checks for inf at every step).
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.errors import RunAborted, RunInterrupted, UserError
from bstrain.nn import block_sparse_layouts, set_grad_group
from bstrain.train import checkpoint as ckpt_io
from bstrain.train import checks, sparsity
from bstrain.train.checkpoint import (checkpoint_path, latest_checkpoint, load_checkpoint, prune_checkpoints,
                                      save_checkpoint)
from bstrain.train.distributed import (World, barrier, broadcast, check_same_layouts, device_for, finish, gather,
                                       init_world)
from bstrain.train.graphs import GraphedForward
from bstrain.train.progress import Board, Progress, Throughput, log, remove_logging, setup_logging
from bstrain.train.rundir import missing_dirs, remove_failed_start
from bstrain.train.schedule import LRSchedule, set_lr
from bstrain.train.step import Forward, is_stateful, unwrap
from bstrain.train.stepper import GraphMode, Stepper, graphs_wanted

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _value(x):
    """An Enum config value as its string."""
    return getattr(x, "value", x)


# --- set-up helpers -------------------------------------------------------------------------------
def resolve_device(name, key: str = "trainer.device") -> torch.device:
    name = _value(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key}: 'cuda' was asked for, but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"{key}: expected auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def set_threads(n: int) -> int:
    """torch's CPU threads: ``n``; for 0, OMP_NUM_THREADS when set (torchrun sets 1 per process),
    else half the cores this process may use (at least 1).

    Half, because a second busy process on the machine then slows a run by about its share
    instead of stalling OpenMP's spinning threads (measured: benchmarks/README.md).
    """
    if n <= 0 and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return torch.get_num_threads()
    if n <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, cores // 2)
    torch.set_num_threads(n)
    return n


def _optimizer_flags(device: torch.device, capturable: bool) -> dict:
    """Fused AdamW on CUDA, foreach elsewhere; capturable for CUDA-graph capture."""
    fused = device.type == "cuda"
    return {"fused": True if fused else None, "foreach": None if fused else True, "capturable": capturable}


def _lr(value, capturable: bool, device: torch.device):
    """Graph capture reads the learning rate from a device tensor the schedule fills; else a float."""
    return torch.tensor(float(value), device=device) if capturable else float(value)


def make_optimizer(model: torch.nn.Module, cfg, device: torch.device,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and blocks only; fused kernels on CUDA, foreach elsewhere.

    capturable: for CUDA-graph capture (learning rates become device tensors the schedule fills).
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": ps, "weight_decay": wd, "lr": _lr(cfg.lr, capturable, device)}
              for ps, wd in ((decay, cfg.weight_decay), (rest, 0.0)) if ps]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **_optimizer_flags(device, capturable))


def _match_graph_mode(optimizer: torch.optim.Optimizer, capturable: bool, device: torch.device) -> None:
    """After loading a state dict, which brings the saving run's group settings (another device,
    with or without CUDA graphs): this run's optimizer flags and learning-rate kind (a checkpoint's
    tensor lr comes back on the CPU, where a graph would not see the schedule), and step counters
    where AdamW wants them.
    """
    flags = _optimizer_flags(device, capturable)
    for g in optimizer.param_groups:
        g.update(flags)
        g["lr"] = _lr(g["lr"], capturable, device)
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if isinstance(st.get("step"), torch.Tensor):
                on_device = capturable or flags["fused"]
                st["step"] = st["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)


def check_config(cfg) -> None:
    """UserError naming the key for an undeclared key, a missing value or a value out of range."""
    from bstrain.configs.schema import check_config as check_schema, check_ranges
    check_schema(cfg)
    check_ranges(cfg)                                   # the ranges declared beside the schema's fields
    if _value(cfg.trainer.precision) not in PRECISIONS:
        raise UserError(f"trainer.precision: expected fp32, fp16 or bf16, got {cfg.trainer.precision!r}")
    GraphMode.parse(cfg.trainer.cuda_graph)
    if _value(cfg.optim.schedule) not in ("cosine", "linear", "constant"):
        raise UserError(f"optim.schedule: expected cosine, linear or constant, got {cfg.optim.schedule!r}")


def instantiate(node, key: str):
    """Builds the ``key`` section from its ``_target_``; the user's mistakes (an unknown class, a
    wrong or missing argument, a value the constructor rejects) become one-line UserErrors."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate
    if not OmegaConf.is_dict(node) or "_target_" not in node:
        raise UserError(f"{key}: expected a mapping with a _target_ (a class path such as my_package.MyModel), "
                        f"got {OmegaConf.to_container(node) if OmegaConf.is_config(node) else node!r}")
    try:
        return hydra_instantiate(node, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if cause is None or isinstance(cause, (ValueError, ImportError)) or (
                isinstance(cause, TypeError) and "argument" in str(cause)):
            msg = " ".join(str(cause or exc).split())
            raise UserError(f"{key} ({node._target_}): {msg}") from None
        raise


def _run_dir(cfg) -> Path:
    if cfg.trainer.run_dir:
        return Path(cfg.trainer.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # called outside a Hydra app
        return Path("runs") / time.strftime("%Y-%m-%d/%H-%M-%S")


def _resume_path(cfg, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None; UserError where the request and the run dir disagree."""
    value = str(cfg.trainer.resume).strip()
    latest = latest_checkpoint(run_dir / "ckpt")
    if value.lower() in ("false", "none", "", "0"):
        if latest is not None:
            raise UserError(f"run dir {run_dir} already holds checkpoints (latest {latest.name}): continue that run "
                            f"with trainer.resume=true, or start this one in another directory")
        return None
    if value.lower() in ("true", "1"):
        if latest is None:
            raise UserError(f"trainer.resume=true: no checkpoint in {run_dir / 'ckpt'}; name the run's directory "
                            f"with hydra.run.dir=... (or give trainer.resume=PATH)")
        return latest
    path = Path(value)
    if path.is_dir():                                    # a run dir or its ckpt/: its latest checkpoint
        path = latest_checkpoint(path) or latest_checkpoint(path / "ckpt") or path
    if latest is None or not path.is_file():
        return path                                      # (load_checkpoint names a missing file)
    if path.resolve().parent != (run_dir / "ckpt").resolve():
        raise UserError(f"trainer.resume={value}: run dir {run_dir} holds checkpoints of another run; resume into "
                        f"a new directory")
    if latest.resolve() != path.resolve():
        raise UserError(f"trainer.resume={value}: run dir {run_dir} holds a later checkpoint ({latest.name}); "
                        f"continuing an earlier one here would mix two runs: resume into a new directory")
    return path


# --- the run -------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything one training run holds; built by :func:`build`."""
    cfg: DictConfig
    world: World
    device: torch.device
    run_dir: Path
    task: Any
    model: torch.nn.Module
    net: torch.nn.Module                  # the model, or DDP around it
    forward: Forward
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: LRSchedule
    ema: Any = None
    params: list = field(default_factory=list)    # the model's parameters, listed once for clipping
    stepper: Stepper | None = None        # how a step runs: graphed, armed for a sparsity update, eager
    eval_forwards: dict = field(default_factory=dict)   # graphed evaluation forwards, per model
    throughput: list = field(default_factory=list)      # units/s of each logged window
    step: int = 0
    state: Any = None                     # carried model state (stateful models)
    pending_state: Any = None             # a checkpoint's states, placed at the first batch
    train_loss: float = float("nan")      # the mean loss of the last logged window ...
    train_loss_steps: int = 0             # ... of this many steps
    valid: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    valid_history: list = field(default_factory=list)
    stop: str | None = None               # the signal that asked the run to stop
    skipped: Any = 0                      # fp16 steps skipped since the last log (a device tensor)
    sparsity: Any = None                  # the dynamic-sparsity policy (bstrain.sparsity), None if static
    first_batch: tuple | None = None      # the batch the start's check ran on: the first step trains on it

    @property
    def step_mode(self) -> str:
        """How steps run: "graph" or "eager", with " (compiled)" when compiled."""
        return str(self.stepper.mode)


def build(cfg: DictConfig, run_dir: Path, device: torch.device, world: World) -> Run:
    """Data and task first (a bad path fails before any model is built), then model, optimizer,
    scaler, EMA; then the checkpoint to resume from, if any."""
    t_cfg = cfg.trainer
    resume = _resume_path(cfg, run_dir)
    task = instantiate(cfg.task, "task")
    task.setup(instantiate(cfg.data, "data"), world, t_cfg.seed)
    checks.check_model_config(task, cfg.model)
    torch.manual_seed(t_cfg.seed)
    model = instantiate(cfg.model, "model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model ({cfg.model._target_}): expected an nn.Module, got {type(model).__name__}")
    model = model.to(device)
    set_grad_group(model, t_cfg.group_size)
    graph_mode = GraphMode.parse(t_cfg.cuda_graph)
    graphed = graphs_wanted(graph_mode, device)
    net = model
    if world.active:
        from torch.nn.parallel import DistributedDataParallel
        check_same_layouts(model, world)
        side = torch.cuda.Stream(device) if graphed else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # a graph that captures DDP's all-reduce needs DDP built on a side stream (torch.cuda.graphs docs)
            net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
    uncompiled = net
    if compiled := bool(t_cfg.get("compile", False)):
        net = torch.compile(net)        # the model (and DDP around it); checkpoints keep using `model`
    amp_dtype = PRECISIONS[_value(t_cfg.precision)]
    optimizer = make_optimizer(model, cfg.optim, device, capturable=graphed)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16, growth_interval=t_cfg.loss_scale_window,
                                  enabled=_value(t_cfg.precision) == "fp16")
    if scaler.is_enabled():
        scaler._lazy_init_scale_growth_tracker(device)     # now: so that a skip at the first step is counted too
    ema = None
    if cfg.optim.ema > 0:
        from torch.optim.swa_utils import AveragedModel
        ema = AveragedModel(model, device=device)       # n_averaged on the device, where graphs count it
    forward = Forward(net, amp_dtype, device)
    run = Run(cfg, world, device, run_dir, task, model, net, forward, optimizer, scaler,
              LRSchedule(cfg.optim, t_cfg.max_steps), ema, params=list(model.parameters()))
    run.sparsity = sparsity.make_policy(cfg, model, optimizer, ema, t_cfg.max_steps)
    forward_hooked = None
    if run.sparsity is not None and compiled:
        sparsity.allow_recompiles(run.sparsity)
        # a compiled model ignores hooks added after it was compiled: RigL's step runs uncompiled
        forward_hooked = Forward(uncompiled, amp_dtype, device)
    run.stepper = Stepper(forward, task, optimizer, run.params, cfg.optim.grad_clip, scaler, ema, cfg.optim.ema, model,
                          world, graph_mode, graphed, compiled=compiled, policy=run.sparsity,
                          forward_hooked=forward_hooked)
    if resume is not None:
        ckpt_io.restore(run, load_checkpoint(resume))
        _match_graph_mode(optimizer, graphed, device)
        log.info("resumed from %s at step %d", resume, run.step)
        if run.sparsity is not None:
            run.sparsity.load_state_dict({"steps": run.step})
    if run.step < t_cfg.max_steps:                  # the model against the data, before the run dir fills
        run.first_batch = task.next_batch(device)
        checks.check_first_batch(model, task, run.first_batch, amp_dtype, device, cfg)
    return run


def next_batch(run: Run) -> tuple:
    """(inputs, targets, fresh): the batch the start checked, then the task's next ones."""
    batch, run.first_batch = run.first_batch, None
    return batch if batch is not None else run.task.next_batch(run.device)


def _place_state(run: Run, x: torch.Tensor) -> None:
    """A checkpoint's carried states, split for this world; a different global batch starts fresh."""
    states, run.pending_state = run.pending_state, None
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
    run.state = _like(template, iter(mine))
    run.stepper.load_state(run.state, x)


def _like(template, tensors):
    """``template``'s structure (a tensor or nested tuples) filled from an iterator of tensors."""
    if isinstance(template, torch.Tensor):
        return next(tensors).to(template.dtype)
    return type(template)(_like(t, tensors) for t in template)


def one_step(run: Run, x: torch.Tensor, y: torch.Tensor, fresh: bool):
    """One optimizer step at this step's learning rate (:class:`bstrain.train.stepper.Stepper`);
    returns (loss, grad norm, the task's batch metrics), all on the device."""
    set_lr(run.optimizer, run.schedule.lr(run.step))
    if run.pending_state is not None:
        _place_state(run, x)
    if fresh:
        run.state = None                                # the data stream restarts: so does the state
    loss, grad_norm, metrics, run.state, skipped = run.stepper.step(x, y, run.state, sparsity.wants_eager(run))
    if skipped is not None:                             # fp16: the steps skipped since the last log
        run.skipped = run.skipped + skipped
    return loss, grad_norm, metrics


# --- logging, validation, checkpoints ----------------------------------------------------------------
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
    from bstrain.train.distributed import all_mean
    n = len(window.losses)
    if n == 0:
        return
    rows, names = window.stacked()
    losses, *rest = all_mean(rows, run.world).tolist()                   # one read: losses and task metrics
    task_metrics = {k: sum(v) / n for k, v in zip(names, rest)}
    norms = torch.stack(window.norms).float().tolist()
    skipped = int(run.skipped) if isinstance(run.skipped, torch.Tensor) else run.skipped
    run.skipped = 0
    first = run.step - n + 1
    run.history.extend(zip(range(first, run.step + 1), losses))
    finite = [g for g in norms if math.isfinite(g)]
    mean_loss = sum(losses) / n
    run.train_loss, run.train_loss_steps = mean_loss, n
    unit = run.task.unit
    metrics = {"loss": mean_loss, **run.task.train_metrics(mean_loss), **task_metrics,
               "lr": run.schedule.lr(run.step - 1),
               "grad_norm": sum(finite) / len(finite) if finite else float("nan")}
    rate = window.meter.rate()                      # after the read above: the device's work is done
    if math.isfinite(rate):                         # (NaN: only warm-up steps in this window)
        metrics[f"{unit}_per_s"] = rate
        run.throughput.append(rate)
    if run.scaler.is_enabled():
        metrics["loss_scale"] = run.scaler.get_scale()
        _check_same_scale(run, metrics["loss_scale"])
        if skipped:
            log.info("step %d: %d of the last %d steps skipped (fp16 overflow: inf/NaN gradients); loss scale now "
                     "%g", run.step, skipped, n, metrics["loss_scale"])
    if run.device.type == "cuda":
        metrics["gpu_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    progress.show(run.step, metrics, run.task.metric, unit, steps=n)
    board.scalars(run.step, {f"train/{k}": v for k, v in metrics.items()})
    window.reset()


def _check_same_scale(run: Run, scale: float) -> None:
    """Under DDP every rank sees the all-reduced gradients, so all skip together and keep one scale."""
    scales = gather(scale, run.world)
    if len(set(scales)) > 1:
        raise RuntimeError(f"fp16 loss scales differ across ranks at step {run.step}: {scales}")


def on_main(run: Run, fn):
    """fn() on rank 0. Under DDP its exception is raised on every rank, which would otherwise wait
    in the next collective until the process group times out."""
    result, error = None, None
    if run.world.main:
        try:
            result = fn()
        except Exception as exc:            # re-raised below, after the other ranks hear of it
            error = exc
    if run.world.active:
        failed = broadcast(None if error is None else f"{type(error).__name__}: {error}", run.world)
        if failed and error is None:
            raise RuntimeError(f"rank 0 failed: {failed}")
    if error is not None:
        raise error
    return result


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
        board.scalars(run.step, {f"valid/{k}": v for k, v in valid.items()})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in valid.items() if isinstance(v, float))
        log.info("step %d: %s %s", run.step, valid_label(run), shown)
        run.valid_history.append((run.step, elapsed, valid.get(run.task.metric, valid["loss"])))
        return valid
    run.valid = broadcast(on_main(run, evaluate), run.world)


def valid_label(run: Run) -> str:
    """'valid', or 'valid (EMA weights)' when evaluation reads the EMA of the weights."""
    return "valid (EMA weights)" if run.ema is not None else "valid"


def save(run: Run) -> Path | None:
    """A checkpoint of this step (collective under DDP; rank 0 writes); returns its path."""
    state = ckpt_io.capture(run)
    path = checkpoint_path(run.run_dir / "ckpt", run.step)

    def write():
        save_checkpoint(path, state)
        prune_checkpoints(run.run_dir / "ckpt", run.cfg.trainer.keep_ckpts)
    on_main(run, write)
    return path


@contextlib.contextmanager
def stop_on_signals(run: Run):
    """SIGINT/SIGTERM ask the loop to stop after the current step (it then checkpoints); a second
    one stops the run where it is (:class:`RunAborted`: one line, no new checkpoint, the last
    complete one intact), and a third acts as usual. Only in the main thread, where Python
    delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def ask(signum, _frame):
        name = signal.Signals(signum).name
        if run.stop is None:
            run.stop = name
            return
        for s, h in old.items():
            signal.signal(s, h)
        last = latest_checkpoint(run.run_dir / "ckpt") if run.world.main else None
        raise RunAborted(f"stopped by a second {name} at step {run.step}, without a new checkpoint; "
                         + (f"the last one is {last}; {resume_hint(run.run_dir)}" if last else "none was written"))
    for s in old:
        signal.signal(s, ask)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resume_hint(run_dir: Path) -> str:
    """How to continue a run: the run dir is all it takes (resuming reads the checkpoint's config)."""
    import shlex
    return f"continue with python -m bstrain train trainer.resume=true {shlex.quote(f'hydra.run.dir={run_dir}')}"


def _agree_to_stop(run: Run, log_step: bool, out_of_time: bool) -> str | None:
    """Why to stop after this step: a signal's name, "time", or None. One process decides at every
    step; under DDP the ranks agree at log steps (a collective), so all stop at the same step."""
    reason = run.stop or ("time" if out_of_time else None)
    if run.world.active:
        if not log_step:
            return None
        reasons = [r for r in gather(reason, run.world) if r]
        reason = next((r for r in reasons if r != "time"), reasons[0] if reasons else None)
    return reason


# --- the loop --------------------------------------------------------------------------------------------
def _header(run: Run) -> dict:
    """Logs what is being trained; returns the model's block-sparse layouts (for TensorBoard)."""
    own = getattr(run.model, "block_sparse_layouts", None)
    layouts = dict(own()) if callable(own) else dict(block_sparse_layouts(run.model))
    params = sum(p.numel() for p in run.model.parameters())
    sparse = ", ".join(f"{name} {lay.shape[0]}x{lay.shape[1]} blocks at density {lay.mean():.3f}"
                       for name, lay in layouts.items()) or "no block-sparse layers"
    log.info("run dir %s | device %s x %d | precision %s | %s | %s parameters (%s) | %s", run.run_dir, run.device,
             run.world.size, _value(run.cfg.trainer.precision), type(run.model).__name__, f"{params:,}", sparse,
             run.task.describe())
    return layouts


def _flat_hparams(run: Run) -> dict:
    """Scalar settings of the model section and a few run settings, for TensorBoard's hparams view."""
    model = OmegaConf.to_container(run.cfg.model, resolve=True, enum_to_str=True)
    out = {f"model.{k}": v for k, v in model.items() if isinstance(v, (int, float, str, bool)) and k != "_target_"}
    out.update({"model": model["_target_"].rsplit(".", 1)[-1], "lr": run.cfg.optim.lr,
                "precision": _value(run.cfg.trainer.precision), **run.task.hparams()})
    return out


def _finished(run: Run) -> bool:
    if run.step < run.cfg.trainer.max_steps:
        return False
    log.info("run already finished: step %d of trainer.max_steps=%d; raise trainer.max_steps to train on",
             run.step, run.cfg.trainer.max_steps)
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


def fit(run: Run) -> dict:
    """Trains from run.step to trainer.max_steps (or the time limit, or a signal)."""
    t_cfg = run.cfg.trainer
    if _finished(run):
        return _result(run)
    board = Board(run.run_dir, run.world.rank)
    board.start(OmegaConf.to_yaml(run.cfg), " ".join(sys.argv), _header(run))
    progress = Progress(t_cfg.max_steps, run.step, t_cfg.progress, run.world.rank)
    window, t_start, stop_at, start_step = Window(), time.perf_counter(), t_cfg.max_steps, run.step
    try:
        with stop_on_signals(run):
            while run.step < stop_at:
                began = _begin_step(run, window, first=run.step == start_step)
                window.add(*one_step(run, *next_batch(run)))
                run.step += 1
                if run.sparsity is not None:
                    sparsity.after_step(run, board)
                _end_step(run, window, began)
                progress.tick()
                log_step = run.step % t_cfg.log_every == 0 or run.step == stop_at
                out_of_time = bool(t_cfg.time_limit_s) and time.perf_counter() - t_start > t_cfg.time_limit_s
                reason = _agree_to_stop(run, log_step, out_of_time)
                if reason is not None:
                    stop_at = run.step                          # finish as a last step: log, eval, checkpoint
                if log_step or reason:
                    log_window(run, window, progress, board)
                with window.pause():
                    if (t_cfg.eval_every and run.step % t_cfg.eval_every == 0) or run.step == stop_at:
                        validate(run, progress, board, time.perf_counter() - t_start)
                    if (t_cfg.ckpt_every and run.step % t_cfg.ckpt_every == 0) or run.step == stop_at:
                        path = save(run)
                if reason not in (None, "time"):
                    raise RunInterrupted(f"stopped by {reason} at step {run.step}; checkpoint {path}; "
                                         f"{resume_hint(run.run_dir)}")
    except BaseException:
        board.close()                                   # no writer thread left behind
        raise
    finally:
        progress.close()
    board.finish(_flat_hparams(run), {f"hparam/valid_{run.task.metric}": run.valid.get(run.task.metric, math.nan)},
                 run.step)
    result = _result(run)
    log.info("done: %d steps, train loss %.4f (avg%d), %s %s", run.step, result["train_loss"], run.train_loss_steps,
             valid_label(run), ", ".join(f"{k} {v:.4f}" for k, v in run.valid.items() if isinstance(v, float)))
    return result


def _result(run: Run) -> dict:
    """The run's numbers; ``train_loss`` is the mean of the last logged window (``train_loss_steps`` steps)."""
    out = {"steps": run.step, "train_loss": run.train_loss, "train_loss_steps": run.train_loss_steps,
           "run_dir": str(run.run_dir), "history": run.history, "valid_history": run.valid_history,
           "valid": dict(run.valid),
           "params": sum(p.numel() for p in run.model.parameters()), "data": run.task.describe(),
           "step_mode": run.step_mode, "throughput": list(run.throughput), "unit": run.task.unit}
    out.update({f"valid_{k}": v for k, v in run.valid.items()})
    out.setdefault("valid_loss", math.nan)
    out.setdefault(f"valid_{run.task.metric}", math.nan)
    return out


def train(cfg: DictConfig) -> dict:
    """Trains the configured model; returns final metrics and the run directory.

    Under torchrun each process trains on its slice of every batch with DDP; rank 0 writes.
    """
    check_config(cfg)
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
            run = build(cfg, run_dir, device_for(world, device), world)
        except BaseException:                           # a start that fails leaves no run dir of its own behind
            remove_logging(handlers)
            handlers = []
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
