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

from bstrain.train.step import Forward, state_tensors, train_step


def check_graph_config(device: torch.device, precision: str, world_size: int) -> None:
    from bstrain.errors import UserError
    precision = getattr(precision, "value", precision)
    if device.type != "cuda":
        raise UserError(f"trainer.cuda_graph: needs a CUDA device, got device {device.type!r}")
    if precision == "fp16":
        raise UserError("trainer.cuda_graph: expected precision fp32 or bf16, got 'fp16' (dynamic loss "
                         "scaling decides on the host whether to skip a step)")
    if world_size > 1:
        raise UserError(f"trainer.cuda_graph: expected a single process, got a world of {world_size} (DDP)")


class CapturedStep:
    """``step(x, y, reset_state) -> (loss, grad_norm, metrics)`` replays one captured training step.

    The step is :func:`bstrain.train.step.train_step`, the eager loop's. The inputs and a stateful
    model's carried state live in static buffers; the graph reads the state, trains on (x, y) and
    writes the new state back, so consecutive batches carry it as the eager loop does.
    Capturing needs warm-up steps (kernel compilation, lookup tables, optimizer state); they run on
    the first batch and are undone (weights, optimizer state and RNG restored), so training with
    and without the graph follows the same trajectory (buffers such as BatchNorm statistics are
    restored too).
    """

    def __init__(self, forward: Forward, loss_fn, optimizer: torch.optim.Optimizer, grad_clip: float,
                 metrics_fn=None, warmup: int = 2):
        self.forward, self.loss_fn, self.optimizer, self.metrics_fn = forward, loss_fn, optimizer, metrics_fn
        self.device, self.grad_clip, self.warmup = forward.device, grad_clip, warmup
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.model = forward.net
        self.x = self.y = None
        self.state = None                                  # static state buffers (stateful models)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self):
        loss, grad_norm, state, metrics = train_step(self.forward, self.loss_fn, self.x, self.y, self.state,
                                                     self.optimizer, self.params, self.grad_clip, zero_grad=False,
                                                     metrics_fn=self.metrics_fn)
        for buf, new in zip(state_tensors(self.state), state_tensors(state)):
            buf.copy_(new)
        return loss, grad_norm, metrics

    def _check_optimizer(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g["lr"]
            if not g.get("capturable") or not isinstance(lr, torch.Tensor) or lr.device.type != "cuda":
                raise ValueError(f"optimizer: param group {i} needs capturable=True and a CUDA tensor lr for "
                                 f"graph capture, got capturable={g.get('capturable')}, lr={lr!r}")

    def _capture(self) -> None:
        from bstrain.kernels.launch import graph_plans       # triton is needed only on CUDA
        self._check_optimizer()
        saved_params = [p.detach().clone() for p in self.params]
        opt_state = self.optimizer.state
        saved_opt = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt_state[p].items()}
                     for p in self.params if opt_state.get(p)}
        saved_state = [s.clone() for s in state_tensors(self.state)]
        saved_buffers = [b.clone() for b in self.model.buffers()]       # e.g. BatchNorm running statistics
        saved_rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), graph_plans():      # the capture's kernels, compiled and loaded here
            for _ in range(self.warmup):
                self.optimizer.zero_grad(set_to_none=True)
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.no_grad():                              # undo the warm-up steps
            for p, s in zip(self.params, saved_params):
                p.copy_(s)
            for buf, s in zip(state_tensors(self.state), saved_state):
                buf.copy_(s)
            for buf, s in zip(self.model.buffers(), saved_buffers):
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
            self.loss, self.grad_norm, self.metrics = self._step()

    def step(self, x: torch.Tensor, y: torch.Tensor, reset_state: bool):
        if self.x is None:                                 # static buffers of the first batch's shapes
            self.x, self.y = torch.empty_like(x), torch.empty_like(y)
            if self.forward.stateful and self.state is None:
                self.state = self.forward.net.init_state(x.shape[0], self.device)
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if reset_state:
            for s in state_tensors(self.state):
                s.zero_()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.loss, self.grad_norm, self.metrics

    def load_state(self, state, batch_like: torch.Tensor) -> None:
        """Copies a carried state (from a checkpoint) into the static buffers."""
        if self.state is None and self.forward.stateful:
            self.state = self.forward.net.init_state(batch_like.shape[0], self.device)
        for buf, s in zip(state_tensors(self.state), state_tensors(state)):
            buf.copy_(s)
