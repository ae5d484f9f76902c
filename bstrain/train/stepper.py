"""How the trainer's steps run: ``trainer.cuda_graph`` parsed once into a :class:`GraphMode`, and
the one :class:`Stepper` the loop calls (a graph, a graph armed for a sparsity update, or eager).

``auto`` captures the whole step in one CUDA graph where it can (a CUDA device, a step that can
be captured) and trains eagerly where it cannot, with one log line saying why; ``true`` insists
(a graph or an error); ``false`` trains eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from bstrain.errors import UserError
from bstrain.train.distributed import World, gather
from bstrain.train.graphs import CapturedStep, CaptureError, GraphedForward, check_graph_config, ema_update
from bstrain.train.step import Forward, train_step

log = logging.getLogger("bstrain")

_SYNONYMS = {"1": "true", "0": "false", "yes": "true", "no": "false", "on": "true", "off": "false"}


class GraphMode(Enum):
    """trainer.cuda_graph: auto | true | false."""
    auto = "auto"
    true = "true"
    false = "false"

    @classmethod
    def parse(cls, value) -> GraphMode:
        """The mode a config value names; YAML and the command line may give a bool or a string
        (1/0, yes/no, on/off too). UserError for anything else."""
        mode = str(getattr(value, "value", value)).strip().lower()
        mode = _SYNONYMS.get(mode, mode)
        if mode not in cls._value2member_map_:
            raise UserError(f"trainer.cuda_graph: expected auto, true or false, got {value!r}")
        return cls(mode)


def eager_reason(mode: GraphMode, device: torch.device, strategy=None) -> str | None:
    """Why this run will not capture its step, or None where it will try: ``false``, ``auto``
    off a CUDA device or where the strategy (:mod:`bstrain.train.strategy`) cannot be captured
    (``true`` there is a UserError). Whether the model can be captured is found at the first step."""
    if mode is GraphMode.false:
        return "trainer.cuda_graph=false"
    reason = check_graph_config(device)
    if reason is None and strategy is not None:
        reason = strategy.why_not_graphed()
    if reason is not None and mode is GraphMode.true:
        raise UserError(f"trainer.cuda_graph=true: {reason} (auto graphs where it can, false never)")
    return reason


@dataclass(frozen=True)
class StepMode:
    """How the steps run: replayed from a CUDA graph or eager, the model compiled or not."""
    graph: bool = False
    compiled: bool = False

    def __str__(self) -> str:
        """'graph', 'eager', 'graph (compiled)' or 'eager (compiled)': the run result's step_mode."""
        return ("graph" if self.graph else "eager") + (" (compiled)" if self.compiled else "")


@dataclass
class StepParts:
    """What a training step reads and updates; built once per run (bstrain.train.run.build).

    forward: the model's forward (compiled, DDP) the steps run; task: gives ``loss(output, y)``
    and ``batch_metrics(output, y)``; params: the parameters clipped in an eager step, in the
    model's order; world: under DDP, every rank falls back alike (the first rank's reason);
    hooks: the sparsity policy's :class:`bstrain.train.sparsity.GradientHooks`, or None; forward_hooked: the uncompiled forward, for
    armed steps of a compiled model (whose hooks added after compilation would not run); None:
    ``forward``.
    """
    forward: Forward
    task: Any
    optimizer: torch.optim.Optimizer
    params: list
    model: torch.nn.Module
    scaler: torch.amp.GradScaler
    grad_clip: float = 0.0
    ema: Any = None
    ema_decay: float = 0.0
    world: World = field(default_factory=World)
    hooks: Any = None
    forward_hooked: Forward | None = None


class Stepper:
    """One training step, however it runs: ``step(x, y, state, armed)``. Built once per run.

    With graphs (``why_eager`` None: see :func:`eager_reason`), the first batch captures the whole
    step (:class:`bstrain.train.graphs.CapturedStep`) and later batches of its shape replay it;
    where the step cannot be captured, ``trainer.cuda_graph=auto`` falls back to eager for the
    rest of the run (one log line says why: ``reason``), ``true`` raises. A step ``armed`` for a
    sparsity update (RigL's gradient hooks, :mod:`bstrain.train.sparsity`) replays a capture of its
    own, made with the hooks armed, or runs eagerly where that cannot be captured. ``mode`` says
    how the steps run now; ``reason`` why they (or the armed ones) run eagerly, or None.

    Args:
        parts: what the step reads and updates (:class:`StepParts`).
        graph_mode: trainer.cuda_graph, parsed.
        why_eager: :func:`eager_reason` for this run's mode and device.
        compiled: the model is compiled (for ``mode``).
    """

    def __init__(self, parts: StepParts, graph_mode: GraphMode, why_eager: str | None, compiled: bool = False):
        self.parts, self.graph_mode = parts, graph_mode
        self.forward, self.forward_hooked, self.model, self.params = (parts.forward, parts.forward_hooked, parts.model,
                                                                     parts.params)
        self.optimizer, self.scaler, self.ema, self.world, self.hooks = (parts.optimizer, parts.scaler, parts.ema,
                                                                         parts.world, parts.hooks)
        self.mode = StepMode(graph=False, compiled=compiled)
        self.reason: str | None = why_eager                 # why the step (or the armed one) runs eagerly
        self.captured: CapturedStep | None = None
        if why_eager is None:
            self.captured = CapturedStep(parts.forward, parts.task.loss, parts.optimizer, parts.grad_clip,
                                         parts.task.batch_metrics, warmup=11 if parts.world.active else 2,
                                         scaler=parts.scaler, ema=parts.ema, ema_decay=parts.ema_decay,
                                         model=parts.model)
        self.captured_armed: CapturedStep | None = None     # the armed step's capture (made when first run)
        self.armed_eager = False                            # that step could not be captured: it runs eagerly
        self.warming_up = False                             # this step captured a graph: not throughput
        self._kinds: set = set()        # graphs captured once: a recapture (new layout tables after a
                                        # sparsity update) is training time, not warm-up
        self._eval_forwards: dict = {}  # graphed evaluation forwards, per model

    @property
    def armed(self) -> bool:
        """Whether the coming step is armed for a sparsity update (its gradients read through hooks)."""
        return self.hooks is not None and self.hooks.armed

    def eval_forward(self, forward: Forward, model: torch.nn.Module):
        """The evaluation forward of ``model``: graphed (one per model, kept until the graphs are
        dropped) where the step is, for the same static shapes; else ``forward`` itself."""
        if self.captured is None:
            return forward
        return self._eval_forwards.setdefault(id(model), GraphedForward(forward))

    @property
    def graphed(self) -> bool:
        """Whether the step is (to be) captured: then the evaluation forward is graphed too."""
        return self.captured is not None

    def step(self, x: torch.Tensor, y: torch.Tensor, state, armed: bool = False):
        """One optimizer step at the optimizer's current learning rate on (x, y), carrying
        ``state`` (a stateful model's; None: a fresh one). Returns (loss, grad norm, the task's
        batch metrics, the new state, fp16's skip flag or None), all on the device."""
        cap = self._graph_for(x, y, armed)
        if cap is not None:                                 # the whole step in one graph replay
            return self._replay(cap, x, y, state)
        return self._eager(x, y, state, armed)              # (or a batch of another shape than the graph's)

    def _replay(self, cap: CapturedStep, x: torch.Tensor, y: torch.Tensor, state):
        armed = cap is not self.captured
        if armed and state is not None:
            cap.load_state(state, x)                        # the carried state, from the other graph's buffers
        loss, grad_norm, metrics, skipped = cap.step(x, y, reset_state=state is None)
        # the graph's outputs are overwritten by the next replay
        loss, grad_norm, metrics = loss.clone(), grad_norm.clone(), {k: v.clone() for k, v in metrics.items()}
        state = cap.state
        if armed:
            self.hooks.after_replay()                       # the gradient sums this replay wrote
            if state is not None:
                self.captured.load_state(state, x)
        return loss, grad_norm, metrics, state, skipped if self.scaler.is_enabled() else None

    def _eager(self, x: torch.Tensor, y: torch.Tensor, state, armed: bool):
        if self.captured is not None:                       # a replay leaves its gradients in .grad: not added to
            self.optimizer.zero_grad(set_to_none=True)
        forward = self.forward
        if armed:                                           # RigL's hooked step: its sums start over
            self.hooks.before_step()
            forward = self.forward_hooked or forward
        scaler = self.scaler
        scale = scaler._scale.clone() if scaler.is_enabled() and scaler._scale is not None else None
        parts = self.parts
        loss, grad_norm, state, metrics = train_step(forward, parts.task.loss, x, y, state, self.optimizer, self.params,
                                                     parts.grad_clip, scaler, metrics_fn=parts.task.batch_metrics)
        skipped = (scaler._scale < scale).int() if scale is not None else None   # fp16: a lowered scale
        if self.ema is not None:
            ema_update(self.ema, self.model, parts.ema_decay)
        if self.captured is not None and state is not None and self.captured.matches(x, y):
            self.captured.load_state(state, x)              # the graph's next replay carries this state on
        return loss, grad_norm, metrics, state, skipped

    def load_state(self, state, x: torch.Tensor) -> None:
        """A carried state (from a checkpoint) for the graph's next replay."""
        if self.captured is not None:
            self.captured.load_state(state, x)

    def drop_graphs(self) -> None:
        """The layers have new tables: the graphs made on the old ones (the step's and the
        evaluation forwards) are captured again when next needed."""
        for captured in (self.captured, self.captured_armed):
            if captured is not None:
                captured.drop()
        self._eval_forwards.clear()

    def _graph_for(self, x: torch.Tensor, y: torch.Tensor, armed: bool) -> CapturedStep | None:
        """The captured step this batch replays (captured now if this is its first), or None: eager.
        The step before a RigL update has a capture of its own, with the gradient hooks armed."""
        if self.captured is None:
            return None
        if armed:
            if self.armed_eager:
                return None
            if self.captured_armed is None:
                self.captured_armed = self.captured.twin(before_step=self.hooks.before_step,
                                                         forward=self.forward_hooked)
            if self.captured_armed.graph is None and not self._start_armed_graph(x, y):
                return None
            cap = self.captured_armed
        else:
            if self.captured.graph is None:
                self._start_graph(x, y)
                if self.captured is None:
                    return None
            cap = self.captured
        return cap if cap.matches(x, y) else None

    def _capture(self, captured: CapturedStep, kind: str, x: torch.Tensor, y: torch.Tensor) -> str | None:
        """Captures ``captured`` on this batch; None, or why it cannot be (under DDP the first rank's
        reason on every rank, so that all fall back alike)."""
        reason = None
        try:
            captured.prepare(x, y)
        except CaptureError as exc:
            reason = str(exc)
        if self.world.active:
            reasons = [r for r in gather(reason, self.world) if r]
            reason = reasons[0] if reasons else None
        self.warming_up = kind not in self._kinds
        self._kinds.add(kind)
        return reason

    def _start_armed_graph(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Captures the step with the policy's gradient hooks armed; where it cannot be, that step
        runs eagerly from now on, with one log line saying why (every rank alike under DDP)."""
        reason = self._capture(self.captured_armed, "armed", x, y)
        if reason is None:
            self.hooks.after_capture()                      # the gradient sums the captured run writes
            self.mode = replace(self.mode, graph=True)      # (every step may be armed: sparsity.every=1)
            return True
        self.captured_armed, self.armed_eager, self.reason = None, True, reason
        log.info("sparsity: the step before each update runs eagerly; it could not be captured: %s", self.reason)
        return False

    def _start_graph(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Captures the step on the first batch (or again, after a sparsity update gave the layers
        new tables). Where it cannot be (auto), the run trains eagerly from now on, ``mode`` says
        so, and one log line names why; under DDP every rank falls back if any must."""
        reason = self._capture(self.captured, "step", x, y)
        if reason is None:
            self.mode = replace(self.mode, graph=True)
            log.info("step: one CUDA graph per step (trainer.cuda_graph=%s)", self.graph_mode.value)
            return
        self.captured, self.reason = None, reason
        self.mode = replace(self.mode, graph=False)         # a failed recapture: the steps from now on are eager
        if self.graph_mode is GraphMode.true:
            raise UserError(f"trainer.cuda_graph=true: the step cannot be captured: {self.reason}")
        log.info("step: eager; trainer.cuda_graph=auto could not capture it: %s", self.reason)

    def pop_warm_up(self) -> bool:
        """Whether the step just run captured a graph for the first time (then its time is warm-up,
        not throughput); cleared by the call."""
        warm, self.warming_up = self.warming_up, False
        return warm
