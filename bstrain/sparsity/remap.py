"""Optimizer state at an update: which state of a managed weight can follow its blocks, the
per-block tensors that move with them, where a grown block's state starts, and the move itself."""
from __future__ import annotations

import numpy as np
import torch


def _sharded(t) -> bool:
    """Whether ``t`` is a DTensor (a weight or its optimizer state under FSDP2: blocks sharded
    along dim 0 across the ranks)."""
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a sharded one gathered whole (collective: every rank calls it)."""
    return t.full_tensor() if _sharded(t) else t


def _write_whole(t: torch.Tensor, whole: torch.Tensor) -> None:
    """Writes ``whole`` into ``t``: each rank its shard of a sharded ``t`` (every rank holds the
    same ``whole``, so the shards agree)."""
    if _sharded(t):
        from torch.distributed.tensor import distribute_tensor
        t.copy_(distribute_tensor(whole, t.device_mesh, t.placements))
    else:
        t.copy_(whole)


def _move_blocks(old: np.ndarray, new: np.ndarray, tensors: list[tuple[torch.Tensor, float | None]]) -> None:
    """Moves the blocks (dim 0) of each tensor from layout ``old`` to ``new``: a surviving block
    to its place in the new row-major block order, bit for bit; a grown one starts at its
    tensor's start value (None: the mean of the surviving blocks, zero if there are none). A
    sharded tensor (FSDP) is gathered, moved whole as in one process, and each rank keeps its
    shard."""
    if int(new.sum()) != int(old.sum()):
        raise RuntimeError(f"sparsity: a new layout of {int(new.sum())} live blocks for a layer of {int(old.sum())}; "
                           f"please report this layout")
    old_id = np.full(old.shape, -1)
    old_id[old] = np.arange(int(old.sum()))
    src = torch.as_tensor(old_id[new])                                   # new block i <- old src[i] (or -1)
    keep = src >= 0
    dst_idx, src_idx = torch.nonzero(keep).flatten(), src[keep]
    for target, start in tensors:
        t = _whole(target)
        kept = t[src_idx.to(t.device)]                                   # (survivors, *block dims)
        if start is None:
            moved = torch.empty_like(t).fill_(kept.mean()) if kept.numel() else torch.zeros_like(t)
        else:
            moved = torch.full_like(t, start)
        moved[dst_idx.to(t.device)] = kept
        _write_whole(target, moved)


def _is_scalar(value) -> bool:
    """Optimizer state that does not depend on the blocks: a 0-dim tensor (a step count), a number."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return value is None or isinstance(value, (bool, int, float, complex))


def _per_block(value, weight: torch.Tensor) -> bool:
    """Whether ``value`` is optimizer state with a slice per block of ``weight``: (nnz, ...) with
    the weight's number of dims, each other dim the weight's or 1 (Adafactor's factored
    (nnz, bs, 1) and (nnz, 1, bs))."""
    return isinstance(value, torch.Tensor) and value.dim() == weight.dim() and value.shape[0] == weight.shape[0] \
        and all(d in (1, wd) for d, wd in zip(value.shape[1:], weight.shape[1:]))


def _check_optimizer(opt, groups: list) -> None:
    """A ValueError naming the optimizer and the key for state of a managed weight that cannot
    follow its blocks (see :mod:`bstrain.sparsity`); nothing is moved before this passes."""
    if opt is None:
        return
    if not (hasattr(opt, "state") and hasattr(opt, "param_groups")):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer (state and param_groups) or None, got a "
                         f"{type(opt).__name__}")
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for group in groups:
        name, layer = group[0]
        w = layer.weight
        if isinstance(opt, torch.optim.LBFGS) and id(w) in held:
            raise ValueError(f"optimizer: LBFGS keeps its state (the directions 'd', 'old_dirs', 'old_stps') as "
                             f"flat vectors over all its parameters, which a layout update cannot move block by "
                             f"block; it holds the weight of {name!r}: use another optimizer for it")
        for key, value in opt.state.get(w, {}).items():
            if not (_is_scalar(value) or _per_block(value, w)):
                got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                    f"a {type(value).__name__}"
                raise ValueError(f"optimizer: {type(opt).__name__} keeps state {key!r} for the weight of {name!r} "
                                 f"as {got}, which a layout update cannot move with its blocks: expected per-block "
                                 f"tensors of shape ({w.shape[0]}, ...) whose other dims are the weight's "
                                 f"{tuple(w.shape[1:])} or 1, or scalars")


def _state_moves(optimizer, weight: torch.Tensor, grown_moments: str) -> list[tuple[torch.Tensor, float | None]]:
    """(per-block state tensor of ``weight``, start of its grown blocks: a value, or None for
    the survivors' mean) for every state tensor that moves with the blocks."""
    if optimizer is None or not optimizer.state.get(weight):
        return []
    group = next((g for g in optimizer.param_groups if any(p is weight for p in g["params"])),
                 optimizer.defaults)
    return [(value, _grown_start(optimizer, key, group, grown_moments))
            for key, value in optimizer.state[weight].items()
            if isinstance(value, torch.Tensor) and _per_block(value, weight)]


def _grown_start(optimizer, key: str, group: dict, grown_moments: str) -> float | None:
    """Where a grown block's state ``key`` starts: the optimizer's own start value for it
    (Adagrad's ``sum``: initial_accumulator_value; Rprop's ``step_size``: lr; else zero), or
    None (the survivors' mean) for second moments under grown_moments="mean"."""
    if grown_moments == "mean" and key in ("exp_avg_sq", "max_exp_avg_sq"):
        return None
    if isinstance(optimizer, torch.optim.Adagrad) and key == "sum":
        return float(group["initial_accumulator_value"])
    if isinstance(optimizer, torch.optim.Rprop) and key == "step_size":
        return float(group["lr"])
    return 0.0
