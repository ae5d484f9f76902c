"""Output allocation for every kernel launcher: ``torch.empty``, or NaN-filled under test.

A kernel that leaves an element unwritten returns whatever the allocator's memory held: often
zero in a fresh process, stale data after memory reuse. Tests turn poisoning on
(``set_poison(True)``, or ``BSTRAIN_POISON_OUTPUTS=1`` in the environment), so every output and
workspace starts as NaN and an unwritten element fails the comparison every time instead of
once in a while.
"""
from __future__ import annotations

import os

import torch

_poison = os.environ.get("BSTRAIN_POISON_OUTPUTS") == "1"


def set_poison(enabled: bool) -> None:
    """Fill every later kernel output with NaN (floats) or -1 (integers) before the launch."""
    global _poison
    _poison = bool(enabled)


def poisoning() -> bool:
    return _poison


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output or workspace for a kernel to fill: torch.empty, or poisoned under test."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)
