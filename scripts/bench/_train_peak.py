"""``python -m bstrain`` with one line more per process at exit: its peak GPU memory.

    torchrun --standalone --nproc_per_node=N scripts/bench/_train_peak.py train config=... [key=value ...]

The trainer logs rank 0's lines only; ``bench_multigpu.py`` needs every rank's peak
(``torch.cuda.max_memory_allocated``), so each process prints ``peak_mem_gib rank R X`` as it exits.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys

import torch


def _peak() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = torch.cuda.max_memory_allocated() / 2 ** 30
        print(f"peak_mem_gib rank {os.environ.get('RANK', '0')} {gib:.3f}", flush=True)


if __name__ == "__main__":
    atexit.register(_peak)
    sys.argv = ["bstrain", *sys.argv[1:]]
    runpy.run_module("bstrain", run_name="__main__", alter_sys=True)
