"""The training step every path shares: the eager loop, the CUDA-graph capture and the benchmarks.

The model protocol (README, "Your own model"): a model is an ``nn.Module``;
- stateless: ``forward(x) -> output``;
- stateful: also ``init_state(batch_size, device) -> state`` (a tensor or a tuple of tensors, batch
  on dim 0), and ``forward(x, state) -> (output, state)``; the trainer carries the state from one
  batch to the next (detached) and restarts it when the task says the data stream restarts.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def unwrap(net: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel, an EMA AveragedModel or torch.compile."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.swa_utils import AveragedModel
    while True:
        if isinstance(net, (DistributedDataParallel, AveragedModel)):
            net = net.module
        elif isinstance(getattr(net, "_orig_mod", None), nn.Module):      # torch.compile's wrapper
            net = net._orig_mod
        else:
            return net


def is_stateful(model: nn.Module) -> bool:
    return callable(getattr(unwrap(model), "init_state", None))


def detach_state(state):
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.detach()
    return type(state)(detach_state(s) for s in state)


def state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a state (a tensor or a nested tuple/list of them), in order."""
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for s in state for t in state_tensors(s)]


class Forward:
    """``forward(x, state) -> (output, state)`` for any model, under autocast (amp_dtype None: off).

    A stateless model is called as ``net(x)`` and its state stays None; a stateful one gets
    ``init_state(len(x), device)`` when state is None. ``device`` is where inputs go.
    """

    def __init__(self, net: nn.Module, amp_dtype: torch.dtype | None, device: torch.device):
        self.net, self.amp_dtype, self.device = net, amp_dtype, device
        self.stateful = is_stateful(net)

    def __call__(self, x: torch.Tensor, state: Any = None):
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            if not self.stateful:
                return self.net(x), None
            if state is None:
                state = unwrap(self.net).init_state(x.shape[0], x.device)
            return self.net(x, state)


def clip_grads(params, grad_clip: float) -> torch.Tensor:
    """Global-norm clipping to ``grad_clip`` (0: none); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm       # sharded (fsdp): the global norm


def train_step(forward: Forward, loss_fn, x: torch.Tensor, y: torch.Tensor, state, optimizer: torch.optim.Optimizer,
               params: list[torch.Tensor], grad_clip: float, scaler: torch.amp.GradScaler | None = None,
               zero_grad: bool = True, metrics_fn=None):
    """One optimizer step: forward, loss, backward, (unscale), clip, AdamW step.

    Returns (loss, grad norm, new state, metrics), all on the device: nothing here waits for the
    GPU except GradScaler's own inf check (fp16 only). ``loss_fn(output, y)`` is the task's loss;
    ``metrics_fn(output, y) -> {name: scalar tensor}`` its training metrics of the batch (None: {}).
    """
    output, state = forward(x, state)
    loss = loss_fn(output, y)
    with torch.no_grad():
        metrics = metrics_fn(output, y) if metrics_fn is not None else {}
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = clip_grads(params, grad_clip)
        scaler.step(optimizer)                      # skipped (and the scale halved) on inf/NaN
        scaler.update()
    else:
        loss.backward()
        grad_norm = clip_grads(params, grad_clip)
        optimizer.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach(), detach_state(state), metrics
