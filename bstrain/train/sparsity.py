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

from bstrain.errors import UserError

log = logging.getLogger("bstrain")


def _value(v):
    return getattr(v, "value", v)


def make_policy(cfg, model, optimizer, ema, max_steps: int):
    """The :class:`bstrain.sparsity.DynamicSparsity` of ``cfg.sparsity``, or None for "static"."""
    from bstrain.sparsity import POLICIES, SET, RigL
    s = cfg.get("sparsity")
    policy = "static" if s is None else _value(s.policy)
    if policy not in POLICIES:
        raise UserError(f"sparsity.policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "static":
        return None
    if not 0 < s.until <= 1:
        raise UserError(f"sparsity.until: expected a share of trainer.max_steps in (0, 1], got {s.until!r}")
    cls = {"set": SET, "rigl": RigL}[policy]
    limit = cfg.trainer.get("time_limit_s") or 0
    if limit:
        log.warning("sparsity=%s: the share decays and the layouts freeze by steps of trainer.max_steps (%d; frozen "
                    "from step %d), while trainer.time_limit_s=%g may end the run sooner; set trainer.max_steps to "
                    "about the steps that time allows", policy, max_steps, int(s.until * max_steps), limit)
    if int(s.until * max_steps) <= s.every:
        log.warning("sparsity=%s: no layout update will run: sparsity.until x trainer.max_steps = %d steps is not "
                    "more than sparsity.every = %d", policy, int(s.until * max_steps), s.every)
    try:
        return cls(model, optimizer, every=s.every, fraction=s.fraction, stop=int(s.until * max_steps),
                   balanced=bool(s.balanced), seed=s.seed, also=() if ema is None else (ema.module,),
                   grown_moments=_value(s.get("grown_moments", "zero")))
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("model:"):
            raise UserError(f"sparsity={policy}: {msg[len('model: '):]}") from None
        raise UserError(f"sparsity.{msg}") from None


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


def wants_eager(run) -> bool:
    """The coming step reads its gradients through hooks (RigL's, before an update): it runs
    eagerly, or from the capture made with the hooks armed."""
    return run.sparsity is not None and run.sparsity.armed


def after_step(run, board) -> dict | None:
    """Lets the policy update the layouts after the optimizer step ``run.step``; on an update,
    drops the graphs made on the old tables and logs the change."""
    info = run.sparsity.step(run.step)
    if info is None:
        return None
    if not info["in_place"]:                       # new tables: the graphs made on the old ones go
        for captured in (run.captured, getattr(run, "captured_armed", None)):
            if captured is not None:
                captured.graph = None              # captured again when next needed, on the new tables
        run.eval_forwards.clear()
    changed = sum(info["changed"].values()) / max(1, len(info["changed"]))
    log.info("sparsity: step %d, %.1f%% of the live blocks replaced (share %.3f), %s, %.0f ms", run.step,
             100 * changed, info["fraction"], "tables rewritten in place" if info["in_place"] else "new tables",
             1e3 * info["seconds"])
    board.scalars(run.step, {"sparsity/changed": changed,
                             **{f"sparsity/changed/{k}": v for k, v in info["changed"].items()},
                             **{f"sparsity/density/{k}": v for k, v in info["density"].items()}})
    board.layouts(run.step, {name: layer.block_layout() for name, layer in run.sparsity.layers})
    return info
