"""Multi-GPU (and multi-process CPU) training through torchrun and DistributedDataParallel.

``torchrun --nproc_per_node=N -m bstrain train ...`` starts N processes; each finds its rank in the
environment torchrun sets, joins the process group (NCCL on GPUs, gloo on CPU) and trains on its
slice of every global batch (the task cuts it). DDP averages gradients; rank 0 alone writes logs,
TensorBoard, validation results and checkpoints. Nothing here runs in a single process.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from bstrain.errors import UserError


class RankFailed(RuntimeError):
    """Raised on the other ranks when rank 0 failed in :func:`on_main`: rank 0 reports the error
    (``python -m bstrain`` prints nothing more for this one)."""


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


def init_world(device: torch.device) -> World:
    """Joins the process group when started by torchrun (WORLD_SIZE > 1); else a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world


def device_for(world: World, device: torch.device) -> torch.device:
    """This rank's device: its own GPU when the processes share a machine's GPUs. More processes on
    a machine than it has GPUs is a UserError on every rank (rank 0 says it), before any is asked for."""
    if device.type != "cuda" or not world.active:
        return device
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.local_rank + 1))
    if local > torch.cuda.device_count():
        raise UserError(f"trainer.nproc (or torchrun's --nproc_per_node): expected at most "
                        f"{torch.cuda.device_count()} processes on this machine, one per GPU, got {local}; "
                        f"or trainer.device=cpu")
    return torch.device("cuda", world.local_rank)


def check_same_layouts(model: torch.nn.Module, world: World | None = None) -> None:
    """ValueError on every rank unless all ranks hold the same block-sparse layouts.

    DDP broadcasts rank 0's parameters and buffers at start, but a layer's layout also lives in
    its lookup tables: ranks that drew different layouts (a layout drawn without a seed, from a
    differently seeded RNG) would train different functions, silently or with a shape error.
    Call it after the process group is up and before wrapping the model in DDP; the trainer does.
    ``world`` defaults to the running process group.
    """
    from bstrain.nn import block_sparse_layouts
    if world is None:
        active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        world = World(dist.get_rank(), dist.get_world_size()) if active else World()
    if not world.active:
        return
    mine = [(name, lay.shape, hashlib.sha256(np.packbits(lay).tobytes()).hexdigest())
            for name, lay in block_sparse_layouts(model)]
    for rank, theirs in enumerate(gather(mine, world)):
        if theirs == mine:
            continue
        ours = dict((n, (sh, h)) for n, sh, h in mine)
        diff = [n for n, sh, h in theirs if ours.get(n) != (sh, h)] or ["(the set of block-sparse layers)"]
        raise ValueError(f"layout: rank {rank} and rank {world.rank} built different block-sparse layouts for "
                         f"{diff[0]}; draw layouts from a seed or seed torch identically on every rank "
                         f"before building the model")


def broadcast(obj, world: World):
    """rank 0's ``obj`` on every rank."""
    if not world.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj, world: World) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not world.active:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def all_mean(t: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of ``t`` over the ranks (a new tensor; ``t`` itself in a world of one)."""
    if not world.active:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / world.size


def all_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """The sum of ``t`` over the ranks (a new tensor; ``t`` itself in a world of one)."""
    if not world.active:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t


def on_main(world: World, fn):
    """fn() on rank 0. Under DDP its exception is raised on every rank, which would otherwise wait
    in the next collective until the process group times out."""
    result, error = None, None
    if world.main:
        try:
            result = fn()
        except Exception as exc:            # re-raised below, after the other ranks hear of it
            error = exc
    if world.active:
        failed = broadcast(None if error is None else f"{type(error).__name__}: {error}", world)
        if failed and error is None:
            raise RankFailed(f"rank 0 failed: {failed}")
    if error is not None:
        raise error
    return result



def barrier(world: World) -> None:
    if world.active:
        dist.barrier()


def finish(world: World) -> None:
    if world.active and dist.is_initialized():
        dist.destroy_process_group()


def resolve_strategy(choice, world: World):
    """single, ddp or fsdp (the schema's ``Strategy``) for ``trainer.strategy`` in this world; UserError
    where they disagree."""
    from bstrain.configs.schema import Strategy as Choice
    if choice is Choice.auto:
        return Choice.ddp if world.active else Choice.single
    if choice is not Choice.single and not world.active:
        raise UserError(f"trainer.strategy={choice.value}: needs more than one process (torchrun --nproc_per_node=N "
                        f"-m bstrain train ...), got one; one process trains with trainer.strategy=single or auto (a "
                        f"resumed run keeps its checkpoint's strategy unless the command line sets it)")
    if choice is Choice.single and world.active:
        raise UserError(f"trainer.strategy=single: torchrun started {world.size} processes, each of which would "
                        f"train alone; use trainer.strategy=ddp or fsdp (or auto)")
    return choice
