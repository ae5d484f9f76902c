"""The input checks every op file shares, and the choice between an op's Triton kernel and PyTorch.

Private to ``bstrain.ops`` (hence the module's underscore); the names inside are what the op files
import. Their messages name the argument first (``"x: expected ..."``): tests match on them.
"""
from __future__ import annotations

import os

import torch

from bstrain.ops.tables import eager

__all__ = [
    "FLOATS", "KERNEL_FLOATS", "HALF", "INDEX_DTYPES", "BACKENDS", "DTYPE_BOUND", "use_kernels", "check_index_range",
    "unit_columns", "check_tensor", "check_same", "check_param", "check_axis", "as_index",
]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)   # what the Triton kernels take
HALF = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint16, torch.uint8)
BACKENDS = ("auto", "triton", "torch")
DTYPE_BOUND = {torch.uint8: 256, torch.uint16: 65536}       # every value of these dtypes is below this


def use_kernels(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an op with a Triton kernel runs it on x: the ``backend=`` argument of every such op.

    "auto": on CUDA for fp32/fp16/bf16; "torch": never; "triton": always (on the CPU through
    Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is imported).

    Test-only switch: with BSTRAIN_FORCE_TRITON=1 and TRITON_INTERPRET=1 in the environment, "auto"
    takes the kernels on CPU tensors too, so the test suite can route whole models (whose layers
    call these ops with the default backend) through the interpreted kernels and custom ops.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    floating = x.dtype in KERNEL_FLOATS
    if backend == "auto":
        return floating and (x.is_cuda or (os.environ.get("BSTRAIN_FORCE_TRITON") == "1"
                                            and os.environ.get("TRITON_INTERPRET") == "1"))
    if not floating:
        raise TypeError(f"x: the Triton backend takes float32, float16 or bfloat16, got {x.dtype}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x: backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a tensor on {x.device}")
    return True


def check_index_range(name: str, idx: torch.Tensor, n: int) -> None:
    """ValueError unless every value of ``idx`` lies in [0, n).

    One host sync on CUDA, so it is skipped where the values cannot be read: while a CUDA graph
    is captured, where syncs are reported as errors (``torch.cuda.set_sync_debug_mode``, which
    a graph's last warm-up step sets), and while tracing (torch.compile, export; the indexing op then asserts on the
    device). :func:`as_index` skips it for dtypes whose every value is below n (bytes into a
    256-row table).
    """
    if not eager(idx):
        return
    if idx.numel() and not (idx.is_cuda and (torch.cuda.is_current_stream_capturing()
                                             or torch.cuda.get_sync_debug_mode() == 2)):
        lo, hi = torch.stack(torch.aminmax(idx)).tolist()
        if lo < 0 or hi >= n:
            raise ValueError(f"{name}: expected values in [0, {n}), got [{lo}, {hi}]")


def unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last axis (a copy only if it has another): what the row kernels
    take. Custom-op bodies call it, since a compiler may hand them inputs of any strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_tensor(name: str, x) -> None:
    """TypeError unless x is a floating torch.Tensor (fp32, fp16, bf16 or fp64)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")


def check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    """Each of xs a floating tensor (:func:`check_tensor`), all of the first one's dtype and device;
    ``names`` name them in the messages."""
    for name, x in zip(names, xs):
        check_tensor(name, x)
    for name, x in zip(names[1:], xs[1:]):
        if x.dtype != xs[0].dtype:
            raise TypeError(f"{name}: expected dtype {xs[0].dtype} (as {names[0]}), got {x.dtype}")
        if x.device != xs[0].device:
            raise ValueError(f"{name}: expected device {xs[0].device} (as {names[0]}), got {x.device}")


def check_param(name: str, p, x: torch.Tensor, numel: int) -> torch.Tensor:
    """A seed-style parameter (bias, gain, gate bias) of activation x, as a flat (numel,) tensor.

    As in the seed, any shape with ``numel`` elements is accepted ((K,), (1, K), (K, 1), ...), in
    x's dtype or, for fp16/bf16 activations, in float32 (mixed-precision master parameters; the
    op then computes in fp32 and returns x's dtype).
    """
    check_tensor(name, p)
    if p.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements (shape ({numel},), (1, {numel}) or any shape of "
                         f"that size) for x {tuple(x.shape)}, got shape {tuple(p.shape)}")
    if p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in HALF):
        raise TypeError(f"{name}: expected dtype {x.dtype} (as x), or float32 with 16-bit x, got {p.dtype}")
    if p.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (as x), got {p.device}")
    return p if p.dim() == 1 else p.reshape(numel)


def check_axis(name: str, axis, ndim: int) -> int:
    """A feature axis of an ndim-D tensor, negative values counted from the end, as 0..ndim-1."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected an int axis in [{-ndim}, {ndim}) for a {ndim}-D x, got {axis!r}")
    return axis % ndim


def as_index(name: str, idx, n: int) -> torch.Tensor:
    """An integer index tensor (int64/32/16, uint16 or uint8, as the seed's) checked to lie in
    [0, n), as int64. uint8 is converted before use: torch would read it as a boolean mask."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int64, int32, int16, uint16 or uint8 tensor, got "
                        f"{getattr(idx, 'dtype', type(idx).__name__)}")
    if DTYPE_BOUND.get(idx.dtype, n + 1) > n:          # else every value of the dtype is in range
        check_index_range(name, idx.long(), n)
    return idx.long()
