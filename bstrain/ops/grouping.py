"""Gradients of parameters used at every timestep, summed inside the kernels (eager calls only).

A recurrent model applies its layer-norm gains and biases and its gate bias at every timestep.
Left to autograd, each step's backward reduces its kernel's per-program partial sums (one launch)
and autograd adds the result into the parameter's gradient (one launch per parameter), T times a
sequence. A :class:`ParamGradGroup`, made once per sequence, lets the steps' backward kernels add
their fp32 partial sums into one workspace instead; the parameters get the sum once, when the
backward pass reaches the group, after every step (every step hangs off the group's node).

:class:`GradGroup` (below; :meth:`bstrain.ops.matmul.BlocksparseMatMul.grad_group` makes one) does
the same for recurrent weights, whose dW it computes for many timesteps in one launch. For both,
workspaces are kept per backward pass, so a pass that stops short of the parameters
(``torch.autograd.grad`` with respect to inputs only) leaves later passes exact.
"""
from __future__ import annotations

import torch

from bstrain.ops._matmul_ops import _as
from bstrain.ops.tables import tracing

__all__ = ["GradGroup", "ParamGradGroup", "param_grad_group"]


def _graph_task() -> int:
    """Id of the backward pass now running (entries of other passes must not mix)."""
    return torch._C._current_graph_task_id()


class _Workspaces(dict):
    """backward pass id -> (rows, programs, features) fp32 workspace of partial sums, and the
    parameters' gradients taken from it (held apart from the group, whose views would make the
    group node's context hold its own outputs: a reference cycle autograd does not free)."""

    def __init__(self, rows: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
        super().__init__()
        self.rows, self.dtypes = rows, dtypes

    def get_or_zero(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        task = _graph_task()
        ws = self.get(task)
        if ws is None:
            ws = self[task] = torch.zeros(shape, dtype=torch.float32, device=device)
        elif ws.shape != shape:
            raise ValueError(f"grad_group: expected the same workspace {tuple(ws.shape)} at every step, got {shape} "
                             f"(one group per op and sequence)")
        return ws

    def take(self) -> tuple[torch.Tensor | None, ...]:
        """Each parameter's gradient from the running backward pass's workspace (row rows[i],
        summed over programs, in the parameter's dtype); forgets that pass."""
        ws = self.pop(_graph_task(), None)
        if ws is None:                                   # no step of this pass added anything
            return (None,) * len(self.rows)
        sums = ws.sum(1)                                 # (rows, features)
        grads, seen = [], set()
        for row, dtype in zip(self.rows, self.dtypes):
            grad = sums[row] if row not in seen else sums[row].clone()    # outputs may not share storage
            seen.add(row)
            grads.append(grad if grad.dtype == dtype else grad.to(dtype))
        return tuple(grads)


class _GroupNode(torch.autograd.Function):
    """Parameters as every step of a sequence takes them: each a view, or a copy in another dtype
    made once. Every step hangs off its outputs, so its backward runs after all of theirs, and hands
    the parameters what was collected meanwhile (``collector.take()``: a GradGroup's grouped dW, a
    ParamGradGroup's workspace rows), not a function of the gradients that reach its outputs.
    Why not kernel_op: its gradients come from a group the steps' backwards fill, not from its outputs' gradients.
    """

    @staticmethod
    def forward(ctx, collector, dtypes, *params):
        ctx.collector = collector
        return tuple(p.view_as(p) if p.dtype == dt else p.to(dt).contiguous() for p, dt in zip(params, dtypes))

    @staticmethod
    def backward(ctx, *_unused):
        return (None, None, *ctx.collector.take())


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
        dtypes = tuple(p.dtype for p in params)
        self._workspaces = _Workspaces(self.rows, dtypes)
        self.views = _GroupNode.apply(self._workspaces, dtypes, *params)

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


# --- the matmul's weights: gradient grouping (the seed's group_param_grads) -----------------------------
class GradGroup:
    """Collects (x, dy) of one weight applied at many timesteps and computes its dW for up to
    ``group_size`` timesteps in one launch, on the rows of all of them stacked, instead of one
    small launch per timestep. Used through :meth:`BlocksparseMatMul.grouped` or
    ``BlockSparseLinear.grad_group``. Entries are kept per backward pass, so a pass that stops
    short of the weight (``torch.autograd.grad`` w.r.t. inputs only) leaves later passes exact.
    """

    def __init__(self, op: "BlocksparseMatMul", group_size: int, dw_dtype: torch.dtype | None = None):
        if group_size < 1:
            raise ValueError(f"group_size: expected >= 1, got {group_size}")
        self.op, self.group_size, self.dw_dtype = op, group_size, dw_dtype
        self._pending: dict[int, tuple[list, list, list]] = {}   # pass id -> (xs, dys, [dw])
        self.launches = 0

    def add(self, x: torch.Tensor, dy: torch.Tensor) -> None:
        xs, dys, _ = self._pending.setdefault(_graph_task(), ([], [], [None]))
        xs.append(x)
        dys.append(dy)
        if len(xs) >= self.group_size:
            self._flush(_graph_task())

    def _flush(self, task: int) -> None:
        xs, dys, acc = self._pending.get(task, ([], [], [None]))
        if not xs:
            return
        axis = self.op.feature_axis
        x = torch.cat(xs, dim=1 - axis)                          # rows of all steps: (G*N, C) or (C, G*N)
        dy = torch.cat(dys, dim=1 - axis)
        xs.clear()
        dys.clear()
        dw = self.op._dw(x, dy, self.dw_dtype)
        self.launches += 1
        acc[0] = dw if acc[0] is None else acc[0] + dw

    def take(self) -> tuple[torch.Tensor | None]:
        """(the summed dW of every step of the running backward pass,); forgets that pass."""
        task = _graph_task()
        self._flush(task)
        return (self._pending.pop(task, ([], [], [None]))[2][0],)

    def weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """w in ``dtype`` (cast once per sequence), for every timestep's :meth:`BlocksparseMatMul.grouped`:
        the grouped dW reaches w when the backward pass reaches this, after every step."""
        return _GroupNode.apply(self, (dtype,), w)[0]


class _StepMatMul(torch.autograd.Function):
    """One timestep: Y = X·W now, dX at once in backward, dW deferred to the group (GradGroup.add).
    Why not kernel_op: it runs the op's backend (the reference on CPU too) and hands dW to a group.
    """

    @staticmethod
    def forward(ctx, x, w, group):
        wk = _as(w, x.dtype)
        ctx.save_for_backward(x, wk)
        ctx.group = group
        return group.op._forward_raw(x, wk)

    @staticmethod
    def backward(ctx, dy):
        x, wk = ctx.saved_tensors
        dy = dy if dy.dtype == x.dtype else dy.to(x.dtype)
        dx = ctx.group.op._dx(dy, wk) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.group.add(x, dy)
        return dx, None, None
