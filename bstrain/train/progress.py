"""Progress reporting: logging with the rank in the prefix, tqdm on rank 0, TensorBoard on rank 0."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("bstrain")


def setup_logging(run_dir: Path, rank: int = 0) -> logging.Handler:
    """Adds a file handler writing run_dir/train.log (with the rank) and returns it."""
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in log.handlers + logging.getLogger().handlers):
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
        log.addHandler(stream)
    return handler


class Progress:
    """tqdm bar when stderr is a terminal (rank 0), else a log line every ``every`` steps."""

    def __init__(self, total: int, initial: int, every: int, enabled: bool, rank: int = 0):
        self.every = max(1, every)
        self.bar = None
        if enabled and rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")

    def update(self, step: int, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", bpb=f"{metrics['bpb']:.3f}",
                                 lr=f"{metrics['lr']:.2e}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        elif step % self.every == 0:
            log.info("step %d loss %.4f bpb %.4f lr %.2e grad_norm %.3f tokens/s %.0f", step, metrics["loss"],
                     metrics["bpb"], metrics["lr"], metrics["grad_norm"], metrics["tokens_per_s"])

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        log.info(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Board:
    """One TensorBoard SummaryWriter in run_dir/tb (rank 0 only; a no-op elsewhere)."""

    def __init__(self, run_dir: Path, rank: int = 0):
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tb"))

    def start(self, config_yaml: str, command: str, layouts: dict[str, np.ndarray]) -> None:
        if self.writer is None:
            return
        self.writer.add_text("config", "```\n" + config_yaml + "\n```", 0)
        self.writer.add_text("command", command, 0)
        for name, lay in layouts.items():
            img = torch.as_tensor(np.asarray(lay, dtype=np.float32))[None]        # (1, Cb, Kb)
            self.writer.add_image(f"layout/{name}", img, 0, dataformats="CHW")

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def finish(self, hparams: dict, metrics: dict) -> None:
        if self.writer is not None:
            self.writer.add_hparams(hparams, metrics, run_name="hparams")
        self.close()
