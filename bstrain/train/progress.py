"""Progress reporting: one log (run_dir/train.log and the console), tqdm on rank 0, TensorBoard on rank 0.

Every message goes through the ``bstrain`` logger once. The console handler writes through
``tqdm.write``, so a line never lands on the bar; while a bar is shown, the per-step lines go to
train.log only (the bar shows the same numbers).
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

log = logging.getLogger("bstrain")


class _Console(logging.Handler):
    """stderr through tqdm.write; drops per-step lines (``extra={"step_line": True}``) while a bar is up,
    and records meant for train.log only (``extra={"file_only": True}``: a traceback the console
    states in one line)."""

    bar_active = False

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "file_only", False) or getattr(record, "step_line", False) and _Console.bar_active:
            return
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def setup_logging(run_dir: Path | None, rank: int = 0, console: bool = True) -> list[logging.Handler]:
    """train.log in run_dir (with the rank in each line) and a console handler; returns them.

    Ranks other than 0 log errors only; Python warnings go to the log while the handlers are set.
    """
    handlers: list[logging.Handler] = []
    if run_dir is not None:
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
        handlers.append(file)
    if console:
        out = _Console()
        out.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s" if rank else "%(message)s"))
        handlers.append(out)
    for h in handlers:
        log.addHandler(h)
    # rank 0 says what every rank would (warnings too), once; the others only their own errors
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    log.propagate = False
    _shown_before.append(warnings.showwarning)
    warnings.showwarning = _log_warning
    return handlers


_shown_before: list = []


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning raised during a run (the model's density warning ...): one line in train.log
    and on the console, as the run's own warnings."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    log.warning("warning%s: %s", kind, message)


def remove_logging(handlers: list[logging.Handler]) -> None:
    for h in handlers:
        log.removeHandler(h)
        h.close()
    if handlers and _shown_before:
        warnings.showwarning = _shown_before.pop()


class Throughput:
    """Units (tokens, images) per second of the steps since :meth:`reset`, leaving out warm-up
    steps and paused time.

    A warm-up step (the first of a run, where torch.compile compiles, a CUDA graph is captured
    and kernels load; or any later step that compiles or captures) can take minutes: counted, it
    would make the first rate read a few hundredths of the next. Validation and checkpoints run
    under :meth:`pause`. The rate is read after the window's host sync, so the device's work of
    the counted steps is inside the elapsed time.

    ``clock``: seconds as a float (time.perf_counter; tests pass a fake one).
    """

    def __init__(self, clock=None):
        self.clock = clock or time.perf_counter
        self.reset()

    def reset(self) -> None:
        self.start, self.left_out, self.units, self.steps = self.clock(), 0.0, 0, 0
        self._step_start = None

    def begin_step(self) -> None:
        self._step_start = self.clock()

    def end_step(self, units: int, warm_up: bool = False) -> None:
        """Counts the step begun last with its ``units``, or leaves its time out (``warm_up``)."""
        if warm_up:
            self.left_out += self.clock() - (self._step_start if self._step_start is not None else self.start)
        else:
            self.units += units
            self.steps += 1
        self._step_start = None

    @contextlib.contextmanager
    def pause(self):
        """Time spent here does not count."""
        t = self.clock()
        try:
            yield
        finally:
            self.left_out += self.clock() - t

    def rate(self) -> float:
        """Units per second of the counted steps; NaN when no step was counted."""
        seconds = self.clock() - self.start - self.left_out
        return self.units / seconds if self.units and seconds > 0 else math.nan


class Progress:
    """tqdm bar when stderr is a terminal (rank 0): ``tick()`` every step, ``show()`` at log steps."""

    def __init__(self, total: int, initial: int, enabled: bool, rank: int = 0):
        self.bar = None
        if enabled and rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")
            _Console.bar_active = True

    @property
    def active(self) -> bool:
        return self.bar is not None

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def show(self, step: int, metrics: dict, metric: str | None, unit: str = "tokens", steps: int = 1) -> None:
        """The per-step line: to train.log always, to the console unless the bar shows it.
        ``metric`` is the task's metric (shown when the training metrics hold it); ``unit`` what
        ``metrics[unit + "_per_s"]`` counts (absent while only warm-up steps were timed); ``steps``
        how many steps the loss is the mean of, which the line says: ``loss 1.2345 (avg10)``
        (the number right after ``loss``, where parsers of these lines look for it)."""
        extra = f" {metric} {metrics[metric]:.4f}" if metric in metrics else ""
        rate = metrics.get(f"{unit}_per_s")
        if self.bar is not None:
            post = {f"loss(avg{steps})": f"{metrics['loss']:.3f}", "lr": f"{metrics['lr']:.2e}"}
            if metric in metrics:
                post[metric] = f"{metrics[metric]:.3f}"
            if rate is not None:
                post[f"{unit}/s"] = f"{rate:.0f}"
            self.bar.set_postfix(post)
        shown_rate = f" {unit}/s {rate:.0f}" if rate is not None else ""
        log.info("step %d loss %.4f (avg%d)%s lr %.2e grad_norm %.3f%s", step, metrics["loss"], steps, extra,
                 metrics["lr"], metrics["grad_norm"], shown_rate, extra={"step_line": True})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            _Console.bar_active = False


def layout_picture(layout, long_side: int = 256) -> np.ndarray:
    """A block layout as a uint8 image (live blocks white) of at least ``long_side`` pixels on its
    long side: each block a square of whole pixels (nearest-neighbour), so blocks stay sharp."""
    from bstrain.layout import layout_image
    base = layout_image(layout).shape                 # one pixel per block
    return layout_image(layout, scale=max(1, -(-long_side // max(base))))


class Board:
    """One TensorBoard SummaryWriter in run_dir/tb (rank 0 only; a no-op elsewhere)."""

    def __init__(self, run_dir: Path, rank: int = 0):
        self.writer = None
        self._images = None         # one worker thread: layout images are drawn and encoded off the step
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tb"))

    def start(self, config_yaml: str, command: str, layouts: dict[str, np.ndarray]) -> None:
        if self.writer is None:
            return
        self.writer.add_text("config", "```\n" + config_yaml + "\n```", 0)
        self.writer.add_text("command", command, 0)
        for name, lay in layouts.items():
            self.writer.add_image(f"layout/{name}", layout_picture(lay), 0, dataformats="HW")

    def layouts(self, step: int, layouts: dict[str, np.ndarray]) -> None:
        """Layout images at ``step`` (dynamic sparsity's updates), drawn and PNG-encoded on a worker
        thread (tens of ms for an LSTM's layouts; the training loop goes on meanwhile)."""
        if self.writer is None:
            return
        if self._images is None:
            from concurrent.futures import ThreadPoolExecutor
            self._images = ThreadPoolExecutor(1, thread_name_prefix="bstrain-board")
        copies = {name: np.array(lay, dtype=bool) for name, lay in layouts.items()}
        writer = self.writer

        def draw():
            for name, lay in copies.items():
                writer.add_image(f"layout/{name}", layout_picture(lay), step, dataformats="HW")
        def report(done):
            if done.exception() is not None:
                log.warning("tensorboard: the layout images of step %d were not written: %s", step, done.exception())
        self._images.submit(draw).add_done_callback(report)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self._images is not None:            # the images still being drawn first
            self._images.shutdown(wait=True)
            self._images = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def finish(self, hparams: dict, metrics: dict, step: int = 0) -> None:
        """The hparams view's entry, written into this run (``SummaryWriter.add_hparams`` would make
        a second run, ``tb/<name>``, in TensorBoard's run list); its metrics as scalars at ``step``."""
        if self.writer is not None:
            from torch.utils.tensorboard.summary import hparams as hparams_summaries
            for summary in hparams_summaries(hparams, metrics):     # experiment, session start, session end
                self.writer.file_writer.add_summary(summary)
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
        self.close()
