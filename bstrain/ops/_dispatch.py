"""One op-building helper: a kernel pair in, the custom op and the eager ``autograd.Function`` out.

Every GPU entry point is reached two ways. Traced calls (torch.compile, torch.export, fake or
meta tensors) go through a ``torch.library`` custom op in the ``bstrain`` namespace with a fake
implementation and an autograd registration, so a graph sees one opaque node. Eager calls go
through an ``autograd.Function`` that calls the same launchers without the dispatcher's round
trip into Python (10–25 µs per call on the H200's host). :func:`kernel_op` builds both from one
forward and one backward, so a backward is written once::

    _bwd = kernel_op("bstrain::foo_bwd", foo_backward, ref=foo_bwd_ref, fake=_bwd_fake)
    _foo = kernel_op("bstrain::foo", foo_forward, ref=foo_ref, fake=_fake,
                     setup=_setup, backward=_grads, bwd=_bwd)
    y = _foo(x, w)           # the Function eagerly, torch.ops.bstrain.foo while tracing

- ``kernel(*args)``: the launcher call. Its annotations give the op's schema; keyword-only
  parameters (with defaults) are eager-only hints the op leaves out, so the op always runs them at
  their defaults: what an eager call knows and an op cannot say (the public function has checked
  the arguments; a backward may skip a column sum nobody asked for, or add into a
  :class:`~bstrain.ops.grouping.ParamGradGroup`'s workspace).
- ``op_kernel(*args)``: what the op runs instead of ``kernel`` where an op must differ (a custom op
  cannot return None where the launcher does); its annotations then give the schema.
- ``ref(*args)``: what the op runs on CPU tensors (the PyTorch reference), or None to run
  ``kernel`` there too. Eager calls of a CPU tensor always run ``kernel`` (Triton's interpreter
  under TRITON_INTERPRET=1): the public functions send CPU tensors here only for
  ``backend="triton"``.
- ``setup(ctx, inputs, output)``: saves what the backward needs, in both paths (it runs inside the
  Function's forward, and as the op's ``setup_context``).
- ``backward(ctx, bwd, *grads)``: the gradient glue, written once; ``bwd`` is the backward op
  while tracing and its launcher eagerly (hints passed to it as keywords reach the launcher only).
  ``ctx.hints`` holds the hints the forward was called with (``{}`` while tracing); ``setup``
  may read it too (an eager call may hand over a tensor it made for the kernels, to be saved).

Calling the KernelOp with keyword hints (``_foo(x, w, check=False)``) hands them to ``kernel`` on
the eager path and drops them on the traced one.

The op is also ``torch.ops.bstrain.<name>``; op names and schemas are what saved graphs name.
"""
from __future__ import annotations

import inspect
import types
from typing import Callable

import torch
from torch.library import infer_schema

from bstrain.ops.tables import eager

__all__ = ["KernelOp", "kernel_op"]


def _stub(*args):                             # the code object of a schema prototype (never called)
    raise AssertionError


def _schema(kernel: Callable) -> str:
    """The op schema of ``kernel``'s positional parameters, annotations read in its own module."""
    sig = inspect.signature(kernel)
    proto = types.FunctionType(_stub.__code__, kernel.__globals__, kernel.__name__)
    proto.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.kind is not p.KEYWORD_ONLY])
    return infer_schema(proto, mutates_args=())


class KernelOp:
    """A custom op and its eager ``autograd.Function`` (:func:`kernel_op`). Calling it takes the
    Function when the first argument is a plain tensor outside torch.compile, else the op."""

    def __init__(self, op, kernel: Callable, function: type[torch.autograd.Function] | None):
        self.op, self.kernel, self.function = op, kernel, function
        self.packet = getattr(getattr(torch.ops, op._namespace), op._name)   # torch.ops.bstrain.<name>: graphs name it

    def __call__(self, *args, **hints):
        if self.function is not None and eager(args[0]):
            return self.function.apply(*args, hints)
        return self.packet(*args)

    def traced(self, *args, **_hints):
        """The op itself, as a backward glue calls it while tracing: hints are eager-only."""
        return self.op(*args)


def kernel_op(name: str, kernel: Callable, *, ref: Callable | None, fake: Callable, setup: Callable | None = None,
              backward: Callable | None = None, bwd: KernelOp | tuple[KernelOp, ...] | None = None,
              op_kernel: Callable | None = None) -> KernelOp:
    """Registers ``torch.ops.<name>`` (CUDA and the other devices: ``kernel``; CPU: ``ref``; fake:
    ``fake``) and, given ``setup`` and ``backward``, its autograd and the eager Function; the
    module docstring says what each argument is. ``bwd``: the backward's own KernelOp (or a tuple
    of them), handed to ``backward`` as its op while tracing and as its launcher eagerly."""
    body = kernel if op_kernel is None else op_kernel
    op = torch.library.custom_op(name, lambda *args: body(*args), mutates_args=(), schema=_schema(body))
    if ref is not None:
        op.register_kernel("cpu")(ref)
    op.register_fake(fake)
    if backward is None:
        return KernelOp(op, kernel, None)
    if isinstance(bwd, tuple):
        traced_bwd, eager_bwd = tuple(b.traced for b in bwd), tuple(b.kernel for b in bwd)
    else:
        traced_bwd, eager_bwd = (bwd.traced, bwd.kernel) if bwd is not None else (None, None)

    def traced_setup(ctx, inputs, output):
        ctx.hints = {}
        setup(ctx, inputs, output)

    op.register_autograd(lambda ctx, *grads: backward(ctx, traced_bwd, *grads), setup_context=traced_setup)

    def forward(ctx, *args):
        *args, hints = args                       # (the hints travel last, so needs_input_grad[i] is args[i]'s)
        out = kernel(*args, **hints)
        ctx.hints = hints
        setup(ctx, args, out)
        return out

    def function_backward(ctx, *grads):
        return (*backward(ctx, eager_bwd, *grads), None)

    # named after the op (grad_fn: BiasGeluFnBackward), so the class is made by type()
    fn_name = "".join(w.title() for w in op._name.split("_")) + "Fn"
    function = type(fn_name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(function_backward), "__module__": kernel.__module__})
    return KernelOp(op, kernel, function)
