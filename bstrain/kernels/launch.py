"""Cheap launches of compiled Triton kernels.

``kernel[grid](*args, **meta)`` binds and specialises every argument, hashes a cache key and looks
the compiled kernel up on each call: about 10 µs of Python per launch, which at small sizes is
longer than the kernel runs. A :class:`Launch` does that once. Its first call goes through the
JIT (compiling if needed) and keeps the compiled kernel; later calls hand the runtime arguments
straight to the compiled kernel's launcher, as ``CompiledKernel.__getitem__`` does.

A Launch is valid only for arguments the kernel was specialised for: the same dtypes, the same
16-byte alignment of every pointer and the same integer values (the JIT specialises integers
equal to 1 and multiples of 16). Launchers therefore keep one Launch per key of those
properties, stored on the lookup tables they belong to (:func:`plan`).

Falls back to the JIT on every call under the interpreter (CPU tensors), while a launch hook is
set (profilers), on a device other than the current one, or when ``BSTRAIN_FAST_LAUNCH=0``.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

_ENABLED = os.environ.get("BSTRAIN_FAST_LAUNCH", "1") != "0"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_PLANS = 512            # per cache: shapes past this (ragged batches) evict the oldest
stats = {"direct": 0, "jit": 0}   # launches by path (tests check that the direct path is taken)


def _runtime_knobs():
    import triton
    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


_RT = _runtime_knobs()


def _active(hook) -> bool:
    """A launch hook is set: a function, or a non-empty HookChain (triton >= 3.5 keeps an empty
    chain rather than None)."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _hooks() -> bool:
    rt = _RT
    if rt is None:
        return True                    # an older triton: always go through the JIT
    return _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook)


class Launch:
    """One kernel with a fixed grid, compile-time values and options.

    ``launch(*args)`` takes the kernel's runtime arguments in signature order; the compile-time
    (constexpr) parameters must all come after them in the kernel's signature.
    """

    __slots__ = ("kernel", "grid", "consts", "const_vals", "options", "device", "_run", "_fn", "_meta")

    def __init__(self, kernel, grid: tuple[int, ...], device: torch.device, consts: dict, **options):
        names = kernel.arg_names
        first_const = min(names.index(k) for k in consts) if consts else len(names)
        if any(n not in consts for n in names[first_const:]):
            raise TypeError(f"{kernel.__name__}: constexpr parameters must come last to be launched directly")
        self.kernel, self.consts, self.options = kernel, consts, options
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.const_vals = tuple(consts[n] for n in names[first_const:])
        self.device = device
        self._run = None

    def __call__(self, *args) -> None:
        if self.device.type == "cuda" and self.device.index not in _THREAD.__dict__.setdefault("devices", set()):
            _bind_context(self.device)
        run = self._run
        if run is not None and torch._C._cuda_getDevice() == self.device.index and not _hooks():
            g = self.grid
            run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self.device.index), self._fn, self._meta,
                None, None, None, *args, *self.const_vals)
            stats["direct"] += 1
            return
        stats["jit"] += 1
        if self.device.type == "cuda" and torch._C._cuda_getDevice() != self.device.index:
            with torch.cuda.device(self.device):           # the JIT launches on the current device
                self.kernel[self.grid](*args, **self.consts, **self.options)
            return
        compiled = self.kernel[self.grid](*args, **self.consts, **self.options)
        if self._run is None and _ENABLED and not _INTERPRET and self.device.type == "cuda":
            self._run, self._fn, self._meta = compiled.run, compiled.function, compiled.packed_metadata


_THREAD = threading.local()


def _bind_context(device: torch.device) -> None:
    """Makes ``device``'s CUDA context current in this thread, once per thread and device.

    Triton encodes a call's TMA descriptors before its launcher makes the context current, so the
    first launch from a thread that has made no CUDA runtime call yet fails with 'invalid device
    context': autograd's backward thread, when a backward whose kernels were loaded on another
    thread is the first work it does. Any runtime call binds the primary context.
    """
    torch.cuda.current_stream(device).query()
    _THREAD.devices.add(device.index)


def aligned(*tensors: torch.Tensor) -> int:
    """A bit per tensor: its data pointer is a multiple of 16 bytes (what the JIT specialises on)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


def plan(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on a miss; the cache keeps at most MAX_PLANS entries."""
    p = cache.get(key)
    if p is None:
        if len(cache) >= MAX_PLANS:
            cache.pop(next(iter(cache)))
        p = cache[key] = make()
    return p


_GRAPH_PLANS = [False]


@contextlib.contextmanager
def graph_plans():
    """Within this context every family's launchers take the plans a CUDA-graph capture takes (the
    GPU-fastest ones), so that warm-up steps run before a capture compile and load every kernel
    the capture launches. ``bstrain.train.graphs.CapturedStep`` warms up inside it."""
    before = _GRAPH_PLANS[0]
    _GRAPH_PLANS[0] = True
    try:
        yield
    finally:
        _GRAPH_PLANS[0] = before


def host_bound(rows: int, limit: int, t: torch.Tensor) -> bool:
    """An eager CUDA launch over this few rows costs more host time than GPU time: take the plan
    that is cheapest to launch (one pointer-kernel launch: no TMA descriptors to encode, no
    split workspace to allocate and reduce). Not while a CUDA graph is captured, where only the
    GPU time counts, nor inside :func:`graph_plans`."""
    return rows <= limit and t.is_cuda and not _GRAPH_PLANS[0] and not torch.cuda.is_current_stream_capturing()
