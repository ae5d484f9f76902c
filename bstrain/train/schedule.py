"""The learning-rate schedule: a function of the step, with no scheduler object.

Linear warmup over ``optim.warmup_steps``, then cosine or linear decay to ``optim.min_lr_ratio``
at ``trainer.max_steps`` (or constant). The curve depends on ``max_steps``, so a resume that
changes it would move the whole curve and make the learning rate jump at the resume step. It
does not: past warmup, the decay restarts at the resume step from the factor the run had reached
there and ends at ``min_lr_ratio`` at the new ``max_steps``. The checkpoint keeps that restart
(:meth:`LRSchedule.state_dict`), so later resumes follow the same curve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bstrain.configs.schema import Schedule


@dataclass(frozen=True)
class Curve:
    """The ``optim`` keys the schedule reads, typed once (:meth:`of`)."""
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    schedule: Schedule

    @classmethod
    def of(cls, optim) -> Curve:
        """The curve of an ``optim`` config section (its schedule a name or the Enum)."""
        return cls(float(optim.lr), int(optim.warmup_steps), float(optim.min_lr_ratio), Schedule(optim.schedule))


def _shape(schedule: Schedule, frac: float) -> float:
    """1 at the start of the decay, 0 at its end."""
    return 0.5 * (1 + math.cos(math.pi * frac)) if schedule is Schedule.cosine else 1.0 - frac


def lr_factor(step: int, cfg, max_steps: int) -> float:
    """Linear warmup, then cosine or linear decay to min_lr_ratio (or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    schedule = Schedule(cfg.schedule)
    if schedule is Schedule.constant:
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * _shape(schedule, frac)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule is a function of the step: no scheduler object, nothing to checkpoint."""
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)                            # a device tensor a captured graph reads
        else:
            g["lr"] = lr


@dataclass
class LRSchedule:
    """The learning rate of each step for a :class:`Curve` (or the ``optim`` config section) and ``max_steps``.

    restart: (step, factor) after a resume that changed max_steps: from that step on, the decay
    runs from that factor to min_lr_ratio at max_steps.
    """
    optim: Any
    max_steps: int
    restart: tuple[int, float] | None = None

    def factor(self, step: int) -> float:
        if self.restart is None or step < self.restart[0]:
            return lr_factor(step, self.optim, self.max_steps)
        start, start_factor = self.restart
        schedule = Schedule(self.optim.schedule)
        if schedule is Schedule.constant:
            return 1.0
        frac = min(1.0, (step - start) / max(1, self.max_steps - start))
        end = self.optim.min_lr_ratio
        return end + (start_factor - end) * _shape(schedule, frac)

    def lr(self, step: int) -> float:
        return self.optim.lr * self.factor(step)

    def state_dict(self) -> dict:
        return {"max_steps": self.max_steps, "restart": list(self.restart) if self.restart else None}

    def resume(self, saved: dict, step: int) -> str | None:
        """Continues a checkpoint's schedule (its :meth:`state_dict`) at ``step`` under this run's
        max_steps, without a jump in the learning rate; returns a line saying what changed, or None."""
        restart = saved.get("restart")
        old = LRSchedule(self.optim, int(saved["max_steps"]), tuple(restart) if restart else None)
        if old.max_steps == self.max_steps:
            self.restart = old.restart
            return None
        if step < self.optim.warmup_steps or Schedule(self.optim.schedule) is Schedule.constant:
            self.restart = old.restart
            return (f"trainer.max_steps: {old.max_steps} -> {self.max_steps}: the decay after warmup now ends at "
                    f"step {self.max_steps}")
        lr = old.lr(step)
        self.restart = (step, old.factor(step))
        return (f"trainer.max_steps: {old.max_steps} -> {self.max_steps} at step {step}: the learning rate decays on "
                f"from {lr:.3g} (where the run was) to {self.optim.lr * self.optim.min_lr_ratio:.3g} at step "
                f"{self.max_steps}, without a jump")
