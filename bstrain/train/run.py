"""A training run: its config checked and typed once (:func:`check_config`: :class:`Settings`),
its parts built from it once (:func:`build`: data and task, model (sparsified by the
``sparsify`` section), the distributed strategy,
optimizer, scaler, EMA, the sparsity policy and the :class:`bstrain.train.stepper.Stepper`, then
the checkpoint it resumes from), and what it holds (:class:`Run`, frozen; what changes as it
trains is its :class:`bstrain.train.state.TrainState`). The loop is :func:`bstrain.train.trainer.fit`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.configs.schema import Policy, Precision, Schedule, Strategy
from bstrain.errors import UserError
from bstrain.nn import set_grad_group
from bstrain.train import checks, sharded, sparsity
from bstrain.train.checkpoint import latest_checkpoint
from bstrain.train.distributed import World, on_main
from bstrain.train.model import build_model, instantiate
from bstrain.train.optim import _match_graph_mode, make_optimizer
from bstrain.train.progress import log
from bstrain.train.schedule import Curve, LRSchedule
from bstrain.train.state import TrainState, restore
from bstrain.train.step import Forward
from bstrain.train.stepper import GraphMode, StepParts, Stepper, eager_reason
from bstrain.train.strategy import Single, make_strategy


def __getattr__(name: str):
    if name == "PRECISIONS":                        # (moved: the schema's Enum is the one list)
        import warnings
        warnings.warn("bstrain.train.run.PRECISIONS is deprecated: use bstrain.configs.schema.Precision(name).dtype",
                      DeprecationWarning, stacklevel=2)
        return {p.value: p.dtype for p in Precision}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def choice(enum: type[Enum], value, key: str):
    """``value`` (a name, or the Enum's member) as a member of ``enum``; UserError naming ``key``."""
    try:
        return enum(value)
    except ValueError:
        raise UserError(f"{key}: expected one of {', '.join(m.value for m in enum)}, got {value!r}") from None


# --- the config -------------------------------------------------------------------------------
def resolve_device(name, key: str = "trainer.device") -> torch.device:
    from bstrain.configs.schema import Device
    name = choice(Device, name, key).value
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key}: 'cuda' was asked for, but no CUDA device is available")
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
    """The trainer's config, checked and typed once by :func:`check_config`: every choice as the
    schema's Enum, and the loop's numbers."""
    precision: Precision                  # trainer.precision
    strategy: Strategy                    # trainer.strategy as asked for (auto resolved in the world)
    graph_mode: GraphMode                 # trainer.cuda_graph
    schedule: Schedule                    # optim.schedule
    policy: Policy                        # sparsity.policy (static without a sparsity section)
    max_steps: int = 0
    log_every: int = 0
    eval_every: int = 0
    eval_batches: int = 0
    ckpt_every: int = 0
    keep_ckpts: int = 0
    time_limit_s: float = 0.0
    loss_scale_window: int = 2000
    progress: bool = False

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for fp32."""
        return self.precision.dtype


def check_config(cfg) -> Settings:
    """UserError naming the key for an undeclared key, a missing value or a value out of range;
    returns the config's settings, typed."""
    from bstrain.configs.schema import check_config as check_schema, check_ranges
    check_schema(cfg)
    check_ranges(cfg)                                   # the ranges declared beside the schema's fields
    t = cfg.trainer
    return Settings(choice(Precision, t.precision, "trainer.precision"),
                    choice(Strategy, t.get("strategy", "auto"), "trainer.strategy"),
                    GraphMode.parse(t.cuda_graph), choice(Schedule, cfg.optim.schedule, "optim.schedule"),
                    sparsity.policy_choice(cfg), int(t.max_steps), int(t.log_every), int(t.eval_every),
                    int(t.eval_batches), int(t.ckpt_every), int(t.keep_ckpts), float(t.time_limit_s or 0),
                    int(t.loss_scale_window), bool(t.progress))


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




# --- the run -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """A training run's parts, built once by :func:`build`; what changes as it trains is ``state``."""
    config: dict                          # the resolved config, as plain values (checkpoints keep it)
    settings: Settings
    world: World
    device: torch.device
    run_dir: Path
    task: Any
    model: torch.nn.Module
    net: torch.nn.Module                  # what the steps call: the model, DDP around it, compiled
    forward: Forward
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: LRSchedule
    strategy: Single                      # Single, DDP or FSDP (bstrain/train/strategy.py)
    stepper: Stepper                      # how a step runs: graphed, armed for a sparsity update, eager
    ema: Any = None
    sparsity: Any = None                  # the dynamic-sparsity policy (bstrain.sparsity), None if static
    state: TrainState = None              # type: ignore[assignment]   (a fresh one: __post_init__)

    def __post_init__(self):
        if self.state is None:
            object.__setattr__(self, "state", TrainState())

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def step_mode(self) -> str:
        """How steps run: "graph" or "eager", with " (compiled)" when compiled."""
        return str(self.stepper.mode)


def _ema(model: torch.nn.Module, decay: float, device: torch.device, strategy: Single):
    """The EMA of the weights (None for decay 0), its copy made like the model."""
    if decay <= 0:
        return None
    from torch.optim.swa_utils import AveragedModel
    ema = AveragedModel(model, device=device)       # n_averaged on the device, where graphs count it
    strategy.wrap_copy(ema.module)
    return ema


def build(cfg: DictConfig, run_dir: Path, device: torch.device, world: World, settings: Settings | None = None) -> Run:
    """Data and task first (a bad path fails before any model is built), then model, optimizer,
    scaler, EMA, the sparsity policy and the stepper; then the checkpoint to resume from, if any.

    settings: what :func:`check_config` returned for ``cfg`` (None: it is checked here).
    """
    settings = settings or check_config(cfg)
    t_cfg, amp_dtype = cfg.trainer, settings.amp_dtype
    resume = _resume_path(cfg, run_dir)
    task = instantiate(cfg.task, "task")
    data = instantiate(cfg.data, "data")
    if world.active and getattr(data, "tokenizer_name", None) is not None:
        on_main(world, data.splits)    # rank 0 trains the BPE and tokenizes into the cache; the others read it
    task.setup(data, world, t_cfg.seed)
    _fill_vocab_size(cfg, data)
    checks.check_model_config(task, cfg.model)
    torch.manual_seed(t_cfg.seed)
    model, shard_spec = build_model(cfg)            # sparsified (cfg.sparsify) before anything wraps or copies it
    model = model.to(device)
    set_grad_group(model, t_cfg.group_size)
    strategy = make_strategy(settings.strategy, world, device, amp_dtype, shard_spec)
    why_eager = eager_reason(settings.graph_mode, device, strategy)
    if device.type == "cuda" and why_eager is not None and strategy.why_not_graphed():
        log.info("step: eager (%s)", why_eager)
    graphed = why_eager is None
    ema = _ema(model, cfg.optim.ema, device, strategy)
    net = uncompiled = strategy.wrap(model, graphed)
    if compiled := bool(t_cfg.get("compile", False)):
        net = torch.compile(net)        # the model (and DDP around it); checkpoints keep using `model`
    optimizer = make_optimizer(model, cfg.optim, device, capturable=graphed)
    scaler = strategy.scaler(amp_dtype == torch.float16, settings.loss_scale_window)
    forward = Forward(net, amp_dtype, device)
    policy = sparsity.make_policy(cfg, model, optimizer, ema, settings.max_steps, settings.policy)
    forward_hooked = None
    if policy is not None and compiled:
        sparsity.allow_recompiles(policy)
        # a compiled model ignores hooks added after it was compiled: RigL's step runs uncompiled
        forward_hooked = Forward(uncompiled, amp_dtype, device)
    parts = StepParts(forward, task, optimizer, list(model.parameters()), model, scaler, grad_clip=cfg.optim.grad_clip,
                      ema=ema, ema_decay=cfg.optim.ema, world=world,
                      hooks=None if policy is None else sparsity.GradientHooks(policy), forward_hooked=forward_hooked)
    run = Run(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), settings, world, device, run_dir, task,
              model, net, forward, optimizer, scaler, LRSchedule(Curve.of(cfg.optim), settings.max_steps), strategy,
              Stepper(parts, settings.graph_mode, why_eager, compiled=compiled), ema, policy)
    if resume is not None:
        restore(run, strategy.read(resume, model, optimizer, ema))
        _match_graph_mode(optimizer, graphed, device)
        log.info("resumed from %s at step %d", resume, run.state.step)
        if policy is not None:
            policy.load_state_dict({"steps": run.state.step})
    if run.state.step < settings.max_steps:         # the model against the data, before the run dir fills
        run.state.first_batch = task.next_batch(device)
        checks.check_first_batch(model, task, run.state.first_batch, amp_dtype, device, cfg)
        strategy.settle(model)                      # (a forward without backward keeps the root's gathers)
    return run
