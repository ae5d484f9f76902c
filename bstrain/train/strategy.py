"""The run's distributed strategy as one object, chosen once from ``trainer.strategy``
(:func:`make_strategy`): :class:`Single` (one process), :class:`DDP` (torchrun; every process
holds the whole model, DDP averages the gradients) and :class:`FSDP` (torchrun; FSDP2 shards
parameters, gradients and optimizer state: bstrain/train/fsdp.py).

Each one wraps the model (``wrap``, ``wrap_copy`` for the EMA's copy), makes fp16's loss scaler
(``scaler``), says whether a whole step can be captured (``why_not_graphed``), saves and reads
checkpoints (``save``, ``read``, ``load_weights``, ``load_ema``), evaluates (``evaluate``) and
tidies after a forward without backward (``settle``). Code outside this module never asks which
one it is: it calls these.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch

from bstrain.configs.schema import Strategy as Choice
from bstrain.errors import UserError
from bstrain.train import fsdp, sharded
from bstrain.train.distributed import resolve_strategy as resolve
from bstrain.train.checkpoint import (check_model_entries, checkpoint_path, load_checkpoint, prune_checkpoints,
                                      save_checkpoint)
from bstrain.train.distributed import World, all_sum, broadcast, check_same_layouts, on_main
from bstrain.train.tasks import splits_evaluation


class Single:
    """One process: the model as it is; rank 0 (the only one) writes and evaluates."""
    name = "single"

    def __init__(self, world: World, device: torch.device, amp_dtype: torch.dtype | None = None, shard_spec=None):
        self.world, self.device, self.amp_dtype, self.shard_spec = world, device, amp_dtype, shard_spec

    def __str__(self) -> str:
        return self.name

    def why_not_graphed(self) -> str | None:
        """Why a whole step cannot be captured in one CUDA graph under this strategy, or None."""
        return None

    def wrap(self, model: torch.nn.Module, graphed: bool) -> torch.nn.Module:
        """The module the steps call."""
        return model

    def wrap_copy(self, module: torch.nn.Module) -> None:
        """A copy of the model kept beside it (the EMA's), made like the model."""

    def scaler(self, enabled: bool, growth_interval: int) -> torch.amp.GradScaler:
        """fp16's loss scaler (disabled for fp32 and bf16), its scale made on the device now, so
        that a skip at the first step is counted too."""
        scaler = self._scaler_class()(self.device.type, init_scale=2.0**16, growth_interval=growth_interval,
                                      enabled=enabled)
        if scaler.is_enabled():
            scaler._lazy_init_scale_growth_tracker(self.device)
        return scaler

    def _scaler_class(self) -> type:
        return torch.amp.GradScaler

    def settle(self, model: torch.nn.Module) -> None:
        """After a forward without backward (evaluation, the start's check of a batch)."""

    # --- checkpoints ------------------------------------------------------------------------
    def save(self, directory: Path, step: int, capture, model, optimizer, ema, keep: int) -> Path:
        """A checkpoint of ``step`` in ``directory`` (collective); ``capture(weights)`` gives the
        entries (rank 0's; None elsewhere). Keeps the newest ``keep``. Returns its path."""
        state, path = capture(True), checkpoint_path(directory, step)

        def write():
            save_checkpoint(path, state)
            prune_checkpoints(directory, keep)
        on_main(self.world, write)
        return path

    def read(self, path: Path, model, optimizer, ema) -> dict:
        """The checkpoint at ``path`` to restore (its model and optimizer entries None where they
        were loaded in place already)."""
        return load_checkpoint(path)

    def load_weights(self, model, optimizer, ckpt: dict) -> None:
        """A checkpoint's whole model and optimizer entries into the run's."""
        by_name = ckpt.get("optimizer_fqn")             # a sharded checkpoint read whole: keyed by name
        model.load_state_dict(ckpt["model"])
        if by_name is not None:
            sharded.load_full_into(model, optimizer, ckpt["model"], by_name)
        else:
            optimizer.load_state_dict(ckpt["optimizer"])

    def load_ema(self, ema, state: dict) -> None:
        ema.load_state_dict(state)

    # --- evaluation -------------------------------------------------------------------------
    def evaluate(self, task, forward, split: str, max_batches: int, show_progress: bool) -> dict:
        """The task's metrics of ``split`` on every rank: rank 0 evaluates, the others get its result."""
        return broadcast(on_main(self.world, lambda: task.evaluate(forward, split, max_batches, show_progress)),
                         self.world)


class DDP(Single):
    """torchrun: DistributedDataParallel around the model, after checking that every rank holds
    the same block-sparse layouts."""
    name = "ddp"

    def wrap(self, model: torch.nn.Module, graphed: bool) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        from bstrain.nn._sparse import layout_buffers
        check_same_layouts(model, self.world)
        # the layouts agree across ranks and change together: DDP's broadcast of rank 0's buffers at every
        # forward would bump their version counters and have each layer read its layout back every step
        layouts = layout_buffers(model)
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted(ignored | {name for name, b in model.named_buffers() if id(b) in layouts}))
        device = self.device
        side = torch.cuda.Stream(device) if graphed else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # a graph that captures DDP's all-reduce needs DDP built on a side stream (torch.cuda.graphs docs)
            net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        return net


class FSDP(Single):
    """torchrun: the model sharded in place (``fully_shard`` per unit, then the root); sharded
    (DCP) checkpoints; evaluation split across the ranks."""
    name = "fsdp"

    def why_not_graphed(self) -> str | None:
        return "trainer.strategy=fsdp: FSDP's all-gathers and reduce-scatters run outside a whole-step CUDA graph"

    def wrap(self, model: torch.nn.Module, graphed: bool) -> torch.nn.Module:
        return fsdp.shard(model, self.world, self.device, self.amp_dtype, self.shard_spec)

    def wrap_copy(self, module: torch.nn.Module) -> None:
        fsdp.shard(module, self.world, self.device, self.amp_dtype, self.shard_spec)   # (FSDP's modules cannot be copied)

    def _scaler_class(self) -> type:
        # each rank checks only its shards of the gradients for inf: the sharded scaler all-reduces
        # the finding, so every rank skips the step together
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler

    def settle(self, model: torch.nn.Module) -> None:
        fsdp.reshard(model)         # a forward without backward leaves units gathered that keep their gathers

    def save(self, directory: Path, step: int, capture, model, optimizer, ema, keep: int) -> Path:
        path = checkpoint_path(directory, step, sharded=True)       # every rank writes its shards
        sharded.save_sharded(path, model, optimizer, capture(False), self.world, ema)
        on_main(self.world, lambda: prune_checkpoints(directory, keep))
        return path

    def read(self, path: Path, model, optimizer, ema) -> dict:
        """A sharded checkpoint: each rank reads its own shards, in place. A file (1 -> N): each rank
        maps it into memory (``torch.load(mmap=True)``), so a rank's pages of it are read only when
        touched, and :meth:`load_weights` keeps each rank's shards."""
        if sharded.is_sharded_checkpoint(path):
            check_model_entries(model, sharded.model_entries(path), path)    # one line, before DCP's own
            sharded.load_sharded_into(path, model, optimizer, ema)
            return {**sharded.read_extra(path), "path": str(path)}
        return load_checkpoint(path)

    def load_weights(self, model, optimizer, ckpt: dict) -> None:
        by_name = ckpt.get("optimizer_fqn")             # a sharded checkpoint read whole: keyed by name
        optim = by_name if by_name is not None else sharded.fqn_optimizer_state(model, optimizer, ckpt["optimizer"])
        sharded.load_full_into(model, optimizer, ckpt["model"], optim)

    def load_ema(self, ema, state: dict) -> None:
        sharded.load_full_ema(ema, state)

    def evaluate(self, task, forward, split: str, max_batches: int, show_progress: bool) -> dict:
        """Every rank runs the sharded forward (its gathers are collective) on its share of the
        evaluation (:meth:`bstrain.train.tasks.Task.evaluation_sums`); the sums are all-reduced,
        so the result is one process's over the same batches. A task without ``evaluation_sums``
        evaluates the whole split on every rank."""
        if not splits_evaluation(task):
            return task.evaluate(forward, split, max_batches, show_progress)
        sums = task.evaluation_sums(forward, split, max_batches, self.world.rank, self.world.size,
                                    show_progress and self.world.main)
        return task.evaluation_metrics({k: all_sum(v, self.world) for k, v in sums.items()})


_CLASSES = {Choice.single: Single, Choice.ddp: DDP, Choice.fsdp: FSDP}


def make_strategy(choice: Choice, world: World, device: torch.device, amp_dtype: torch.dtype | None = None,
                  shard_spec=None) -> Single:
    """The strategy object ``trainer.strategy`` (typed) names in this world."""
    return _CLASSES[resolve(choice, world)](world, device, amp_dtype, shard_spec)
