"""Gradients of parameters used at every timestep, summed inside the kernels (eager calls only).

A recurrent model applies its layer-norm gains and biases and its gate bias at every timestep.
Left to autograd, each step's backward reduces its kernel's per-program partial sums (one launch)
and autograd adds the result into the parameter's gradient (one launch per parameter), T times a
sequence. A :class:`ParamGradGroup`, made once per sequence, lets the steps' backward kernels add
their fp32 partial sums into one workspace instead; the parameters get the sum once, when the
backward pass reaches the group, after every step (every step hangs off the group's node).

The matmul's :class:`bstrain.ops.matmul.GradGroup` does the same for recurrent weights. As there,
workspaces are kept per backward pass, so a pass that stops short of the parameters
(``torch.autograd.grad`` with respect to inputs only) leaves later passes exact.
"""
from __future__ import annotations

import torch

from bstrain.ops.matmul import _graph_task
from bstrain.ops.tables import tracing

__all__ = ["ParamGradGroup", "param_grad_group"]


class _Workspaces(dict):
    """backward pass id -> (rows, programs, features) fp32 workspace of partial sums."""

    def get_or_zero(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        task = _graph_task()
        ws = self.get(task)
        if ws is None:
            ws = self[task] = torch.zeros(shape, dtype=torch.float32, device=device)
        elif ws.shape != shape:
            raise ValueError(f"grad_group: expected the same workspace {tuple(ws.shape)} at every step, got {shape} "
                             f"(one group per op and sequence)")
        return ws


class _GroupedParams(torch.autograd.Function):
    """The parameters as they enter every step (views, no launch). Its backward runs after every
    step's and hands each parameter its workspace row, summed over programs."""

    @staticmethod
    def forward(ctx, workspaces, rows, *params):
        ctx.workspaces, ctx.rows = workspaces, rows
        ctx.dtypes = [p.dtype for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *_unused):
        ws = ctx.workspaces.pop(_graph_task(), None)
        if ws is None:                                   # no step of this pass added anything
            return (None, None) + (None,) * len(ctx.rows)
        sums = ws.sum(1)                                 # (rows, features)
        grads, seen = [], set()
        for row, dtype in zip(ctx.rows, ctx.dtypes):
            grad = sums[row] if row not in seen else sums[row].clone()    # outputs may not share storage
            seen.add(row)
            grads.append(grad if grad.dtype == dtype else grad.to(dtype))
        return (None, None, *grads)


class ParamGradGroup:
    """Parameters used by one per-timestep op at every step of a sequence (:func:`param_grad_group`).

    Attributes:
        params: the parameters, in the order the op takes them.
        views: what the op's steps take in their place (autograd edges to the group).
        rows: params[i]'s gradient is row rows[i] of the workspace the op's kernels fill.
    """

    def __init__(self, *params: torch.Tensor, rows: tuple[int, ...] | None = None):
        self.params = params
        self.rows = tuple(range(len(params))) if rows is None else tuple(rows)
        self._workspaces = _Workspaces()
        self.views = _GroupedParams.apply(self._workspaces, self.rows, *params)

    def workspace(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The running backward pass's fp32 workspace of ``shape``, zero when first asked for."""
        return self._workspaces.get_or_zero(tuple(shape), device)

    def matches(self, params: tuple[torch.Tensor, ...], rows: tuple[int, ...]) -> bool:
        """Whether this is a group of exactly these parameters with these workspace rows (an op's check)."""
        return self.rows == rows and len(params) == len(self.params) and all(
            p is q for p, q in zip(params, self.params))


def param_grad_group(*params: torch.Tensor, rows: tuple[int, ...] | None = None) -> ParamGradGroup | None:
    """A group for ``params`` over one sequence, to pass as ``grad_group=`` at every timestep; None
    where there is nothing to group (gradients off, or a graph being traced: there autograd sums
    the steps itself)."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in params) or tracing():
        return None
    return ParamGradGroup(*params, rows=rows)
