"""CUDA graphs: a whole training step (or any function of tensors) captured once and replayed.

A sparse model's step launches hundreds to thousands of small kernels; in eager mode the host
(Python, autograd, launch calls: about 50 µs per autograd-tracked launch) rather than the GPU sets
the pace. Replaying a captured graph launches the whole step at once.

- :func:`graphed` (exported as ``bstrain.graphed``) captures any function of CUDA tensors, such as
  a research loop's training step, with static input buffers.
- :class:`CapturedStep` is the trainer's step (forward, backward, fp16 loss scaling and its
  overflow check, clipping, AdamW, EMA, the carried state), used by default on CUDA
  (``trainer.cuda_graph=auto``).
- :class:`GraphedForward` replays the evaluation forward for each static batch shape.

What a captured function must do: no host syncs (``.item()``, printing a tensor, data-dependent
shapes), the same shapes at every call, no Python-side state that changes per call (a counter
read by ``forward``), and optimizers built with ``capturable=True`` (fused AdamW on CUDA). Every
bstrain op is capture-safe: its kernels are compiled and its plans made in the warm-up calls,
which run inside :func:`bstrain.kernels.launch.graph_plans`.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._pytree import tree_map

from bstrain.nn._sparse import layout_buffers
from bstrain.train.step import Forward, state_tensors, train_step, unwrap

log = logging.getLogger("bstrain")

__all__ = ["graphed", "Graphed", "CapturedStep", "GraphedForward", "CaptureError", "check_graph_config", "ema_decay",
           "ema_update"]


class CaptureError(RuntimeError):
    """A step cannot be captured; the message names the reason (the trainer's fallback logs it)."""


def _graph_plans():
    try:
        from bstrain.kernels.launch import graph_plans       # triton is needed only on CUDA
    except ImportError:
        return contextlib.nullcontext()
    return graph_plans()


# --- state saved before the warm-up calls and put back after them ------------------------------------
class Snapshot:
    """Parameters, buffers, optimizer state, loss-scaler state and extra tensors, copied now and
    written back in place by :meth:`restore`, with the CUDA RNG state.

    Optimizer state that did not exist when the snapshot was taken (created by the warm-up's first
    step) goes back to AdamW's initial state: zeros, step 0. In place, so that a graph captured
    after the restore updates the very tensors the optimizer and its checkpoints hold.
    """

    def __init__(self, objects, device: torch.device, extra: list[torch.Tensor] = ()):
        self.device = device
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fresh: list[torch.Tensor] = []             # optimizer state made after the snapshot: zeroed
        self.optimizers: list[tuple[torch.optim.Optimizer, set]] = []
        for obj in objects:
            if isinstance(obj, torch.nn.Module):       # layouts do not change in a warm-up: left alone
                layouts = layout_buffers(obj)
                self._keep(list(obj.parameters()) + [b for b in obj.buffers() if id(b) not in layouts])
            elif isinstance(obj, torch.optim.Optimizer):
                params = [p for g in obj.param_groups for p in g["params"]]
                had = {id(p) for p in params if obj.state.get(p)}
                self.optimizers.append((obj, had))
                self._keep([v for p in params for v in obj.state.get(p, {}).values() if isinstance(v, torch.Tensor)])
                self._keep([g["lr"] for g in obj.param_groups if isinstance(g["lr"], torch.Tensor)])
            elif isinstance(obj, torch.amp.GradScaler):
                self._keep([t for t in (obj._scale, obj._growth_tracker) if t is not None])
            elif obj is not None:
                raise TypeError(f"restore: expected modules, optimizers or GradScalers, got {type(obj).__name__}")
        self._keep(list(extra))
        self.rng = torch.cuda.get_rng_state(device)

    def _keep(self, tensors) -> None:
        self.tensors += [(t, t.detach().clone()) for t in tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for opt, had in self.optimizers:
                for g in opt.param_groups:
                    for p in g["params"]:
                        if id(p) in had:
                            continue
                        for v in opt.state.get(p, {}).values():
                            if isinstance(v, torch.Tensor):
                                v.zero_()
        torch.cuda.set_rng_state(self.rng, self.device)


def _python_state(modules) -> dict:
    """Each module's plain Python attributes (numbers, strings, tuples): a forward that changes one
    per call would be frozen at its captured value by a graph."""
    out = {}
    for m in modules:
        for name, mod in m.named_modules():
            for k, v in vars(mod).items():
                if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, type(None))):
                    out[(name, k)] = v
    return out


def _changed(before: dict, after: dict) -> str | None:
    for key, v in after.items():
        if key in before and before[key] != v:
            name, attr = key
            return (f"module {name or '(root)'} changes its attribute {attr!r} at every call ({before[key]!r} -> "
                    f"{v!r}); a graph would replay the captured value")
    return None


def _reason(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())[:300]
    if "captur" in msg.lower() or "synchroniz" in msg.lower():
        msg += (" (a host sync in the step: .item(), .tolist(), printing a tensor, a data-dependent shape or a "
                "CPU tensor made from GPU values)")
    return f"{type(exc).__name__}: {msg}"


def _capture(run_once, warmup: int, device: torch.device, snapshot: Snapshot | None, modules=(),
             pool=None, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm-up calls on a side stream, undone by ``snapshot``; then one capture. Returns (graph,
    the captured call's outputs). CaptureError names why it could not be captured."""
    before = _python_state(modules)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    debug = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.stream(side), _graph_plans():      # every kernel of the capture compiled and loaded
            for i in range(warmup):
                if i == warmup - 1:                        # warm now: a host sync left is the step's own
                    torch.cuda.set_sync_debug_mode("error")
                run_once()
        torch.cuda.current_stream(device).wait_stream(side)
    except Exception as exc:
        torch.cuda.synchronize(device)
        if snapshot is not None:
            snapshot.restore()
        sync = torch.cuda.get_sync_debug_mode() != debug
        raise CaptureError(("the step syncs with the host: " if sync else "the warm-up step failed: ")
                           + _reason(exc)) from exc
    finally:
        torch.cuda.set_sync_debug_mode(debug)
    if (why := _changed(before, _python_state(modules))) is not None:
        if snapshot is not None:
            snapshot.restore()
        raise CaptureError(why)
    if snapshot is not None:
        snapshot.restore()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
            out = run_once()
    except Exception as exc:
        torch.cuda.synchronize(device)
        _heal_rng(device)
        if snapshot is not None:
            snapshot.restore()
        raise CaptureError(f"capture failed: {_reason(exc)}") from exc
    return graph, out


def _heal_rng(device: torch.device) -> None:
    """A capture that fails leaves the CUDA generator in capture mode (its epilogue never ran),
    and every later random op then fails; one empty capture that ends well resets it."""
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.empty(1, device=device).zero_()
        torch.cuda.synchronize(device)
    except Exception:                                  # nothing more to do: the original error is raised
        pass


# --- the public helper ----------------------------------------------------------------------------------
def _signature(args) -> list:
    return [("tensor", a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", a) for a in args]


class Graphed:
    """``fn`` captured in a CUDA graph; calling it copies the arguments into the static inputs and
    replays. See :func:`graphed`."""

    def __init__(self, fn, example_args: tuple, warmup: int = 3, restore=(), pool=None):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        if not torch.cuda.is_available():
            raise ValueError("bstrain.graphed: needs a CUDA device; none is available (on the CPU, call the step "
                             "as it is)")
        if warmup < 1:
            raise ValueError(f"warmup: expected >= 1 warm-up calls, got {warmup}")
        self.fn, self.warmup, self.pool = fn, warmup, pool
        self.restore = [r for r in (restore if isinstance(restore, (list, tuple)) else [restore])]
        for i, opt in enumerate(self.restore):
            if isinstance(opt, torch.optim.Optimizer) and "capturable" in opt.defaults and not all(
                    g.get("capturable") for g in opt.param_groups):
                raise ValueError(f"restore[{i}]: {type(opt).__name__} needs capturable=True to be stepped in a CUDA "
                                 f"graph (its step counter would be read on the host)")
        self.graph = None
        self.static: list = []
        self.outputs = None
        if example_args:
            self._build(example_args)

    def _build(self, args) -> None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and not a.is_cuda:
                raise ValueError(f"args[{i}]: expected a CUDA tensor, got one on {a.device}")
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cuda",
                                                                                             torch.cuda.current_device()))
        self.device = device
        self.static = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        self.sig = _signature(args)
        for s, a in zip(self.static, args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                s.requires_grad_(True)
        snapshot = Snapshot(self.restore, device) if self.restore else None
        modules = [r for r in self.restore if isinstance(r, torch.nn.Module)]
        self.graph, self.outputs = _capture(lambda: self.fn(*self.static), self.warmup, device, snapshot, modules,
                                            self.pool)

    def __call__(self, *args):
        if self.graph is None:
            self._build(args)
        elif args:
            sig = _signature(args)
            if len(sig) != len(self.sig):
                raise ValueError(f"args: the graph was captured with {len(self.sig)} arguments, got {len(sig)}")
            for i, (got, want) in enumerate(zip(sig, self.sig)):
                if got != want:
                    raise ValueError(f"args[{i}]: the graph was captured with {want[1:]}, got {got[1:]} (a graph "
                                     f"replays fixed shapes; capture another for this one)")
            for s, a in zip(self.static, args):
                if isinstance(a, torch.Tensor) and s.data_ptr() != a.data_ptr():
                    s.detach().copy_(a, non_blocking=True)
        self.graph.replay()
        return self.outputs


def graphed(fn, *example_args, warmup: int = 3, restore=(), pool=None) -> Graphed:
    """``fn(*args)`` captured in one CUDA graph: calls replay it, with the new arguments copied
    into static input buffers first.

    ``fn`` is, for example, a whole training step: forward, ``loss.backward()``, ``opt.step()``
    (an optimizer built with ``capturable=True``; fused AdamW is). Its outputs are tensors the
    next call overwrites: ``.clone()`` (or ``.item()``) what you keep. Every call must pass
    arguments of the captured shapes and dtypes (ValueError otherwise).

    Capturing runs ``warmup`` eager calls first (kernels compile, plans and optimizer state are
    made), on the example arguments. Those calls train: pass the model and optimizer (and a
    GradScaler) as ``restore=(model, opt)`` to undo them, so that the first replay is the first
    step. ``pool``: a memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``).
    With no example arguments, capture happens at the first call.
    """
    return Graphed(fn, example_args, warmup=warmup, restore=restore, pool=pool)


# --- the trainer's step ------------------------------------------------------------------------------------
def check_graph_config(device: torch.device) -> str | None:
    """Why the trainer cannot capture its step on ``device``, or None. (fp16, DDP and compiled
    models are captured too; what else stops a capture is found at the first step.)"""
    if device.type != "cuda":
        return f"needs a CUDA device, got device {device.type!r}"
    return None


def ema_decay(n_averaged: torch.Tensor, decay: float) -> torch.Tensor:
    """The decay of the EMA update that follows ``n_averaged`` earlier ones: min(decay, (1 + n) /
    (10 + n)), the warm-up of TensorFlow's ExponentialMovingAverage (its ``num_updates``). A fixed
    decay of 0.999 would still hold 0.999^300 = 74% of the first weights after 300 steps, so that
    early evaluations of the EMA read far worse than training; the warmed decay averages over
    about the last n/9 steps until it reaches ``decay``. A device tensor computed from the counter
    on the device, so that a captured step reads the current count at every replay.
    """
    n = n_averaged.to(torch.float32)
    return torch.clamp((1.0 + n) / (10.0 + n), max=decay)


def ema_update(ema, model: torch.nn.Module, decay: float) -> None:
    """``AveragedModel.update_parameters`` with an EMA of warmed decay (:func:`ema_decay`), without
    a host sync: ``ema = ema + (1 - decay_t) (model - ema)``; n_averaged counts updates on the
    device (it is in the EMA's state dict, so a resumed run continues the warm-up). The buffers
    (BatchNorm's running statistics) are the model's: an EMA copy evaluated with the statistics it
    was built with would normalise every layer wrongly."""
    with torch.no_grad():
        e = [p.detach() for p in ema.module.parameters()]
        m = [p.detach() for p in model.parameters()]
        if e:
            w = (1.0 - ema_decay(ema.n_averaged, decay)).to(e[0].dtype)
            d = torch._foreach_sub(m, e)
            torch._foreach_mul_(d, w)
            torch._foreach_add_(e, d)
        layouts = layout_buffers(ema.module)           # the layout switches keep the EMA's in step
        pairs = [(b, c) for b, c in zip(ema.module.buffers(), model.buffers()) if id(b) not in layouts]
        if pairs:
            eb, mb = map(list, zip(*pairs))
            torch._foreach_copy_(eb, mb)
        ema.n_averaged += 1


class CapturedStep:
    """``step(x, y, reset_state) -> (loss, grad_norm, metrics, skipped)`` replays one captured
    training step.

    The step is :func:`bstrain.train.step.train_step`, the eager loop's, plus the EMA update and
    fp16's skip flag. The inputs and a stateful model's carried state live in static buffers;
    the graph reads the state, trains on (x, y) and writes the new state back, so consecutive
    batches carry it as the eager loop does. The warm-up steps before the capture run on the
    first batch and are undone (weights, buffers, optimizer and loss-scaler state, EMA, RNG), so
    that training with and without the graph follows the same trajectory.

    :meth:`prepare` captures on the first batch and raises :class:`CaptureError` naming why a
    step cannot be captured; a batch of another shape later runs eagerly (``eager_step``).
    """

    def __init__(self, forward: Forward, loss_fn, optimizer: torch.optim.Optimizer, grad_clip: float,
                 metrics_fn=None, warmup: int = 2, scaler: torch.amp.GradScaler | None = None, ema=None,
                 ema_decay: float = 0.0, model: torch.nn.Module | None = None, before_step=None,
                 pool_from: "CapturedStep | None" = None):
        self.forward, self.loss_fn, self.optimizer, self.metrics_fn = forward, loss_fn, optimizer, metrics_fn
        self.before_step, self.pool_from = before_step, pool_from
        self.device, self.grad_clip, self.warmup = forward.device, grad_clip, warmup
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.ema, self.ema_decay = ema, ema_decay
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.model = model if model is not None else forward.net
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = isinstance(forward.net, DistributedDataParallel) or isinstance(
            getattr(forward.net, "_orig_mod", None), DistributedDataParallel)
        self.x = self.y = None
        self.state = None                                  # static state buffers (stateful models)
        self.graph: torch.cuda.CUDAGraph | None = None

    def twin(self, before_step=None, forward=None) -> "CapturedStep":
        """A second capture of the same step (the trainer's: with RigL's gradient hooks armed), on
        this one's memory pool when this one is captured first (the two never run at once).
        ``before_step()`` runs at the start of every warm-up and of the captured run; ``forward``
        replaces this one's (the uncompiled model, whose hooks run)."""
        return CapturedStep(forward or self.forward, self.loss_fn, self.optimizer, self.grad_clip, self.metrics_fn, self.warmup,
                            self.scaler, self.ema, self.ema_decay, self.model, before_step=before_step,
                            pool_from=self)

    def _step(self):
        scale = self.scaler._scale.clone() if self.scaler is not None and self.scaler._scale is not None else None
        loss, grad_norm, state, metrics = train_step(self.forward, self.loss_fn, self.x, self.y, self.state,
                                                     self.optimizer, self.params, self.grad_clip, self.scaler,
                                                     zero_grad=False, metrics_fn=self.metrics_fn)
        skipped = (self.scaler._scale < scale).int() if scale is not None else torch.zeros((), dtype=torch.int32,
                                                                                           device=self.device)
        if self.ema is not None:
            ema_update(self.ema, self.model, self.ema_decay)
        for buf, new in zip(state_tensors(self.state), state_tensors(state)):
            buf.copy_(new)
        return loss, grad_norm, metrics, skipped

    def _check_optimizer(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g["lr"]
            if not g.get("capturable") or not isinstance(lr, torch.Tensor) or lr.device.type != "cuda":
                raise ValueError(f"optimizer: param group {i} needs capturable=True and a CUDA tensor lr for "
                                 f"graph capture, got capturable={g.get('capturable')}, lr={lr!r}")

    def _state_buffers(self, batch_size: int) -> None:
        """The static buffers of a stateful model's carried state, made once."""
        if self.forward.stateful and self.state is None:
            self.state = unwrap(self.forward.net).init_state(batch_size, self.device)

    def _buffers(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = torch.empty_like(x), torch.empty_like(y)
        self._state_buffers(x.shape[0])

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Captures the step for batches shaped like (x, y); CaptureError names why it cannot."""
        self._check_optimizer()
        if self.x is None:
            self._buffers(x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        if self.scaler is not None and self.scaler._scale is None:
            self.scaler._lazy_init_scale_growth_tracker(self.device)
        objects = [self.model, self.optimizer, self.scaler, self.ema]
        snapshot = Snapshot(objects, self.device, extra=state_tensors(self.state))
        self.optimizer.zero_grad(set_to_none=True)
        try:
            # under DDP, NCCL's watchdog thread queries events during the capture: flag this thread's calls only
            source = self.pool_from.graph if self.pool_from is not None else None
            self.graph, self.outputs = _capture(self._warm_then_step(self._step), self.warmup, self.device, snapshot,
                                                [self.model], pool=source.pool() if source is not None else None,
                                                error_mode="thread_local" if self.ddp else "global")
        finally:
            if self.graph is None:
                self.optimizer.zero_grad(set_to_none=True)

    def _warm_then_step(self, once):
        """Every step starts without gradients: the warm-up's backward makes them, the captured one
        makes them in the graph's pool (which every replay rewrites)."""
        def run():
            self.optimizer.zero_grad(set_to_none=True)
            if self.before_step is not None:
                self.before_step()
            return once()
        return run

    def drop(self) -> None:
        """Forgets the captured graph (the layers' tables changed): the next step captures again."""
        self.graph = None

    def matches(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        return (self.x is not None and x.shape == self.x.shape and y.shape == self.y.shape
                and x.dtype == self.x.dtype and y.dtype == self.y.dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor, reset_state: bool):
        if self.graph is None:
            self.prepare(x, y)
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if reset_state:
            for s in state_tensors(self.state):
                s.zero_()
        self.graph.replay()
        return self.outputs

    def load_state(self, state, batch_like: torch.Tensor) -> None:
        """Copies a carried state (from a checkpoint) into the static buffers."""
        self._state_buffers(batch_like.shape[0])
        for buf, s in zip(state_tensors(self.state), state_tensors(state)):
            buf.copy_(s)


# --- evaluation ----------------------------------------------------------------------------------------------
class GraphedForward:
    """A :class:`Forward` (``forward(x, state) -> (output, state)``) replayed from a CUDA graph per
    input shape, under no_grad: the trainer's evaluation. Up to ``max_graphs`` shapes get a graph
    (an epoch's ragged last batch is one more); other shapes, and any shape whose capture fails,
    run eagerly. Outputs are overwritten by the next call of the same shape."""

    def __init__(self, forward: Forward, max_graphs: int = 3):
        self.forward, self.max_graphs = forward, max_graphs
        self.device, self.stateful = forward.device, forward.stateful
        self.graphs: dict = {}
        self.failed: str | None = None

    def _key(self, x, state):
        return (tuple(x.shape), x.dtype, state is None)

    def __call__(self, x: torch.Tensor, state=None):
        key = self._key(x, state)
        entry = self.graphs.get(key)
        if entry is None:
            if self.failed is not None or len(self.graphs) >= self.max_graphs or not x.is_cuda:
                with torch.no_grad():
                    return self.forward(x, state)
            entry = self._make(x, state, key)
            if entry is None:
                with torch.no_grad():
                    return self.forward(x, state)
        sx, sstate, out, graph = entry
        sx.copy_(x, non_blocking=True)
        for buf, s in zip(state_tensors(sstate), state_tensors(state)):
            if buf.data_ptr() != s.data_ptr():
                buf.copy_(s, non_blocking=True)
        graph.replay()
        return out

    def _make(self, x, state, key):
        sx = x.detach().clone()
        sstate = None if state is None else tree_map(lambda t: t.detach().clone(), state)

        def once():
            with torch.no_grad():
                return self.forward(sx, sstate)
        try:
            graph, out = _capture(once, 1, self.device, None)
        except CaptureError as exc:
            self.failed = str(exc)
            log.info("evaluation runs eagerly: %s", exc)
            return None
        self.graphs[key] = (sx, sstate, out, graph)
        return self.graphs[key]
