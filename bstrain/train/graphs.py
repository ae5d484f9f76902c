"""One training step (forward, backward, clipping, AdamW, carried state) captured in a CUDA graph.

A recurrent model launches tens of small kernels per timestep; in eager mode the host (Python,
autograd, launch calls) rather than the GPU sets the pace. Replaying a captured graph launches
the whole step at once. ``trainer.cuda_graph=true`` turns it on; ``scripts/bench_lstm.py`` uses it
for the step-time measurement.

Requirements, checked by :func:`check_graph_config`: a CUDA device, fp32 or bf16 (fp16's loss
scaling skips steps with a host-side decision), one process (no DDP), and an optimizer built with
``capturable=True`` and tensor learning rates (:func:`bstrain.train.trainer.make_optimizer`).
"""
from __future__ import annotations

import torch

from bstrain.train.step import clip_grads, lm_loss


def check_graph_config(device: torch.device, precision: str, world_size: int) -> None:
    if device.type != "cuda":
        raise ValueError(f"trainer.cuda_graph: needs a CUDA device, got device {device.type!r}")
    if precision == "fp16":
        raise ValueError("trainer.cuda_graph: expected precision fp32 or bf16, got 'fp16' (dynamic loss "
                         "scaling decides on the host whether to skip a step)")
    if world_size > 1:
        raise ValueError(f"trainer.cuda_graph: expected a single process, got a world of {world_size} (DDP)")


class CapturedStep:
    """``step(x, y, reset_state) -> (loss, grad_norm)`` replays one captured training step.

    The inputs and the recurrent state live in static buffers; the graph reads the state, trains
    on (x, y) and writes the new state back, so consecutive batches carry it as the eager loop does.
    Capturing needs warm-up steps (kernel compilation, lookup tables, optimizer state); they run on
    the first batch and are undone (weights, optimizer state and RNG restored), so training with
    and without the graph follows the same trajectory.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, seq: int,
                 device: torch.device, amp_dtype: torch.dtype | None, group_size: int, grad_clip: float,
                 warmup: int = 2):
        self.model, self.optimizer = model, optimizer
        self.device, self.amp_dtype, self.group_size = device, amp_dtype, group_size
        self.grad_clip = grad_clip
        self.params = list(model.parameters())
        self.x = torch.zeros(batch, seq, dtype=torch.long, device=device)
        self.y = torch.zeros_like(self.x)
        self.state = model.init_state(batch, device, amp_dtype or torch.float32)
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self):
        loss, state = lm_loss(self.model, self.x, self.y, self.state, self.amp_dtype, self.group_size)
        loss.backward()
        grad_norm = clip_grads(self.params, self.grad_clip)
        self.optimizer.step()
        for buf, new in zip(self.state, state):
            buf.copy_(new.detach())
        return loss.detach(), grad_norm

    def _check_optimizer(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g["lr"]
            if not g.get("capturable") or not isinstance(lr, torch.Tensor) or lr.device.type != "cuda":
                raise ValueError(f"optimizer: param group {i} needs capturable=True and a CUDA tensor lr for "
                                 f"graph capture, got capturable={g.get('capturable')}, lr={lr!r}")

    def _capture(self) -> None:
        self._check_optimizer()
        saved_params = [p.detach().clone() for p in self.params]
        opt_state = self.optimizer.state
        saved_opt = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt_state[p].items()}
                     for p in self.params if opt_state.get(p)}
        saved_state = [s.clone() for s in self.state]
        saved_rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.optimizer.zero_grad(set_to_none=True)
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.no_grad():                              # undo the warm-up steps
            for p, s in zip(self.params, saved_params):
                p.copy_(s)
            for buf, s in zip(self.state, saved_state):
                buf.copy_(s)
            # Optimizer state is restored in place: the warm-up created it outside the graph, and
            # the graph must update those tensors, not re-create them at every replay. A state the
            # warm-up created from nothing goes back to AdamW's initial one: all zeros, step 0.
            for p in self.params:
                for k, v in opt_state.get(p, {}).items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if p in saved_opt:
                        v.copy_(saved_opt[p][k])
                    else:
                        v.zero_()
        torch.cuda.set_rng_state(saved_rng, self.device)
        self.optimizer.zero_grad(set_to_none=True)         # gradients get static buffers in the graph
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss, self.grad_norm = self._step()

    def step(self, x: torch.Tensor, y: torch.Tensor, reset_state: bool):
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if reset_state:
            for s in self.state:
                s.zero_()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.loss, self.grad_norm

    def load_state(self, state) -> None:
        for buf, s in zip(self.state, state):
            buf.copy_(s)
