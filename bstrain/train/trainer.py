"""The training loop: ``train(cfg) -> dict``, called by ``python -m bstrain train`` and by tests.

Precision: fp32 master weights always. fp16 runs the forward under autocast with dynamic loss
scaling (torch.amp.GradScaler: starts at 2**16, halves and skips the step on inf/NaN, doubles
after ``trainer.loss_scale_window`` clean steps), so no NaN ever reaches the weights; bf16 runs
under autocast without scaling. The block-sparse layers cast their input to the autocast dtype
and their fp32 weights on the fly.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.data.text import BpttBatches, bits_per_byte, check_size, load_bytes
from bstrain.models.lstm import build_model
from bstrain.train.checkpoint import (checkpoint_path, latest_checkpoint, load_checkpoint, prune_checkpoints,
                                      save_checkpoint)
from bstrain.train.distributed import (World, barrier, broadcast, check_same_layouts, device_for, finish, gather,
                                       init_world, mean, shard)
from bstrain.train.graphs import CapturedStep, check_graph_config
from bstrain.train.progress import Board, Progress, log, setup_logging
from bstrain.train.step import clip_grads, lm_loss

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device: 'cuda' was asked for, but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device: expected auto, cpu or cuda, got {name!r}")
    return torch.device(name)


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
              for ps, wd in ((decay, cfg.weight_decay), (rest, 0.0))]
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


def lr_factor(step: int, cfg, max_steps: int) -> float:
    """Linear warmup, then cosine or linear decay to min_lr_ratio (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def _check_config(cfg) -> None:
    t, o = cfg.trainer, cfg.optim
    if t.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision: expected fp32, fp16 or bf16, got {t.precision!r}")
    if o.schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"optim.schedule: expected cosine, linear or constant, got {o.schedule!r}")
    if t.max_steps < 1 or t.group_size < 1:
        raise ValueError(f"trainer.max_steps, trainer.group_size: expected >= 1, got {t.max_steps}, {t.group_size}")


def _run_dir(cfg) -> Path:
    if cfg.trainer.run_dir:
        return Path(cfg.trainer.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # called outside a Hydra app
        return Path("runs") / time.strftime("%Y-%m-%d/%H-%M-%S")


def _resume_path(cfg, run_dir: Path) -> Path | None:
    value = str(cfg.trainer.resume).strip()
    if value.lower() in ("false", "none", "", "0"):
        return None
    if value.lower() in ("true", "1"):
        return latest_checkpoint(run_dir / "ckpt")          # None: a fresh start
    return Path(value)


@torch.no_grad()
def evaluate(model, data, cfg, device, n_batches: int) -> tuple[float, float]:
    """Mean loss (nats/byte) and bits per byte over the first n_batches (0: all) of ``data``."""
    model.eval()
    batches = BpttBatches(data, cfg.data.batch_size, cfg.data.seq_len)
    n = len(batches) if n_batches <= 0 else min(n_batches, len(batches))
    dtype = PRECISIONS[cfg.trainer.precision]
    state, total = None, 0.0
    for i in range(n):
        x, y = (t.to(device) for t in batches.batch(i))
        loss, state = lm_loss(model, x, y, state, dtype)
        total += loss.item()
    model.train()
    loss = total / max(1, n)
    return loss, bits_per_byte(loss)


def train(cfg: DictConfig) -> dict:
    """Trains the configured model; returns final metrics and the run directory.

    Under torchrun each process trains on its shard of the data with DDP; rank 0 writes.
    """
    _check_config(cfg)
    device = resolve_device(cfg.trainer.device)
    world = init_world(device)
    try:
        run_dir = Path(broadcast(str(_run_dir(cfg)), world))        # one run dir for every rank
        if world.main:
            run_dir.mkdir(parents=True, exist_ok=True)
        barrier(world)
        handler = setup_logging(run_dir, world.rank) if world.main else None
        if not world.main:
            log.setLevel(logging.WARNING)
        try:
            return _train(cfg, run_dir, device_for(world, device), world)
        finally:
            if handler is not None:
                log.removeHandler(handler)
                handler.close()
    finally:
        finish(world)


def _train(cfg: DictConfig, run_dir: Path, device: torch.device, world: World) -> dict:
    t_cfg = cfg.trainer
    # Data first: a bad path or too small a file fails before any model is built.
    train_data, valid_data, _ = load_bytes(cfg.data.path, cfg.data.name)
    train_data = shard(train_data, world)
    check_size(train_data, cfg.data.batch_size, cfg.data.seq_len, cfg.data.path, "train")
    check_size(valid_data, cfg.data.batch_size, cfg.data.seq_len, cfg.data.path, "valid")
    torch.manual_seed(t_cfg.seed)
    model = build_model(cfg.model).to(device)
    net = model
    if world.active:
        from torch.nn.parallel import DistributedDataParallel
        check_same_layouts(model, world)
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    graphed = bool(t_cfg.cuda_graph)
    if graphed:
        check_graph_config(device, t_cfg.precision, world.size)
    optimizer = make_optimizer(model, cfg.optim, device, capturable=graphed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.optim, t_cfg.max_steps))
    amp_dtype = PRECISIONS[t_cfg.precision]
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16, growth_interval=t_cfg.loss_scale_window,
                                  enabled=t_cfg.precision == "fp16")
    ema = None
    if cfg.optim.ema > 0:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.optim.ema))
    batches = BpttBatches(train_data, cfg.data.batch_size, cfg.data.seq_len)
    step, state = 0, None

    resume = _resume_path(cfg, run_dir)
    if resume is not None:
        ckpt = load_checkpoint(resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        _match_graph_mode(optimizer, graphed, device)
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        if ema is not None and ckpt.get("ema") is not None:
            ema.load_state_dict(ckpt["ema"])
        batches.load_state_dict(ckpt["data"])
        torch.set_rng_state(ckpt["rng"]["cpu"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        states = ckpt.get("state") or []
        if len(states) == world.size:                       # one carried state per rank
            state = tuple(s.to(device) for s in states[world.rank])
        else:
            log.warning("checkpoint holds %d recurrent states for %d ranks: starting from zero state",
                        len(states), world.size)
        step = int(ckpt["step"])
        log.info("resumed from %s at step %d", ckpt["path"], step)

    log.info("run dir %s | device %s | precision %s | %s parameters | %s", run_dir, device, t_cfg.precision,
             f"{model.num_params():,}", ", ".join(repr(layer.op) for layer in model.sparse_layers()) or "dense")
    board = Board(run_dir, world.rank)
    board.start(OmegaConf.to_yaml(cfg), " ".join(sys.argv),
                {f"layer{i}": layer.op.layout for i, layer in enumerate(model.sparse_layers())})
    progress = Progress(t_cfg.max_steps, step, t_cfg.log_every, t_cfg.progress, world.rank)
    history, valid_history, valid = [], [], (float("nan"), float("nan"))
    tokens = cfg.data.batch_size * cfg.data.seq_len
    params = [p for p in model.parameters()]
    captured = None
    if graphed:
        captured = CapturedStep(model, optimizer, cfg.data.batch_size, cfg.data.seq_len, device, amp_dtype,
                                t_cfg.group_size, cfg.optim.grad_clip)
        if state is not None:
            captured.load_state(state)
    t_last = t_start = time.perf_counter()
    stop_at = t_cfg.max_steps
    try:
        while step < stop_at:
            x, y, wrapped = batches.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if wrapped:
                state = None                                   # a new epoch starts from a fresh state
            lr = float(optimizer.param_groups[0]["lr"])        # the lr this step uses
            if captured is not None:                           # the whole step in one graph replay
                loss, grad_norm = captured.step(x, y, reset_state=state is None)
                state = captured.state
            else:
                loss, state = lm_loss(net, x, y, state, amp_dtype, t_cfg.group_size)
                state = tuple(s.detach() for s in state)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                grad_norm = clip_grads(params, cfg.optim.grad_clip)
                scaler.step(optimizer)                         # skipped (and the scale halved) on inf/NaN
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if ema is not None:
                ema.update_parameters(model)
            step += 1
            loss_v = mean(loss.item(), world, device)
            now = time.perf_counter()
            metrics = {"loss": loss_v, "bpb": bits_per_byte(loss_v), "lr": lr,
                       "grad_norm": float(grad_norm), "tokens_per_s": tokens / max(now - t_last, 1e-9),
                       "loss_scale": scaler.get_scale() if scaler.is_enabled() else 1.0}
            t_last = now
            history.append((step, loss_v))
            progress.update(step, metrics)
            if step % t_cfg.log_every == 0 or step == t_cfg.max_steps:
                if device.type == "cuda":
                    metrics["gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                board.scalars(step, {f"train/{k}": v for k, v in metrics.items()})
            if t_cfg.time_limit_s and now - t_start > t_cfg.time_limit_s:
                stop_at = step                                 # out of time: finish like a last step
            last = step == stop_at
            if (t_cfg.eval_every and step % t_cfg.eval_every == 0) or last:
                if world.main:
                    valid = evaluate(ema.module if ema is not None else model, valid_data, cfg, device,
                                     t_cfg.eval_batches)
                    board.scalars(step, {"valid/loss": valid[0], "valid/bpb": valid[1]})
                    valid_history.append((step, now - t_start, valid[1]))
                    progress.write(f"step {step}: valid loss {valid[0]:.4f}, {valid[1]:.4f} bits/byte")
                valid = broadcast(valid, world)
            if (t_cfg.ckpt_every and step % t_cfg.ckpt_every == 0) or last:
                states = gather([s.detach().cpu() for s in state], world)         # every rank's carried state
                if world.main:
                    ckpt_dir = run_dir / "ckpt"
                    save_checkpoint(checkpoint_path(ckpt_dir, step), {
                        "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "ema": ema.state_dict() if ema is not None else None, "data": batches.state_dict(),
                        "rng": {"cpu": torch.get_rng_state(),
                                "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
                        "state": states, "config": OmegaConf.to_container(cfg, resolve=True)})
                    prune_checkpoints(ckpt_dir, t_cfg.keep_ckpts)
            t_last = time.perf_counter()                       # tokens/s counts training time only
    except BaseException:
        board.close()                                      # no writer thread left behind
        raise
    finally:
        progress.close()
    result = {"steps": step, "train_loss": history[-1][1] if history else float("nan"),
              "valid_loss": valid[0], "valid_bpb": valid[1], "run_dir": str(run_dir), "history": history,
              "valid_history": valid_history,
              "params": model.num_params()}
    board.finish({"hidden": cfg.model.hidden, "sparse": cfg.model.sparse, "density": cfg.model.density,
                  "block_size": cfg.model.block_size, "lr": cfg.optim.lr, "precision": t_cfg.precision},
                 {"hparam/valid_bpb": valid[1]})
    log.info("done: %d steps, train loss %.4f, valid %.4f bits/byte", step, result["train_loss"], valid[1])
    return result
