"""The policies: :class:`DynamicSparsity` (the schedule, the update, checkpoints), :class:`SET`
and :class:`RigL` (its gradient hooks); see :mod:`bstrain.sparsity`."""
from __future__ import annotations

import math
import time
import warnings

import numpy as np
import torch
from torch import nn

from bstrain.sparsity.groups import _OpLayer, _check_ops_apart, _twin_layers, _weight_groups, sparse_layers
from bstrain.sparsity.growth import _grow_balanced, _grow_within, _growth_limits, _top, _why_fixed_when_balanced
from bstrain.sparsity.remap import _check_optimizer, _move_blocks, _state_moves, _whole
from bstrain.sparsity.scores import _all_reduce_mean, _block_norms, _GradRecord
from bstrain.sparsity.tables import _share_tables, _switch

__all__ = ["DynamicSparsity", "SET", "RigL", "POLICIES"]

POLICIES = ("static", "set", "rigl")


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prune_counts(share: float, old: np.ndarray) -> tuple[int, int]:
    """(planned, pruned) blocks of an update at ``share`` of layout ``old``: round(share · live),
    and as many as there are dead blocks to grow into."""
    planned = int(round(share * int(old.sum())))
    return planned, min(planned, int((~old).sum()))


class DynamicSparsity:
    """Prune the smallest-norm live blocks of each block-sparse layer every ``every`` steps and
    grow as many dead ones, chosen by :meth:`grow_scores`: the best-scored that keep every block
    row and column within :func:`bstrain.layout.growth_limit` (or its longest before the update),
    which the kernels' tables hold, so that updates rewrite them in place.

    Args:
        model: holds the block-sparse layers (a ValueError if none).
        optimizer: its state of each layer's weight follows the moves (None: no optimizer state).
        every: optimizer steps between updates (>= 1).
        fraction: share of a layer's live blocks replaced at step 0 of the decay, in (0, 1): the
            update at step t replaces ``fraction * (1 + cos(pi * t / stop)) / 2`` of them (RigL's
            schedule), so the first update, at step ``every``, already replaces less.
        stop: the last step that may update (None: never stop, and every update replaces
            ``fraction``); the share decays by a cosine to 0 at ``stop``.
        balanced: keep each row's and each column's live-block counts, as
            :func:`bstrain.layout.balanced` draws them: each column's smallest-norm share of blocks
            is pruned, and blocks grow where the pruning left a row and a column short.
        seed: of the random draws (ties, SET's growth).
        also: modules shaped like ``model`` (an EMA copy, its ``module`` when wrapped) whose
            same-named layers take the same layouts and weight moves.
        ops: (BlocksparseMatMul, weight) pairs used directly, outside modules (``model`` may then
            be None); each op switches layout in place (``set_layout``).
        grown_moments: "zero" (grown blocks start with zero optimizer state) or "mean": their
            second moment (AdamW's ``exp_avg_sq``, ``max_exp_avg_sq``) starts at the mean of the
            layer's surviving blocks' (experimental). With zero moments a grown block's first step is
            about 3·lr per element whatever its gradient (bias correction counts the tensor's
            steps, not the block's); with "mean" it scales with the block's gradient against the
            survivors' typical one, smaller for most blocks, larger for outliers. First moments
            start at zero either way.
    """

    grows = "random"

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *, every: int = 100,
                 fraction: float = 0.3, stop: int | None = None, balanced: bool = False, seed: int = 0,
                 also: tuple[nn.Module, ...] = (), ops=(), grown_moments: str = "zero"):
        _check("every", every, _int(every) and every >= 1, "an int >= 1")
        _check("fraction", fraction, isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
               and 0 < fraction < 1, "a share in (0, 1)")
        _check("stop", stop, stop is None or (_int(stop) and stop >= 0), "None or an int >= 0")
        _check("seed", seed, _int(seed), "an int")
        _check("grown_moments", grown_moments, grown_moments in ("zero", "mean"), '"zero" or "mean"')
        ops = list(ops)
        if len({id(pair[0]) for pair in ops}) != len(ops):
            raise ValueError("ops: expected each BlocksparseMatMul once, got one op in several (op, weight) pairs; "
                             "give each weight an op of its own (a layout update moves one weight)")
        modules = sparse_layers(model)
        self.layers = modules + [(f"ops.{i}", _OpLayer(op, w)) for i, (op, w) in enumerate(ops)]
        if not self.layers:
            raise ValueError(f"model: expected a model with block-sparse layers (BlockSparseLinear, "
                             f"BlockSparseConv2d) or ops=[(BlocksparseMatMul, weight)], got a "
                             f"{type(model).__name__} with none")
        _check_ops_apart(modules, self.layers[len(modules):])
        self.groups = _weight_groups(self.layers, model)   # the layers of each weight, in module order
        self._members = {group[0][0]: group for group in self.groups}
        self.model, self.optimizer = model, optimizer
        self.every, self.fraction, self.stop, self.balanced, self.seed = every, float(fraction), stop, balanced, seed
        self.grown_moments = grown_moments
        _check_optimizer(self.optimizer, self.groups)
        self.also = [_twin_layers(m, self.layers, self.groups) for m in also]
        for _, layer in self.layers:                  # tables of their own: updates rewrite them in place
            owner = getattr(layer, "op", layer)
            if hasattr(owner, "make_private"):
                owner.make_private()
        for other in self.also:
            for name, layer in self.layers:
                if name in other:
                    _share_tables(other[name], layer)
        self.steps = 0                  # optimizer steps seen
        self.history: list[dict] = []   # one entry per update: step, share changed per layer
        self._hooks: list = []
        self._grads: dict[str, _GradRecord] = {}
        self._captured_grads: dict[str, _GradRecord] = {}
        if balanced:
            self._warn_fixed_layers()
        self._arm()

    def _warn_fixed_layers(self) -> None:
        """One warning naming the layers that a balanced update can never move, and why: they
        would stay on their first layout all run long, with nothing else to say so."""
        if not self.updates_at(self.every):
            return                      # no update at all (stop <= every)
        share = self.fraction_at(self.every)        # the largest share an update prunes
        fixed = []
        for group in self.groups:
            old = np.asarray(group[0][1].block_layout(), dtype=bool)
            why = _why_fixed_when_balanced(old, _prune_counts(share, old)[1])
            if why is not None:
                fixed += [f"{name!r} ({why})" for name, _ in group]
        if fixed:
            warnings.warn(f"{type(self).__name__}(balanced=True): a balanced update can never move a block of layers "
                          f"{'; '.join(fixed)}: they keep their first layout; use balanced=False, or a higher "
                          f"fraction or density for these layers", UserWarning, stacklevel=3)

    # --- schedule ---------------------------------------------------------------------------------
    def fraction_at(self, step: int) -> float:
        """The share of live blocks replaced at ``step``: ``fraction`` decayed by a cosine to 0 at stop."""
        if self.stop is None:
            return self.fraction
        if self.stop == 0 or step > self.stop:
            return 0.0
        return self.fraction * 0.5 * (1 + math.cos(math.pi * step / self.stop))

    def updates_at(self, step: int) -> bool:
        """Whether ``step`` (counted in optimizer steps) changes the layouts."""
        return step > 0 and step % self.every == 0 and (self.stop is None or step < self.stop)

    @property
    def armed(self) -> bool:
        """The coming optimizer step is followed by an update that needs that step's gradients
        (RigL): run it eagerly (hooks record the layers' inputs and output gradients)."""
        return False

    # --- the update -------------------------------------------------------------------------------
    def step(self, step: int | None = None) -> dict | None:
        """Call once after each optimizer step (``step``: its 1-based count; default: one more than
        the last call's). On update steps, changes every layer's layout and returns
        ``{"step", "fraction" (the scheduled share), "changed" {name: share of its live blocks
        replaced, i.e. grown where no block was before}, "density" {name: live share}, "blocks"
        {"live", "planned" (round(fraction·live) per weight, summed), "pruned" (as many, where
        enough blocks are dead), "replaced"}: counts over the distinct weights (a shared weight
        once), "in_place" (every changed layer's tables rewritten in place: graphs made before
        stay valid), "seconds" (the update's wall time, its GPU work included; on a GPU, timed
        from when the queued steps are done)}``; else None. A balanced update may regrow some
        pruned blocks (each block row and column keeps its count), so fewer may be replaced than
        pruned."""
        count = self.steps + 1 if step is None else int(step)
        update = self.updates_at(count)
        if update:      # state that cannot follow the blocks: refused before any move, no step counted
            _check_optimizer(self.optimizer, self.groups)
        self.steps = count
        info = self._update(count) if update else None
        self._arm()
        return info

    @torch.no_grad()
    def _update(self, step: int) -> dict:
        # (the optimizer's state was checked by step(), before any move)
        cuda = next((layer.weight.device for _, layer in self.layers if layer.weight.is_cuda), None)
        if cuda is not None:            # the queued steps first (the norms are read on the host anyway),
            torch.cuda.synchronize(cuda)    # so that "seconds" is the update's own time
        t0 = time.perf_counter()
        share = self.fraction_at(step)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        changed, density, blocks = {}, {}, dict.fromkeys(("live", "planned", "pruned", "replaced"), 0)
        from bstrain.ops.matmul import switching_together
        with switching_together():          # a layer and its EMA copy switch together (shared tables)
            in_place = self._switch_all(share, gen, changed, density, blocks)
        self._grads.clear()
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        info = {"step": step, "fraction": share, "changed": changed, "density": density, "blocks": blocks,
                "in_place": in_place, "seconds": time.perf_counter() - t0}
        self.history.append(info)
        return info

    def _switch_all(self, share: float, gen: torch.Generator, changed: dict, density: dict, blocks: dict) -> bool:
        """A new layout for every weight, taken by the layers that share it (and their twins);
        ``blocks`` sums the counts. True if every switch was made in place."""
        in_place = True
        for group in self.groups:
            name, layer = group[0]
            old = np.asarray(layer.block_layout(), dtype=bool)
            live = int(old.sum())
            planned, n = _prune_counts(share, old)
            new = self._new_layout(name, layer, old, n, gen)
            replaced = int((new & ~old).sum())
            for key, count in (("live", live), ("planned", planned), ("pruned", n), ("replaced", replaced)):
                blocks[key] += count
            for member, _ in group:
                changed[member] = replaced / max(1, live)
                density[member] = float(new.mean())
            if not np.array_equal(new, old):
                in_place &= self._move_group(group, old, new)
        return in_place

    def _move_group(self, group: list, old: np.ndarray, new: np.ndarray) -> bool:
        """Moves the group's weight and its optimizer state once, switches every layer of the group
        to ``new``, then the same for the twins in ``also`` (each twin weight moved once)."""
        weight = group[0][1].weight
        _move_blocks(old, new, [(weight, 0.0), *_state_moves(self.optimizer, weight, self.grown_moments)])
        in_place = all([_switch(layer, new) for _, layer in group])
        for other in self.also:
            twins = [(name, layer, other[name]) for name, layer in group if name in other]
            moved: set[int] = set()
            for _, _, twin in twins:
                if id(twin.weight) not in moved:
                    moved.add(id(twin.weight))
                    _move_blocks(np.asarray(twin.block_layout(), dtype=bool), new, [(twin.weight, 0.0)])
            for _, layer, twin in twins:
                in_place &= _switch(twin, new)
                _share_tables(twin, layer)          # again, if the layer took new tables
        return in_place

    def _new_layout(self, name: str, layer: nn.Module, old: np.ndarray, n: int, gen: torch.Generator) -> np.ndarray:
        """The layout after pruning and growing ``n`` blocks: the smallest-norm live ones go, or
        if balanced, each block column's smallest-norm share (a column's blocks can only be
        replaced within it: pruned by norm alone, the columns whose blocks start smallest, the
        longest, would lose most and take their blocks back)."""
        w = _whole(layer.weight.detach())                                               # (FSDP: gathered)
        live_norm = _all_reduce_mean(w.float().flatten(1).norm(dim=1)).cpu()          # (nnz,) row-major order
        prune_score = torch.full(old.shape, math.inf)
        prune_score[torch.as_tensor(old)] = live_norm
        if self.balanced:           # rank within the column, as a share of its live blocks: dead ones last
            rank = prune_score.argsort(dim=0, stable=True).argsort(dim=0, stable=True).double()
            count = torch.as_tensor(old.sum(0), dtype=torch.float64).clamp(min=1)
            prune_score = ((rank + 0.5) / count).masked_fill(~torch.as_tensor(old), math.inf)
        grow_score = self.grow_scores(name, layer, old, gen)                           # (Cb, Kb), higher first
        grow_score = grow_score.masked_fill(torch.as_tensor(old), -math.inf)
        if n <= 0:
            return old.copy()
        new = old.copy()
        pruned = _top(-prune_score, n, gen)
        new.flat[pruned] = False
        if not self.balanced:
            new.flat[_grow_within(old, new, grow_score, n, gen, *_growth_limits(old))] = True
            return new
        return _grow_balanced(old, new, pruned, grow_score, gen)

    def grow_scores(self, name: str, layer: nn.Module, old: np.ndarray, gen: torch.Generator) -> torch.Tensor:
        """(C/bs, K/bs) scores of the dead blocks; the highest grow. SET: uniform random. ``name``,
        ``layer``: the first (in module order) of the layers that share the weight."""
        return torch.rand(old.shape, generator=gen)

    # --- RigL's gradient hooks ----------------------------------------------------------------------
    def _arm(self) -> None:
        pass

    # --- a captured gradient step (the trainer's CUDA graph) ------------------------------------------
    def begin_step(self) -> None:
        """A (warm-up or captured) run of the step before an update starts: the gradient sums
        start over."""
        self._grads.clear()

    def keep_captured(self) -> None:
        """The gradient records a capture of that step wrote: every replay rewrites these tensors."""
        self._captured_grads = {k: v.copy() for k, v in self._grads.items()}

    def use_captured(self) -> None:
        """After a replay of the captured step: the update reads the records it wrote."""
        self._grads = {k: v.copy() for k, v in self._captured_grads.items()}

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step count and history; the layouts themselves are in the model's state dict."""
        return {"steps": self.steps, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.history = list(state.get("history", []))
        self._arm()


class SET(DynamicSparsity):
    """Sparse Evolutionary Training (Mocanu et al. 2018) on blocks: prune the smallest-norm live
    blocks, grow dead blocks at random."""


class RigL(DynamicSparsity):
    """RigL (Evci et al. 2020) on blocks: prune the smallest-norm live blocks, grow the dead blocks
    whose dense gradient (X·dY of the step before the update, all calls of the step summed) has
    the largest norm. The gradient is computed by hooks on that one step only."""

    grows = "gradient"
    _warned: set

    def __init__(self, *args, **kwargs):
        self._warned = set()
        super().__init__(*args, **kwargs)

    @property
    def armed(self) -> bool:
        return bool(self._hooks)

    def _arm(self) -> None:
        want = self.updates_at(self.steps + 1)
        if want and not self._hooks:
            self._hooks = [self._watch(name, layer) for name, layer in self.layers]
        elif not want and self._hooks:
            self._disarm()

    def _disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _watch(self, name: str, layer):
        """Records (x, dY) of each call of ``layer`` on the coming step; returns a handle with remove()."""
        def record(x, out):
            if not torch.is_grad_enabled() or not out.requires_grad:
                return
            x = x.detach()

            def on_grad(dy):
                self._grads.setdefault(name, _GradRecord()).add(layer, x, dy.detach())
            out.register_hook(on_grad)
        if isinstance(layer, _OpLayer):
            layer.op.observer = record
            return _Unobserve(layer.op)
        return layer.register_forward_hook(lambda mod, args, out: record(args[0], out))

    def grow_scores(self, name: str, layer: nn.Module, old: np.ndarray, gen: torch.Generator) -> torch.Tensor:
        # the weight's dense gradient: the sum over the layers that share it (of each layer's calls)
        totals = [self._grads[member].total(other) for member, other in self._members.get(name, [(name, layer)])
                  if member in self._grads]
        totals = [t for t in totals if t is not None]
        g = sum(totals[1:], totals[0]) if totals else None
        if g is not None:                   # the step's dense gradient, averaged over ranks, then block norms
            g = _block_norms(layer, _all_reduce_mean(g)).cpu()
        if g is None or not bool(torch.isfinite(g).all()):
            # no gradient reached the layer (a model compiled before the hooks were added runs
            # none: run the step before an update uncompiled), or an fp16 step overflowed
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"RigL: {'no' if g is None else 'a non-finite'} dense gradient for layer {name!r} on "
                              f"the step before the update at step {self.steps}; it grows at random this time. A "
                              f"model compiled before the policy's hooks were added does not run them: run the "
                              f"step when policy.armed is True through the uncompiled model", RuntimeWarning,
                              stacklevel=3)
            return torch.rand(old.shape, generator=gen)
        # ties (e.g. zero gradients) broken at random, below any real difference
        return g + 1e-12 * torch.rand(old.shape, generator=gen)

    def _update(self, step: int) -> dict:
        try:
            return super()._update(step)
        finally:
            self._disarm()


class _Unobserve:
    def __init__(self, op):
        self.op = op

    def remove(self) -> None:
        self.op.observer = None
