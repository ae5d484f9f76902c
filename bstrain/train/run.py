"""A training run: its config checked once (:func:`check_config`), its parts built from the
config (:func:`build`: data and task, model (sparsified by the ``sparsify`` section), optimizer,
scaler, EMA, the sparsity policy and the :class:`bstrain.train.stepper.Stepper`, then the
checkpoint it resumes from), and what it holds (:class:`Run`). The loop that trains it is
:func:`bstrain.train.trainer.fit`.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.errors import UserError
from bstrain.nn import set_grad_group
from bstrain.train import checkpoint as ckpt_io
from bstrain.train import checks, fsdp, sharded, sparsity
from bstrain.train.checkpoint import latest_checkpoint, load_checkpoint
from bstrain.train.distributed import World, check_same_layouts
from bstrain.train.model import build_model, instantiate
from bstrain.train.optim import _match_graph_mode, make_optimizer
from bstrain.train.progress import log
from bstrain.train.schedule import LRSchedule
from bstrain.train.step import Forward
from bstrain.train.stepper import GraphMode, StepParts, Stepper, eager_reason

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _value(x):
    """An Enum config value as its string."""
    return getattr(x, "value", x)


# --- the config -------------------------------------------------------------------------------
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
    else half the cores this process may use (at least 1), shared by the processes on this machine
    (``trainer.nproc``: the launcher sets no OMP_NUM_THREADS).

    Half, because a second busy process on the machine then slows a run by about its share
    instead of stalling OpenMP's spinning threads (measured: benchmarks/README.md).
    """
    if n <= 0 and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return torch.get_num_threads()
    if n <= 0:                              # (several processes on one machine share its cores)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, cores // (2 * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    torch.set_num_threads(n)
    return n


@dataclass(frozen=True)
class Settings:
    """What :func:`check_config` parsed from the config, once, for :func:`build`."""
    amp_dtype: torch.dtype | None         # trainer.precision: the autocast dtype, None for fp32
    graph_mode: GraphMode                 # trainer.cuda_graph


def check_config(cfg) -> Settings:
    """UserError naming the key for an undeclared key, a missing value or a value out of range;
    returns the settings parsed on the way."""
    from bstrain.configs.schema import check_config as check_schema, check_ranges
    check_schema(cfg)
    check_ranges(cfg)                                   # the ranges declared beside the schema's fields
    if _value(cfg.trainer.precision) not in PRECISIONS:
        raise UserError(f"trainer.precision: expected fp32, fp16 or bf16, got {cfg.trainer.precision!r}")
    graph_mode = GraphMode.parse(cfg.trainer.cuda_graph)
    if _value(cfg.optim.schedule) not in ("cosine", "linear", "constant"):
        raise UserError(f"optim.schedule: expected cosine, linear or constant, got {cfg.optim.schedule!r}")
    return Settings(PRECISIONS[_value(cfg.trainer.precision)], graph_mode)



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
    if path.is_dir() and not sharded.is_sharded_checkpoint(path):   # a run dir or its ckpt/: its latest checkpoint
        path = latest_checkpoint(path) or latest_checkpoint(path / "ckpt") or path
    if latest is None or not (path.is_file() or sharded.is_sharded_checkpoint(path)):
        return path                                      # (load_checkpoint names a missing file)
    if path.resolve().parent != (run_dir / "ckpt").resolve():
        raise UserError(f"trainer.resume={value}: run dir {run_dir} holds checkpoints of another run; resume into "
                        f"a new directory")
    if latest.resolve() != path.resolve():
        raise UserError(f"trainer.resume={value}: run dir {run_dir} holds a later checkpoint ({latest.name}); "
                        f"continuing an earlier one here would mix two runs: resume into a new directory")
    return path


def _fill_vocab_size(cfg: DictConfig, data) -> None:
    """``data.vocab_size`` left null beside a tokenizer file becomes the file's vocabulary, so that a
    model's ``${data.vocab_size}`` reads it (and the checkpoint's config records it)."""
    node = cfg.get("data")
    if OmegaConf.is_dict(node) and node.get("vocab_size", 0) is None and getattr(data, "tokenizer", None) is not None:
        node.vocab_size = data.vocab_size


def _scaler(strategy: str) -> type:
    """fp16's loss scaler: under fsdp each rank checks only its shards of the gradients for inf, so
    the sharded scaler all-reduces the finding (every rank skips the step together)."""
    if strategy == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler
    return torch.amp.GradScaler


def _read_checkpoint(run, path: Path) -> dict:
    """The checkpoint to restore: a sharded one into an fsdp run is loaded in place here, each rank
    reading its own shards (its model and optimizer entries then None); anything else whole."""
    if run.strategy == "fsdp" and sharded.is_sharded_checkpoint(path):
        ckpt_io.check_model_entries(run.model, sharded.model_entries(path), path)    # one line, before DCP's own
        sharded.load_sharded_into(path, run.model, run.optimizer, run.ema)
        ckpt = sharded.read_extra(path)
        ckpt["path"] = str(path)
        return ckpt
    return load_checkpoint(path)


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
    net: torch.nn.Module                  # the model, or DDP around it (fsdp: the sharded model itself)
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
    strategy: str = "single"              # single, ddp or fsdp (bstrain/train/fsdp.py)

    @property
    def step_mode(self) -> str:
        """How steps run: "graph" or "eager", with " (compiled)" when compiled."""
        return str(self.stepper.mode)



def _distributed(model: torch.nn.Module, world: World, device: torch.device, graphed: bool, strategy: str = "ddp",
                 amp_dtype: torch.dtype | None = None, shard_spec=None) -> torch.nn.Module:
    """The model, DDP around it, or the model sharded in place (fsdp), by strategy."""
    if strategy == "fsdp":
        return fsdp.shard(model, world, device, amp_dtype, shard_spec)
    if not world.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    from bstrain.nn._sparse import layout_buffers
    check_same_layouts(model, world)
    # the layouts agree across ranks and change together: DDP's broadcast of rank 0's buffers at every
    # forward would bump their version counters and have each layer read its layout back every step
    layouts = layout_buffers(model)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, sorted(ignored | {name for name, b in model.named_buffers() if id(b) in layouts}))
    side = torch.cuda.Stream(device) if graphed else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        # a graph that captures DDP's all-reduce needs DDP built on a side stream (torch.cuda.graphs docs)
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
    return net


def build(cfg: DictConfig, run_dir: Path, device: torch.device, world: World, settings: Settings | None = None) -> Run:
    """Data and task first (a bad path fails before any model is built), then model, optimizer,
    scaler, EMA, the sparsity policy and the stepper; then the checkpoint to resume from, if any.

    settings: what :func:`check_config` returned for ``cfg`` (None: it is checked here).
    """
    settings = settings or check_config(cfg)
    t_cfg, amp_dtype = cfg.trainer, settings.amp_dtype
    strategy = fsdp.resolve_strategy(t_cfg.get("strategy", "auto"), world)
    resume = _resume_path(cfg, run_dir)
    task = instantiate(cfg.task, "task")
    data = instantiate(cfg.data, "data")
    task.setup(data, world, t_cfg.seed)
    _fill_vocab_size(cfg, data)
    checks.check_model_config(task, cfg.model)
    torch.manual_seed(t_cfg.seed)
    model, shard_spec = build_model(cfg)            # sparsified (cfg.sparsify) before anything wraps or copies it
    model = model.to(device)
    set_grad_group(model, t_cfg.group_size)
    why_eager = eager_reason(settings.graph_mode, device, strategy)
    if strategy == "fsdp" and device.type == "cuda" and why_eager is not None:
        log.info("step: eager (%s)", why_eager)
    graphed = why_eager is None
    ema = None
    if cfg.optim.ema > 0:
        from torch.optim.swa_utils import AveragedModel
        ema = AveragedModel(model, device=device)       # n_averaged on the device, where graphs count it
        if strategy == "fsdp":                          # (FSDP's modules cannot be copied: copy, then shard both)
            fsdp.shard(ema.module, world, device, amp_dtype, shard_spec)
    net = uncompiled = _distributed(model, world, device, graphed, strategy, amp_dtype, shard_spec)
    if compiled := bool(t_cfg.get("compile", False)):
        net = torch.compile(net)        # the model (and DDP around it); checkpoints keep using `model`
    optimizer = make_optimizer(model, cfg.optim, device, capturable=graphed)
    scaler = _scaler(strategy)(device.type, init_scale=2.0**16, growth_interval=t_cfg.loss_scale_window,
                               enabled=amp_dtype == torch.float16)
    if scaler.is_enabled():
        scaler._lazy_init_scale_growth_tracker(device)     # now: so that a skip at the first step is counted too
    forward = Forward(net, amp_dtype, device)
    run = Run(cfg, world, device, run_dir, task, model, net, forward, optimizer, scaler,
              LRSchedule(cfg.optim, t_cfg.max_steps), ema, params=list(model.parameters()), strategy=strategy)
    run.sparsity = sparsity.make_policy(cfg, model, optimizer, ema, t_cfg.max_steps)
    forward_hooked = None
    if run.sparsity is not None and compiled:
        sparsity.allow_recompiles(run.sparsity)
        # a compiled model ignores hooks added after it was compiled: RigL's step runs uncompiled
        forward_hooked = Forward(uncompiled, amp_dtype, device)
    parts = StepParts(forward, task, optimizer, run.params, model, scaler, grad_clip=cfg.optim.grad_clip, ema=ema,
                      ema_decay=cfg.optim.ema, world=world, policy=run.sparsity, forward_hooked=forward_hooked)
    run.stepper = Stepper(parts, settings.graph_mode, why_eager, compiled=compiled)
    if resume is not None:
        ckpt_io.restore(run, _read_checkpoint(run, resume))
        _match_graph_mode(optimizer, graphed, device)
        log.info("resumed from %s at step %d", resume, run.step)
        if run.sparsity is not None:
            run.sparsity.load_state_dict({"steps": run.step})
    if run.step < t_cfg.max_steps:                  # the model against the data, before the run dir fills
        run.first_batch = task.next_batch(device)
        checks.check_first_batch(model, task, run.first_batch, amp_dtype, device, cfg)
        if strategy == "fsdp":
            fsdp.reshard(model)                     # (a forward without backward keeps the root's gathers)
    return run
