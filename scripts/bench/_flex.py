"""FlexAttention at its strongest, for the scripts that time it against bstrain (issue 41).

Flex's speed depends on choices a plain ``torch.compile(flex_attention)`` leaves at their defaults:
the compile mode (max-autotune searches Flex's tiles), the BlockMask's block size (128 by
default; 64 matches bstrain's smaller blocks) and the kernel backend: Triton, or FLASH (the
CuTe-DSL kernels of flash-attn-4, which torch's inductor imports as ``flash_attn.cute``; the GPU
machine lacks it unless ``scripts/gpu/stage_fa4.sh`` installed it). The helpers here name those
choices once, so every row records which it ran with.
"""
from __future__ import annotations

import importlib.util

# Flex's own tiles at a BlockMask of 64: its kernels need tiles no larger than the mask's blocks.
TILES_64 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64)


def flash_status() -> tuple[bool, str]:
    """(usable, what): whether Flex's FLASH backend can run here, and the flash-attn-4 version or
    why not (written into the result tables)."""
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return False, "FLASH absent: flash-attn-4 (flash_attn.cute) is not installed (scripts/gpu/stage_fa4.sh)"
    except ModuleNotFoundError:
        return False, "FLASH absent: flash-attn-4 (flash_attn.cute) is not installed (scripts/gpu/stage_fa4.sh)"
    except (ImportError, ValueError) as exc:
        return False, f"FLASH absent: flash_attn.cute does not import ({type(exc).__name__}: {exc})"
    try:
        from torch._inductor.kernel.flex import flex_flash_attention  # noqa: F401
    except ImportError as exc:
        return False, f"FLASH absent: this torch has no flex FLASH backend ({exc})"
    try:
        from importlib.metadata import version
        return True, f"FLASH: flash-attn-4 {version('flash-attn-4')}"
    except Exception:                                   # installed without metadata (a --target copy)
        return True, "FLASH: flash-attn-4 (version unknown)"


def backends(choice: str) -> list[str]:
    """The Flex backends to try for ``--flex-backend`` ``choice``: auto (FLASH where it can run,
    then Triton), flash, triton."""
    choice = choice.lower()
    if choice not in ("auto", "flash", "triton"):
        raise ValueError(f"--flex-backend: expected auto, flash or triton, got {choice!r}")
    if choice == "auto":
        return ["FLASH", "TRITON"] if flash_status()[0] else ["TRITON"]
    return [choice.upper()]


def kernel_options(block: int, backend: str) -> dict | None:
    """Flex's kernel_options for a BlockMask of ``block`` and ``backend`` (FLASH or TRITON); None:
    Flex's defaults (Triton at block 128)."""
    opts = dict(TILES_64) if block == 64 and backend == "TRITON" else {}
    if backend == "FLASH":
        opts["BACKEND"] = "FLASH"
    return opts or None


def describe(block: int, backend: str, compile_mode: str | None) -> dict:
    """The record of one Flex configuration, for a row of a result table."""
    return {"flex_block": block, "flex_backend": backend, "flex_kernel_options": kernel_options(block, backend),
            "flex_compile": compile_mode or "default"}
