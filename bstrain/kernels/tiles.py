"""Tile configs of the kernel families (matmul, conv, attention), in one convention.

A :class:`Tile` says how one kernel is tiled and launched. Each family has one
:class:`TileTable`, keyed by ``(kernel, block size, operand itemsize, ...)``, whose lookup gives
an override if one is set and else the family's default (literal tables swept on the H200, or a
short rule where the choice follows the shape). :func:`override` (and :func:`overridden`, its
context manager) is the one hook that changes a tile: ``scripts/tune_*.py`` and the tests write
through it. Every change bumps :func:`version`, which every family's launch-plan key holds, so a
plan made before an override is never reused after it. This is the static, graph-safe
counterpart of ``triton.Config`` lists under ``@triton.autotune``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Tile:
    """One kernel's tiling and launch options.

    ``block_m``: rows a program holds (matmul ds: rows of A, BLOCK_M; conv: pixels, BLOCK_M;
    attention: BO outer rows; unused, 0, by matmul dW). ``block_n``: the rows or columns it steps
    through (matmul ds: the reduction width KC, part of a block or several packed; matmul dW:
    BLOCK_N rows of the N reduction; attention: BI inner rows; 0 for conv, whose step is a
    block). ``warps``, ``stages``: num_warps and pipeline stages. ``tma``: loads through tensor
    descriptors (Hopper's copy engine) where the inputs allow it. ``group``: matmul dW's live
    blocks of one column stacked in one program.
    """
    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    group: int = 1

    def replace(self, **changes) -> Tile:
        return dataclasses.replace(self, **changes)


_VERSION = [0]


def version() -> int:
    """Bumped by every override: launch plans hold it in their keys."""
    return _VERSION[0]


class TileTable:
    """One family's tiles: ``table(*key, **hints)`` is the override of ``key`` if set, else
    ``default(*key, **hints)`` (``hints``: what the default may use beyond the key, such as a
    layout's shape; an override holds whatever they are)."""

    def __init__(self, family: str, default: Callable[..., Tile]):
        self.family, self.default = family, default
        self.overrides: dict[tuple, Tile] = {}
        TABLES[family] = self

    def __call__(self, *key, **hints) -> Tile:
        hit = self.overrides.get(key)
        return hit if hit is not None else self.default(*key, **hints)


TABLES: dict[str, TileTable] = {}


def override(family: str, key: tuple, tile: Tile | None) -> Tile | None:
    """Sets the tile of ``key`` in ``family``'s table (None: back to the default); returns the
    override it replaces (None if there was none)."""
    table = TABLES[family].overrides
    before = table.pop(tuple(key), None)
    if tile is not None:
        if not isinstance(tile, Tile):
            raise TypeError(f"tile: expected a Tile, got {tile!r}")
        table[tuple(key)] = tile
    _VERSION[0] += 1
    return before


@contextlib.contextmanager
def overridden(family: str, key: tuple, tile: Tile | None):
    """:func:`override` within the block; the previous state after it."""
    before = override(family, key, tile)
    try:
        yield
    finally:
        override(family, key, before)


# ---------------------------------------------------------------------------------------------
# Matmul: key (kernel, block size, itemsize, on CUDA). kernel "ds" (forward and dX), "ds_small_m"
# (M <= SMALL_M), "ds_few" (output blocks of few reduction steps), "dw", "panel"; the itemsize
# (of W, dY for dW) does not change the defaults. GPU tiles from a sweep on an H200
# (scripts/bench/bench_matmul.py --sweep); CPU ones (the interpreter) are small to keep it quick and
# cover packing, kc < bs and both load paths.
_MATMUL_GPU = {
    "ds": {8: Tile(256, 64, 8, 3), 16: Tile(256, 64, 8, 3), 32: Tile(256, 32, 8, 3, True),
           64: Tile(128, 64, 4, 3, True), 128: Tile(128, 64, 4, 3, True)},
    "ds_small_m": {8: Tile(64, 64, 4, 4), 16: Tile(64, 64, 4, 4), 32: Tile(64, 32, 4, 4, True),
                   64: Tile(64, 64, 4, 6, True), 128: Tile(64, 128, 4, 4, True)},
    "dw": {8: Tile(0, 64, 4, 3, group=16), 16: Tile(0, 64, 4, 3, group=8), 32: Tile(0, 64, 8, 3, group=8),
           64: Tile(0, 32, 8, 4, group=2), 128: Tile(0, 64, 4, 4, True)},
}
# few reduction steps per output block (low density): pipeline fill dominates each tile; a
# shallower pipeline won 8% at bs=64 and 5% density
_MATMUL_GPU["ds_few"] = {**_MATMUL_GPU["ds"], 64: Tile(128, 64, 4, 2, True)}
_MATMUL_CPU = {
    "ds": {8: Tile(32, 32, 4, 1), 16: Tile(32, 32, 4, 1), 32: Tile(32, 32, 4, 1, True),
           64: Tile(32, 64, 4, 1, True), 128: Tile(32, 64, 4, 1, True)},
    "dw": {8: Tile(0, 16, 4, 1, group=4), 16: Tile(0, 16, 4, 1, group=2), 32: Tile(0, 16, 4, 1, group=2),
           64: Tile(0, 16, 4, 1, True), 128: Tile(0, 16, 4, 1, True)},
}


def _matmul_default(kernel: str, bs: int, itemsize: int, cuda: bool) -> Tile:
    if kernel == "panel":                 # output panels: block_n is the panel's width, not tiled
        return Tile(128, 0, 8, 3) if cuda else Tile(32, 0, 4, 1)
    if not cuda and kernel.startswith("ds"):
        kernel = "ds"                      # the interpreter has one ds tile per block size
    return (_MATMUL_GPU if cuda else _MATMUL_CPU)[kernel][bs]


MATMUL = TileTable("matmul", _matmul_default)


# ---------------------------------------------------------------------------------------------
# Conv: key (kernel, block size, itemsize). kernel "fwd", "dx", "dw" (pointer loads) or "fwd_tma",
# "dx_tma", "dw_tma" (stride 1, channels-last, 16-bit); fp32 tiles take twice the shared memory
# (fewer stages). The pointer-load tiles are untimed guesses but for 16-bit dW.
def _conv_default(kernel: str, bs: int, itemsize: int) -> Tile:
    if kernel.endswith("_tma"):                        # H200 sweep, 2026-11-30 (scripts/tune/tune_conv.py)
        if bs >= 128:
            return Tile(128, 0, 8, 2)
        if kernel == "dw_tma":
            return Tile(128, 0, 4, 4) if bs >= 64 else Tile(128, 0, 4, 3)
        return Tile(128, 0, 4, 2)
    if itemsize == 4 or bs >= 128:
        return Tile(64, 0, 8 if bs >= 128 else 4, 2)
    if kernel == "dw":                                  # H200 sweep, 2026-11-30 (benchmarks/conv.md)
        return Tile(128, 0, 8, 3) if bs >= 64 else Tile(64, 0, 4, 2)
    return Tile(128, 0, 4, 3)


CONV = TileTable("conv", _conv_default)


# ---------------------------------------------------------------------------------------------
# Attention: key (kernel, block size, itemsize, padded head dim): kernel "fwd", "dq" or "dkdv";
# the head dim is the larger of q's and v's, padded to a power of two. Hint ``plain``: the
# layout's blocks are all full or triangular (no mask table). Warp specialisation is not offered:
# Triton 3.6 fails to compile these loops with it on the H200 (an assertion in WSLowerToken).
def _attention_default(kernel: str, bs: int, itemsize: int, block_d: int, plain: bool = False) -> Tile:
    if itemsize == 4:                                   # fp32 operands: small tiles (shared memory)
        return Tile(min(bs, 64), min(bs, 32), 4, 2)
    # swept on the H200 (benchmarks/attention_tune.json): 64x64 tiles, 4 warps and descriptors for
    # every kernel and head dim, except the forward of plain 128-blocks at D=128 (causal: -10%),
    # where 128x128 tiles on 8 warps win; finer tiles drop the dead parts of masked blocks
    # (strided: 128-row tiles take 1.9x as long)
    if kernel == "fwd" and plain and bs == 128 and block_d == 128:
        return Tile(128, 128, 8, 3, True)
    b = min(bs, 64)
    return Tile(b, b, 4, 3, True)


ATTENTION = TileTable("attention", _attention_default)
