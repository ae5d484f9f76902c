"""Dynamic block sparsity: prune and regrow the blocks of block-sparse layers while training.

    policy = bstrain.sparsity.RigL(model, optimizer, every=100, fraction=0.3, stop=75_000)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad()
        policy.step()                       # every 100 steps: a new layout for every sparse layer

Every ``every`` optimizer steps (until step ``stop``), each block-sparse layer of the model
(:class:`bstrain.nn.BlockSparseLinear`, :class:`bstrain.nn.BlockSparseConv2d`) drops
``round(fraction_at(step) · live blocks)`` of its live blocks (whole blocks, rounded per layer)
with the smallest weight norm and grows as many dead ones: at random (:class:`SET`) or those
whose dense gradient has the largest norm (:class:`RigL`, Evci et al. 2020; the dense gradient
X·dY of the step before the update is computed by hooks, on that step only). The share decays
from ``fraction`` to 0 by a cosine over [0, stop].

An update keeps everything consistent: the live-block count is unchanged, so the weight
Parameter keeps its shape and stays the optimizer's. Surviving blocks keep their values and
their optimizer state bit for bit, moved to their new place in the row-major block order. The
state that moves is every state tensor of the weight of shape (nnz, ...) whose other dims are
the weight's or 1: Adam's, AdamW's, NAdam's, RAdam's and SparseAdam's moments (AMSGrad's
``max_exp_avg_sq`` too), SGD's and RMSprop's ``momentum_buffer``, RMSprop's ``square_avg`` and
``grad_avg``, Adagrad's ``sum``, Adadelta's ``square_avg`` and ``acc_delta``, Adamax's
``exp_inf``, ASGD's ``ax``, Rprop's ``prev`` and ``step_size``, and Adafactor's factored
``row_var`` (nnz, bs, 1) and ``col_var`` (nnz, 1, bs). 0-dim tensors and Python numbers (step
counts, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``) are left alone. Grown blocks start at
zero, and their state at the optimizer's start value: Adagrad's ``initial_accumulator_value``,
Rprop's ``lr``, zero for the rest (see ``grown_moments``). Any other state of a managed weight (a
flattened or (bs, bs) tensor, a list; L-BFGS, whose state is flat vectors over all its
parameters) cannot follow the blocks and is refused with a ValueError naming the optimizer and
the key: at construction where the state exists, else at the update, before anything moves.

Layers that share one weight (``b.weight = a.weight``; a module registered under two names;
``ops`` pairs on one weight or on a module's weight) are updated once, as one: one new layout
for the weight, decided from its blocks (RigL: from the sum of their dense gradients, the
weight's dense gradient), the weight and its state moved once, and every layer that shares it
switched to that layout. Such layers must be of one kind (products or convolutions), block
size and layout, and a managed weight may not be a parameter of another module as well; other
ties are refused at construction with a ValueError naming both. Modules named in ``also`` (an
EMA copy of the model) get the same layouts and moves (their tied layers, if any, tied as the
model's). Each managed layer gets layout tables of its own, which an update rewrites in place
(see ``BlocksparseMatMul.set_layout``), so CUDA graphs and compiled graphs made after the policy
was built keep running the current layouts; where a layer's tables cannot take its new layout
(a block row or column longer than they hold; a block-diagonal convolution that now needs a
channel gather) it gets new ones, and the old ones are freed with the last op that holds them.
Build the policy before capturing or compiling: a graph made before it reads the layer's shared
tables, which updates never change. Under torch.distributed every rank makes the same decision:
the scores are averaged over ranks and the random draws are seeded by (seed, step).
"""
from __future__ import annotations

import math
import time
import warnings

import numpy as np
import torch
from torch import nn

__all__ = ["DynamicSparsity", "SET", "RigL", "sparse_layers", "POLICIES"]

POLICIES = ("static", "set", "rigl")


def sparse_layers(model: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every block-sparse layer of ``model``, in module order."""
    from bstrain.nn._sparse import BlockLayoutModule
    if model is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BlockLayoutModule)]


class _OpLayer:
    """A :class:`bstrain.ops.BlocksparseMatMul` used directly with its weight, seen as a layer."""

    def __init__(self, op, weight: nn.Parameter):
        from bstrain.ops.matmul import BlocksparseMatMul
        if not isinstance(op, BlocksparseMatMul) or not isinstance(weight, torch.Tensor) or \
                tuple(weight.shape) != tuple(op.w_shape):
            raise ValueError(f"ops: expected (BlocksparseMatMul, weight of its w_shape) pairs, got "
                             f"({type(op).__name__}, {getattr(weight, 'shape', type(weight).__name__)})")
        self.op, self.weight = op, weight

    def block_layout(self) -> np.ndarray:
        return self.op.layout

    def _switch_layout(self, layout: np.ndarray) -> bool:
        return self.op.set_layout(layout)           # (it makes the new tables where the old ones were)


def _block_size(layer) -> int:
    return layer.block_size if hasattr(layer, "block_size") else layer.op.block_size


def _check_ops_apart(modules: list, pairs: list) -> None:
    """An ``ops`` pair may share a module's weight, not its op (the pair would be the module again)."""
    owner = {id(layer.op): name for name, layer in modules if hasattr(layer, "op")}
    for name, pair in pairs:
        if id(pair.op) in owner:
            raise ValueError(f"ops: expected ops of their own, got {name} with the BlocksparseMatMul of layer "
                             f"{owner[id(pair.op)]!r}, which the policy manages already; drop the pair")


def _why_not_tied(a, b) -> str | None:
    """Why layers ``a`` and ``b`` cannot share one weight under a policy (None: they can): a
    layout update decides one layout for the weight, every layer sharing it takes that layout."""
    from bstrain.nn.conv import BlockSparseConv2d
    kinds = [("a convolution" if isinstance(x, BlockSparseConv2d) else "a product") for x in (a, b)]
    if kinds[0] != kinds[1]:
        return f"one is {kinds[0]}, the other {kinds[1]}"
    if _block_size(a) != _block_size(b):
        return f"their block sizes differ ({_block_size(a)} and {_block_size(b)})"
    la, lb = np.asarray(a.block_layout(), dtype=bool), np.asarray(b.block_layout(), dtype=bool)
    if la.shape != lb.shape:
        return f"their layouts have different shapes ({la.shape} and {lb.shape})"
    if not np.array_equal(la, lb):
        return "their layouts differ"
    return None


def _weight_groups(layers: list, model: nn.Module | None) -> list[list[tuple[str, nn.Module]]]:
    """``layers`` grouped by the weight they hold, each group in module order: the layers of a
    group share one Parameter, so an update moves it once and switches them all. A ValueError
    naming both layers where a group's layers cannot share one layout, where distinct weights
    are one memory, or where another module holds a managed weight."""
    by_weight: dict[int, list] = {}
    for name, layer in layers:
        by_weight.setdefault(id(layer.weight), []).append((name, layer))
    groups = list(by_weight.values())
    for group in groups:
        first, layer = group[0]
        for name, other in group[1:]:
            why = _why_not_tied(layer, other)
            if why is not None:
                raise ValueError(f"model: layers {first!r} and {name!r} share one weight, but {why}; a layout update "
                                 f"gives a weight one layout: give them weights of their own, or tie layers of one "
                                 f"kind, block size and layout")
    _check_no_aliases([(repr(name), layer.weight) for name, layer in layers], "model")
    if model is not None:
        _check_sole_holders(model, groups)
    return groups


def _check_no_aliases(weights: list[tuple[str, torch.Tensor]], arg: str) -> None:
    """Distinct weight tensors on one memory (``weights``: (quoted name, weight)) would each be
    moved, the memory twice: refused (tie them as one Parameter instead)."""
    seen: dict[int, tuple[str, int]] = {}
    for name, w in weights:
        if w.is_meta or w.numel() == 0:
            continue
        first = seen.setdefault(w.data_ptr(), (name, id(w)))
        if first[1] != id(w):
            raise ValueError(f"{arg}: layers {first[0]} and {name} hold distinct weight tensors on the same memory; "
                             f"tie them as one Parameter (b.weight = a.weight) or give each its own")


def _check_sole_holders(model: nn.Module, groups: list) -> None:
    """A managed module's weight held as a parameter by a module that is no layer of its group
    (a dense module, say) would have its blocks moved under it: refused. (Weights of ``ops``
    pairs are held by the user's own modules and are not checked.)"""
    names_of: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(mname)
    allowed: dict[int, tuple[str, set]] = {}
    for group in groups:
        if any(isinstance(layer, _OpLayer) for _, layer in group):
            continue
        allowed[id(group[0][1].weight)] = (group[0][0], {f"{m}.weight" if m else "weight" for _, layer in group
                                                        for m in names_of.get(id(layer), [])})
    for pname, p in model.named_parameters(remove_duplicate=False):
        entry = allowed.get(id(p))
        if entry is not None and pname not in entry[1]:
            holder = pname.rpartition(".")[0] or type(model).__name__
            raise ValueError(f"model: layer {entry[0]!r} and module {holder!r} share one weight ({pname!r}), but "
                             f"{holder!r} is not a block-sparse layer the policy manages: a layout update would move "
                             f"the blocks under it; give it a parameter of its own")


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class DynamicSparsity:
    """Prune the smallest-norm live blocks of each block-sparse layer every ``every`` steps and
    grow as many dead ones, chosen by :meth:`grow_scores`: the best-scored that keep every block
    row and column within :func:`bstrain.layout.growth_limit` (or its longest before the update),
    which the kernels' tables hold, so that updates rewrite them in place.

    Args:
        model: holds the block-sparse layers (a ValueError if none).
        optimizer: its state of each layer's weight follows the moves (None: no optimizer state).
        every: optimizer steps between updates (>= 1).
        fraction: share of a layer's live blocks replaced at the first update, in (0, 1).
        stop: the last step that may update (None: never stop); the share decays by a cosine to
            0 at ``stop``.
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
        self._check_optimizer()
        self.also = [self._twin_layers(m) for m in also]
        for _, layer in self.layers:                  # tables of their own: updates rewrite them in place
            owner = getattr(layer, "op", layer)
            if hasattr(owner, "make_private"):
                owner.make_private()
        for other in self.also:
            for name, layer in self.layers:
                if name in other:
                    self._share(other[name], layer)
        self.steps = 0                  # optimizer steps seen
        self.history: list[dict] = []   # one entry per update: step, share changed per layer
        self._hooks: list = []
        self._grads: dict[str, _GradRecord] = {}
        self._captured_grads: dict[str, _GradRecord] = {}
        self._arm()

    @staticmethod
    def _share(twin: nn.Module, layer: nn.Module) -> None:
        """A twin's product reads the layer's private tables (its layout always follows the layer's:
        one rewrite serves both); other twins (convolutions) get private tables of their own."""
        from bstrain.ops.matmul import BlocksparseMatMul
        mine, theirs = getattr(twin, "op", twin), getattr(layer, "op", layer)
        if isinstance(mine, BlocksparseMatMul) and isinstance(theirs, BlocksparseMatMul):
            if mine._tables is not theirs._tables:
                mine.share_tables(theirs)
        elif hasattr(mine, "make_private"):
            mine.make_private()

    def _twin_layers(self, module: nn.Module) -> dict:
        """The layers of an ``also`` module (an ``AveragedModel``'s own model), by name: the same
        names, shapes and layouts as the model's (a ValueError otherwise)."""
        from torch.optim.swa_utils import AveragedModel
        twin = dict(sparse_layers(module.module if isinstance(module, AveragedModel) else module))
        for name, layer in self.layers:
            if isinstance(layer, _OpLayer):
                continue
            other = twin.get(name)
            if other is None or tuple(other.weight.shape) != tuple(layer.weight.shape) or \
                    not np.array_equal(other.block_layout(), layer.block_layout()):
                raise ValueError(f"also: expected modules shaped like the model, with its layouts; its layer "
                                 f"{name!r} is {'missing' if other is None else 'of another shape or layout'} in "
                                 f"a {type(module).__name__}")
        mine = {id(layer.weight): name for name, layer in self.layers}
        owner: dict[int, tuple[int, str]] = {}          # id(twin weight) -> (the model's group, a layer name)
        for index, group in enumerate(self.groups):
            for name, _ in group:
                other = twin.get(name)
                if other is None:
                    continue
                if id(other.weight) in mine:
                    raise ValueError(f"also: expected a copy with weights of its own, got a {type(module).__name__} "
                                     f"whose layer {name!r} holds the model's weight of {mine[id(other.weight)]!r} "
                                     f"(it would be moved twice)")
                first = owner.setdefault(id(other.weight), (index, name))
                if first[0] != index:
                    raise ValueError(f"also: layers {first[1]!r} and {name!r} share one weight in a "
                                     f"{type(module).__name__} but not in the model, where an update may give them "
                                     f"different layouts")
        _check_no_aliases([(f"the model's {name!r}", layer.weight) for name, layer in self.layers] +
                          [(f"the {type(module).__name__}'s {name!r}", layer.weight) for name, layer in twin.items()],
                          "also")
        return twin

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
        if self.updates_at(count):
            self._check_optimizer()         # refused state leaves the policy as it was: no step counted
        self.steps = count
        info = self._update(count) if self.updates_at(count) else None
        self._arm()
        return info

    @torch.no_grad()
    def _update(self, step: int) -> dict:
        self._check_optimizer()             # state that cannot follow the blocks: refused before any move
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
            planned = int(round(share * live))
            n = min(planned, int((~old).sum()))
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
        _move_blocks(old, new, [(weight, 0.0), *self._state_moves(weight)])
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
                self._share(twin, layer)            # again, if the layer took new tables
        return in_place

    def _new_layout(self, name: str, layer: nn.Module, old: np.ndarray, n: int, gen: torch.Generator) -> np.ndarray:
        """The layout after pruning and growing ``n`` blocks: the smallest-norm live ones go, or
        if balanced, each block column's smallest-norm share (a column's blocks can only be
        replaced within it: pruned by norm alone, the columns whose blocks start smallest, the
        longest, would lose most and take their blocks back)."""
        w = layer.weight.detach()
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

    # --- optimizer state ------------------------------------------------------------------------------
    def _check_optimizer(self) -> None:
        """A ValueError naming the optimizer and the key for state of a managed weight that cannot
        follow its blocks (see the module's docstring); nothing is moved before this passes."""
        opt = self.optimizer
        if opt is None:
            return
        if not (hasattr(opt, "state") and hasattr(opt, "param_groups")):
            raise ValueError(f"optimizer: expected a torch.optim.Optimizer (state and param_groups) or None, got a "
                             f"{type(opt).__name__}")
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        for group in self.groups:
            name, layer = group[0]
            w = layer.weight
            if isinstance(opt, torch.optim.LBFGS) and id(w) in held:
                raise ValueError(f"optimizer: LBFGS keeps its state (the directions 'd', 'old_dirs', 'old_stps') as "
                                 f"flat vectors over all its parameters, which a layout update cannot move block by "
                                 f"block; it holds the weight of {name!r}: use another optimizer for it")
            for key, value in opt.state.get(w, {}).items():
                if not (_is_scalar(value) or _per_block(value, w)):
                    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                        f"a {type(value).__name__}"
                    raise ValueError(f"optimizer: {type(opt).__name__} keeps state {key!r} for the weight of {name!r} "
                                     f"as {got}, which a layout update cannot move with its blocks: expected per-block "
                                     f"tensors of shape ({w.shape[0]}, ...) whose other dims are the weight's "
                                     f"{tuple(w.shape[1:])} or 1, or scalars")

    def _state_moves(self, weight: torch.Tensor) -> list[tuple[torch.Tensor, float | None]]:
        """(per-block state tensor of ``weight``, start of its grown blocks: a value, or None for
        the survivors' mean) for every state tensor that moves with the blocks."""
        if self.optimizer is None or not self.optimizer.state.get(weight):
            return []
        group = next((g for g in self.optimizer.param_groups if any(p is weight for p in g["params"])),
                     self.optimizer.defaults)
        return [(value, self._grown_start(key, group)) for key, value in self.optimizer.state[weight].items()
                if isinstance(value, torch.Tensor) and _per_block(value, weight)]

    def _grown_start(self, key: str, group: dict) -> float | None:
        """Where a grown block's state ``key`` starts: the optimizer's own start value for it
        (Adagrad's ``sum``: initial_accumulator_value; Rprop's ``step_size``: lr; else zero), or
        None (the survivors' mean) for second moments under grown_moments="mean"."""
        if self.grown_moments == "mean" and key in ("exp_avg_sq", "max_exp_avg_sq"):
            return None
        if isinstance(self.optimizer, torch.optim.Adagrad) and key == "sum":
            return float(group["initial_accumulator_value"])
        if isinstance(self.optimizer, torch.optim.Rprop) and key == "step_size":
            return float(group["lr"])
        return 0.0

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


class _GradRecord:
    """The dense weight gradient of one layer over the calls of one step: a running fp32 sum, and
    the (x, dY) of calls kept for one product at the end. A call whose x and dY take fewer bytes
    than the dense gradient (an LSTM's time step: 2.5 MB against 268 MB for a 4096 -> 16384 layer)
    is kept, so that the step costs one X·dY over all of them instead of a sum read and written per
    call; a larger one (a transformer's whole batch) goes into the sum at once."""

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self) -> "_GradRecord":
        out = _GradRecord()
        out.sum, out.calls = self.sum, list(self.calls)
        return out

    def add(self, layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
        from bstrain.nn.conv import BlockSparseConv2d
        if not isinstance(layer, BlockSparseConv2d):
            dense = layer.op.C * layer.op.K * 4
            if x.numel() * x.element_size() + dy.numel() * dy.element_size() < dense:
                self.calls.append((x, dy))
                return
        g = _dense_grad(layer, x, dy)
        if self.sum is None:
            self.sum = g
        else:
            self.sum.add_(g)

    def total(self, layer: nn.Module) -> torch.Tensor | None:
        """The step's dense fp32 gradient (None if no call reached the layer)."""
        g = self.sum
        if self.calls:
            xs, dys = zip(*self.calls)
            axis = layer.op.feature_axis
            if axis == 1:
                x2 = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])
                dy2 = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys])
            else:
                x2 = torch.cat([x.reshape(x.shape[0], -1) for x in xs], 1)
                dy2 = torch.cat([dy.reshape(dy.shape[0], -1) for dy in dys], 1)
            kept = _dense_grad(layer, x2, dy2)
            g = kept if g is None else g + kept
        return g


class _Unobserve:
    def __init__(self, op):
        self.op = op

    def remove(self) -> None:
        self.op.observer = None


def _switch(layer: nn.Module, new: np.ndarray) -> bool:
    """Switches ``layer`` (its weight already moved) to ``new``: op, tables and layout buffer.
    True when its tables were rewritten in place."""
    in_place = layer._switch_layout(new)
    if hasattr(layer, "_write_layout_buffer"):                              # a module's layout buffer
        layer._write_layout_buffer(new)
    return in_place


def _move_blocks(old: np.ndarray, new: np.ndarray, tensors: list[tuple[torch.Tensor, float | None]]) -> None:
    """Moves the blocks (dim 0) of each tensor from layout ``old`` to ``new``: a surviving block
    to its place in the new row-major block order, bit for bit; a grown one starts at its
    tensor's start value (None: the mean of the surviving blocks, zero if there are none)."""
    if int(new.sum()) != int(old.sum()):
        raise RuntimeError(f"sparsity: a new layout of {int(new.sum())} live blocks for a layer of {int(old.sum())}; "
                           f"please report this layout")
    old_id = np.full(old.shape, -1)
    old_id[old] = np.arange(int(old.sum()))
    src = torch.as_tensor(old_id[new])                                   # new block i <- old src[i] (or -1)
    keep = src >= 0
    dst_idx, src_idx = torch.nonzero(keep).flatten(), src[keep]
    for t, start in tensors:
        kept = t[src_idx.to(t.device)]                                   # (survivors, *block dims)
        if start is None:
            moved = torch.empty_like(t).fill_(kept.mean()) if kept.numel() else torch.zeros_like(t)
        else:
            moved = torch.full_like(t, start)
        moved[dst_idx.to(t.device)] = kept
        t.copy_(moved)


def _is_scalar(value) -> bool:
    """Optimizer state that does not depend on the blocks: a 0-dim tensor (a step count), a number."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return value is None or isinstance(value, (bool, int, float, complex))


def _per_block(value, weight: torch.Tensor) -> bool:
    """Whether ``value`` is optimizer state with a slice per block of ``weight``: (nnz, ...) with
    the weight's number of dims, each other dim the weight's or 1 (Adafactor's factored
    (nnz, bs, 1) and (nnz, 1, bs))."""
    return isinstance(value, torch.Tensor) and value.dim() == weight.dim() and value.shape[0] == weight.shape[0] \
        and all(d in (1, wd) for d, wd in zip(value.shape[1:], weight.shape[1:]))


def _dense_grad(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The dense fp32 weight gradient of one call of ``layer``: (C, K) for a product, (K, C, kh, kw)
    for a convolution (the calls of a step are summed before :func:`_block_norms`)."""
    from bstrain.nn.conv import BlockSparseConv2d
    if isinstance(layer, BlockSparseConv2d):
        from bstrain.ops.conv import conv_nd
        xb = x if x.dim() == 4 else x.unsqueeze(0)
        dyb = dy if dy.dim() == 4 else dy.unsqueeze(0)
        _, _, pads, _ = layer._geometry(xb.shape[2], xb.shape[3])
        with torch.enable_grad():
            wd = torch.zeros(layer.out_channels, layer.in_channels, *layer.kernel_size, device=x.device,
                             dtype=torch.float32, requires_grad=True)
            y = conv_nd(xb.float(), wd, layer.stride, layer.dilation, pads)
            (g,) = torch.autograd.grad(y, wd, dyb.float())                    # (K, C, kh, kw)
        return g
    # in the activations' dtype (bf16 under autocast: the GEMM accumulates in fp32; the scores only rank)
    dt = x.dtype if x.dtype == dy.dtype and x.is_cuda else torch.float32
    if layer.op.feature_axis == 1:
        x2, dy2 = x.reshape(-1, x.shape[-1]).to(dt), dy.reshape(-1, dy.shape[-1]).to(dt)
        g = (x2.t() @ dy2).float()                                              # (C, K)
    else:
        x2, dy2 = x.reshape(x.shape[0], -1).to(dt), dy.reshape(dy.shape[0], -1).to(dt)
        g = (x2 @ dy2.t()).float()
    return g


def _block_norms(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """(C/bs, K/bs) block norms of a dense gradient from :func:`_dense_grad`."""
    bs = _block_size(layer)
    if g.dim() == 4:                                                            # a conv's (K, C, kh, kw)
        K, C = g.shape[:2]
        return g.reshape(K // bs, bs, C // bs, bs, -1).square().sum((1, 3, 4)).t().sqrt()
    C, K = g.shape
    return g.reshape(C // bs, bs, K // bs, bs).square().sum((1, 3)).sqrt()


def _growth_limits(old: np.ndarray) -> tuple[int, int]:
    """The longest block row and column an unbalanced update may leave: the longer of
    :func:`bstrain.layout.growth_limit` (which the kernels' private tables hold) and the longest of
    ``old``. A function of the layout alone: every rank and a resumed run draw the same."""
    from bstrain.layout import growth_limit
    nnz, (rows, cols) = int(old.sum()), old.shape
    return (max(growth_limit(rows, nnz, cols), int(old.sum(1).max(initial=0))),
            max(growth_limit(cols, nnz, rows), int(old.sum(0).max(initial=0))))


def _fill(order: np.ndarray, room_r: np.ndarray, room_c: np.ndarray, n: int, cols: int) -> list[int]:
    """Up to ``n`` cells of ``order`` (flat indices, best first), taken in that order wherever the
    cell's row and column still have room (``room_r``, ``room_c``: counts, decremented in place).
    Cells whose row or column has filled up are dropped in bulk; the rest are walked on
    Python ints (numpy scalars cost ~10x more per cell)."""
    picked: list[int] = []
    while len(picked) < n and order.size:
        order = order[(room_r[order // cols] > 0) & (room_c[order % cols] > 0)]
        chunk = 2 * (n - len(picked)) + 64
        head, order = order[:chunk].tolist(), order[chunk:]
        lack_r, lack_c = room_r.tolist(), room_c.tolist()
        for flat in head:
            r, c = divmod(flat, cols)
            if lack_r[r] > 0 and lack_c[c] > 0:
                picked.append(flat)
                lack_r[r] -= 1
                lack_c[c] -= 1
                if len(picked) == n:
                    break
        room_r[:], room_c[:] = lack_r, lack_c
    return picked


def _grow_within(old: np.ndarray, new: np.ndarray, score: torch.Tensor, n: int, gen: torch.Generator,
                 limit_r: int, limit_c: int) -> np.ndarray:
    """Flat indices of ``n`` blocks to grow among those dead before the update, best-scored first,
    such that no block row ends longer than ``limit_r`` nor column longer than ``limit_c``
    (:func:`_growth_limits`: so the update rewrites the kernels' tables in place and a captured
    step stays valid). Where the greedy choice falls short, augmenting swaps (as in balanced
    growth) make room; only where no choice within the limits exists do the best remaining blocks
    fill the rest (the layer then takes new tables)."""
    dead, cols, free = int((~old).sum()), old.shape[1], ~old
    for k in dict.fromkeys((min(dead, 2 * n + 64), dead)):      # the best 2n first; all of them if that falls short
        room_r, room_c = limit_r - new.sum(1), limit_c - new.sum(0)
        order = _top(score, k, gen)                             # best first
        picked = _fill(order, room_r, room_c, n, cols)
        if len(picked) == n:
            return np.asarray(picked, dtype=np.int64)
    grown = np.zeros(old.shape, dtype=bool)
    grown.flat[picked] = True
    short = n - len(picked)
    while short:
        path = _augmenting_path(free, grown, room_r, room_c)
        if path is None:
            break
        for i, (r, c) in enumerate(path):                       # add, remove, add, ...: one more grown
            grown[r, c] = i % 2 == 0
        room_r[path[0][0]] -= 1
        room_c[path[-1][1]] -= 1
        short -= 1
    rest = [flat for flat in order.tolist() if not grown.flat[flat]][:short]
    return np.concatenate([np.flatnonzero(grown), np.asarray(rest, dtype=np.int64)])


def _grow_balanced(old: np.ndarray, new: np.ndarray, pruned: np.ndarray, score: torch.Tensor,
                   gen: torch.Generator) -> np.ndarray:
    """Grows blocks into ``new`` (``old`` with ``pruned`` dropped) so that every row and column of
    blocks gets its count back, with as few of the just-pruned blocks as the counts allow: first
    the best-scored blocks dead before the update whose row and column both still lack one, then
    augmenting swaps, each of the fewest just-pruned blocks (successive cheapest paths: a b-matching
    of the most blocks dead before the update). One always exists, since regrowing the pruned
    blocks closes every gap. Without the swaps, small or dense layouts often regrew exactly what
    was pruned."""
    need_r, need_c = old.sum(1) - new.sum(1), old.sum(0) - new.sum(0)      # blocks each still lacks
    free = ~new                                                            # where a block may grow
    cost = np.zeros(old.shape, dtype=np.int64)                             # a just-pruned block costs 1
    cost.flat[pruned] = 1
    grown = np.zeros(old.shape, dtype=bool)
    # the greedy fill, best first, over the blocks dead before the update whose row and column both
    # lack one (no other cell can be taken): a few percent of the layout
    order = np.flatnonzero(free & (cost == 0) & (need_r[:, None] > 0) & (need_c[None, :] > 0))
    order = order[_top(score.view(-1)[torch.as_tensor(order)], order.size, gen)]
    grown.flat[_fill(order, need_r, need_c, int(need_r.sum()), old.shape[1])] = True
    while need_r.any():
        path = _augmenting_path(free, grown, need_r, need_c, cost)
        if path is None:                    # cannot happen (the pruned blocks are a solution)
            raise RuntimeError("sparsity: no balanced regrowth found; please report this layout")
        for k, (r, c) in enumerate(path):   # add, remove, add, ..., add
            grown[r, c] = k % 2 == 0
        need_r[path[0][0]] -= 1
        need_c[path[-1][1]] -= 1
    return new | grown


def _augmenting_path(free: np.ndarray, grown: np.ndarray, need_r: np.ndarray, need_c: np.ndarray,
                     cost: np.ndarray | None = None):
    """Cells [(r0, c0), (r1, c0), (r1, c1), ...] from a row that lacks a block to a column that
    lacks one: grow the 1st, 3rd, ... (free, not grown) and drop the 2nd, 4th, ... (grown); None if
    there is none. With ``cost`` (per cell), the cheapest such path (growing a cell adds its cost,
    dropping one takes it off): from a grown set of the least cost for its size, the grown set
    then stays of the least cost for its size. Bellman-Ford over the rows and columns, a
    whole-matrix relaxation at a time (the grown set has no negative cycle)."""
    rows, cols = free.shape
    cost = np.zeros(free.shape) if cost is None else cost.astype(np.float64)
    can_grow = free & ~grown
    d_row = np.where(need_r > 0, 0.0, np.inf)       # the cheapest way to reach each row and column
    d_col = np.full(cols, np.inf)
    col_from = np.full(cols, -1)                    # the row a column was reached from (a cell grown)
    row_from = np.full(rows, -1)                    # the column a row was reached from (a cell dropped)
    for _ in range(rows + cols + 1):
        via = np.where(can_grow, d_row[:, None] + cost, np.inf)        # row -> column: grow (r, c)
        r_best = via.argmin(0)
        better = via[r_best, np.arange(cols)] < d_col
        d_col[better], col_from[better] = via[r_best, np.arange(cols)][better], r_best[better]
        via = np.where(grown, d_col[None, :] - cost, np.inf)           # column -> row: drop (r, c)
        c_best = via.argmin(1)
        better_r = via[np.arange(rows), c_best] < d_row
        d_row[better_r], row_from[better_r] = via[np.arange(rows), c_best][better_r], c_best[better_r]
        if not (better.any() or better_r.any()):
            break
    ends = np.flatnonzero((need_c > 0) & np.isfinite(d_col))
    if not ends.size:
        return None
    path, c = [], int(ends[d_col[ends].argmin()])
    while True:                                     # walk back to a row that lacks a block
        r0 = int(col_from[c])
        path.append((r0, c))
        if row_from[r0] < 0:
            return path[::-1]
        path.append((r0, int(row_from[r0])))
        c = int(row_from[r0])


def _top(score: torch.Tensor, n: int, gen: torch.Generator) -> np.ndarray:
    """Flat indices of the n highest scores of ``score`` (ties in a random order drawn from gen)."""
    flat = score.flatten()
    order = torch.randperm(flat.numel(), generator=gen)
    if n >= flat.numel():
        best = torch.argsort(flat[order], descending=True, stable=True)
    else:       # a partial selection: an update replaces a few percent of a layer's blocks
        best = torch.topk(flat[order], n).indices
    return order[best].numpy()


def _all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over the ranks of the default process group (unchanged without one)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()
