"""The trainer's side of dynamic block sparsity (:mod:`bstrain.sparsity`): the policy the
``sparsity`` config group names, its cadence, and what an update means for the run.

An update rewrites the layers' layout tables in place (the live-block count is kept, so every
table keeps its length), and the captured step and the graphed evaluation stay valid; where a
layer's tables cannot take its new layout (a block row or column longer than they hold; a
block-diagonal convolution that now needs a channel gather), it gets new tables, and the graphs are dropped and captured again when next needed. The step whose gradients RigL reads (the one before an update)
has a capture of its own with the hooks armed (where it cannot be captured, it runs eagerly). The
layouts travel in the model's state dict; the policy's step count is the run's.
"""
from __future__ import annotations

import logging
import warnings

from bstrain.configs.schema import GrownMoments, Policy
from bstrain.errors import UserError

log = logging.getLogger("bstrain")


def policy_choice(cfg) -> Policy:
    """``sparsity.policy`` typed (static where the config has no sparsity section); UserError else."""
    s = cfg.get("sparsity")
    try:
        return Policy.static if s is None else Policy(s.policy)
    except ValueError:
        raise UserError(f"sparsity.policy: expected one of {', '.join(p.value for p in Policy)}, "
                        f"got {s.policy!r}") from None


def make_policy(cfg, model, optimizer, ema, max_steps: int, policy: Policy | None = None):
    """The :class:`bstrain.sparsity.DynamicSparsity` of ``cfg.sparsity``, or None for "static".
    policy: :func:`policy_choice` of ``cfg`` (None: read here)."""
    from bstrain.sparsity import SET, RigL
    policy = policy_choice(cfg) if policy is None else policy
    if policy is Policy.static:
        return None
    s, cls, policy = cfg.sparsity, {Policy.set: SET, Policy.rigl: RigL}[policy], policy.value
    limit = cfg.trainer.get("time_limit_s") or 0
    if limit:
        log.warning("sparsity=%s: the share decays and the layouts freeze by steps of trainer.max_steps (%d; frozen "
                    "from step %d), while trainer.time_limit_s=%g may end the run sooner; set trainer.max_steps to "
                    "about the steps that time allows", policy, max_steps, int(s.until * max_steps), limit)
    if int(s.until * max_steps) <= s.every:
        log.warning("sparsity=%s: no layout update will run: sparsity.until x trainer.max_steps = %d steps is not "
                    "more than sparsity.every = %d", policy, int(s.until * max_steps), s.every)
    try:
        with warnings.catch_warnings(record=True) as caught:      # into train.log (layers a balanced update
            warnings.simplefilter("always")                       # can never move), not only to stderr
            made = cls(model, optimizer, every=s.every, fraction=s.fraction, stop=int(s.until * max_steps),
                       balanced=bool(s.balanced), seed=s.seed, also=() if ema is None else (ema.module,),
                       grown_moments=GrownMoments(s.get("grown_moments", "zero")).value)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("model:"):
            raise UserError(f"sparsity={policy}: {msg[len('model: '):]}") from None
        raise UserError(f"sparsity.{msg}") from None
    for w in caught:
        log.warning("sparsity=%s: %s", policy, w.message)
    return made


def allow_recompiles(policy) -> None:
    """An update that gives a layer new tables (a block row or column longer than its tables
    hold; a block-diagonal convolution that now needs a gather) makes torch.compile trace the
    model once more (the layouts are constants of the graph); dynamo's recompile limit (8 per
    frame) would otherwise send the model back to eager after the eighth. Raised to the run's
    number of updates, plus margin."""
    import torch._dynamo.config as dynamo
    updates = (policy.stop or 0) // policy.every + 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), updates))
            break
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 4 * updates))
            break


class GradientHooks:
    """RigL's protocol as the stepper sees it (:class:`bstrain.train.stepper.Stepper`): a step
    is ``armed`` when the policy reads its gradients through hooks (the step before an update);
    ``before_step`` starts the hooks' sums, ``after_capture`` says a captured graph writes them,
    ``after_replay`` that a replay of that graph just did."""

    def __init__(self, policy):
        self.policy = policy

    @property
    def armed(self) -> bool:
        return self.policy.armed

    def before_step(self) -> None:
        self.policy.begin_step()

    def after_capture(self) -> None:
        self.policy.keep_captured()

    def after_replay(self) -> None:
        self.policy.use_captured()


def wants_eager(run) -> bool:
    """Deprecated: ``GradientHooks(policy).armed``."""
    import warnings
    warnings.warn("bstrain.train.sparsity.wants_eager is deprecated: ask GradientHooks(policy).armed",
                  DeprecationWarning, stacklevel=2)
    return run.sparsity is not None and run.sparsity.armed


def after_step(policy, step: int, stepper, board) -> dict | None:
    """Lets the policy update the layouts after the optimizer step ``step``; on an update that
    gave layers new tables, the stepper drops the graphs made on the old ones; logs the change."""
    info = policy.step(step)
    if info is None:
        return None
    if not info["in_place"]:                       # new tables: the graphs made on the old ones go
        stepper.drop_graphs()                      # captured again when next needed, on the new tables
    log.info("sparsity: step %d, %s, %s, %.0f ms", step, describe_update(info),
             "tables rewritten in place" if info["in_place"] else "new tables", 1e3 * info["seconds"])
    blocks = info["blocks"]
    board.scalars(step, {"sparsity/changed": blocks["replaced"] / max(1, blocks["live"]),
                             "sparsity/planned": blocks["planned"] / max(1, blocks["live"]),
                             "sparsity/fraction": info["fraction"],
                             **{f"sparsity/changed/{k}": v for k, v in info["changed"].items()},
                             **{f"sparsity/density/{k}": v for k, v in info["density"].items()}})
    board.layouts(step, {name: layer.block_layout() for name, layer in policy.layers})
    return info


def describe_update(info: dict) -> str:
    """What an update did, for train.log: the blocks replaced over all layers (a shared weight
    counted once), and how that follows from the scheduled share. Each layer replaces
    round(share × its live blocks), whole blocks, so the planned total can be above or below the
    share (0.9% of a 64-block layer rounds to 1 block, 1.6%); a balanced update may regrow some
    pruned blocks, and a layer with too few dead blocks prunes fewer."""
    blocks, share = info["blocks"], info["fraction"]
    live, planned, pruned, replaced = (blocks[k] for k in ("live", "planned", "pruned", "replaced"))
    text = (f"{replaced} of {live} live blocks replaced ({replaced / max(1, live):.1%}); planned {planned} "
            f"({planned / max(1, live):.1%}): the scheduled share {share:.1%} of each layer's live blocks, rounded "
            f"to whole blocks per layer")
    if pruned < planned:
        text += f"; {planned - pruned} of them not pruned: too few dead blocks to grow"
    if replaced < pruned:
        text += (f"; {_blocks(pruned - replaced)} pruned and grown back in place (balanced: every block row and "
                 f"column keeps its count)")
    return text


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"
