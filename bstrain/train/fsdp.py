"""FSDP2 for models that outgrow DDP (the strategy objects: bstrain/train/strategy.py).

``trainer.strategy``: ``single`` (one process), ``ddp`` (torchrun; every process holds the whole
model and DDP averages gradients) or ``fsdp`` (torchrun; PyTorch's FSDP2, ``fully_shard``: each
process holds 1/N of the parameters, gradients and AdamW state, and gathers a block's parameters
only while it runs). ``auto`` is ddp under torchrun with more than one process, else single.

Under fsdp the model is sharded block by block, then at its root. The blocks (the units that
gather together) are what the model's ``shard_units()`` returns (the built-in models: transformer
layers and ResNet blocks; the LSTM, whose layers run at every timestep, is one unit) or, for a
user's ``_target_`` model, the modules that
``model.shard`` names: a list of module names as in ``named_modules()`` (shell patterns such as
``blocks.*`` allowed) or class names (``Block``, or a class path ``my_pkg.Block``). A block-sparse
weight ``(nnz, bs, bs)`` is sharded along its blocks. Mixed precision is FSDP's own
``MixedPrecisionPolicy``: 16-bit parameters for compute, fp32 gradient reduction, fp32 master
weights (and the trainer's autocast around the forward as in the other strategies); batch norms
are units of their own that keep fp32 parameters.

fp16's loss scaler all-reduces its inf check (each rank sees only its shards of the gradients).
Dynamic sparsity gathers each managed weight and its optimizer state whole at an update, moves
the blocks as one process does, and each rank keeps its shard (bstrain/sparsity/remap.py).
"""
from __future__ import annotations

import fnmatch
import importlib

import torch
from torch import nn

from bstrain.configs.schema import Strategy as Choice
from bstrain.errors import UserError
from bstrain.train.distributed import World, check_same_layouts

SHARD_KEY = "shard"
"""The model-section key naming a user model's FSDP units (left out of the model's constructor)."""


def __getattr__(name: str):
    if name == "STRATEGIES":                        # (moved: the schema's Enum is the one list)
        import warnings
        warnings.warn("bstrain.train.fsdp.STRATEGIES is deprecated: use bstrain.configs.schema.Strategy",
                      DeprecationWarning, stacklevel=2)
        return tuple(c.value for c in Choice)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_strategy(value, world: World) -> str:
    """Deprecated: :func:`bstrain.train.strategy.resolve` on the typed ``trainer.strategy``."""
    import warnings

    from bstrain.train.distributed import resolve_strategy as resolve
    warnings.warn("bstrain.train.fsdp.resolve_strategy is deprecated: use bstrain.train.strategy.resolve",
                  DeprecationWarning, stacklevel=2)
    try:
        value = Choice(value)
    except ValueError:
        raise UserError(f"trainer.strategy: expected one of {', '.join(m.value for m in Choice)}, got {value!r}") \
            from None
    return resolve(value, world).value


def _named_class(name: str):
    """The class a dotted ``name`` imports, or None."""
    if "." not in name:
        return None
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


def _name_matches(name: str, pattern: str) -> bool:
    """A module name against a pattern, part by dotted part (``blocks.*`` is ``blocks.0``, not
    ``blocks.0.norm``)."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def shard_units(model: nn.Module, spec=None) -> list[nn.Module]:
    """The modules to shard before the root: those ``spec`` names (a user's ``model.shard``),
    else the model's own ``shard_units()``, else none (the root alone)."""
    if spec is None:
        own = getattr(model, "shard_units", None)
        return list(own()) if callable(own) else []
    if isinstance(spec, str):
        spec = [spec]
    if not isinstance(spec, (list, tuple)):
        raise UserError(f"model.shard: expected a list of module names or class names, got {spec!r}")
    units, names = [], dict(model.named_modules())
    for entry in spec:
        if not isinstance(entry, str) or not entry:
            raise UserError(f"model.shard: expected a list of module names or class names, got {entry!r}")
        cls = _named_class(entry)
        hits = [m for n, m in names.items() if n and (_name_matches(n, entry) or
                                                      (cls is not None and isinstance(m, cls)) or
                                                      type(m).__name__ == entry)]
        if not hits:
            some = ", ".join(n for n in list(names)[1:6])
            raise UserError(f"model.shard: {entry!r} matches no module of {type(model).__name__} (module names such "
                            f"as {some}, or a class name)")
        if containers := [n for n, m in names.items() if n and any(m is h for h in hits)
                          and isinstance(m, (nn.ModuleList, nn.ModuleDict))]:
            # a container has no forward of its own: FSDP would never gather it (a traceback on every rank)
            raise UserError(f"model.shard: {entry!r} names {containers[0]} ({type(names[containers[0]]).__name__}), "
                            f"a container without a forward; name its children: {containers[0]}.*")
        units += [m for m in hits if all(m is not u for u in units)]
    return _inner_first(units)


def _inner_first(units: list[nn.Module]) -> list[nn.Module]:
    """Units ordered inner before outer: fully_shard must reach a nested unit before the one holding it."""
    def depth(u):
        return sum(1 for v in units if v is not u and any(u is m for m in v.modules()))
    return sorted(units, key=depth, reverse=True)


def shard(model: nn.Module, world: World, device: torch.device, amp_dtype: torch.dtype | None, spec=None) -> nn.Module:
    """``fully_shard`` on each unit, then on the root (in place); returns the model.

    The layouts are checked to agree across ranks first (a rank that drew another layout would
    shard a different weight: one clear error instead)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    check_same_layouts(model, world)
    mesh = init_device_mesh(device.type, (world.size,))
    mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32) if amp_dtype is not None else \
        MixedPrecisionPolicy()
    units = shard_units(model, spec)
    if any(u is model for u in units):
        raise UserError(f"model.shard: expected the model's blocks (the root is sharded anyway), got the model "
                        f"itself ({type(model).__name__})")
    if amp_dtype is not None:       # batch norms keep fp32 parameters, as their fp32 running statistics need
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    _check_ties(model, units)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _check_ties(model: nn.Module, units: list[nn.Module]) -> None:
    """A UserError naming a parameter registered both inside a unit and outside it (in another unit or
    at the root): FSDP shards a parameter in one group, and would stop at the first forward."""
    names = {id(m): n for n, m in model.named_modules()}
    home: dict[int, str] = {}                       # id(parameter) -> its unit's name ("" for the root)
    for unit in units:
        for p in unit.parameters():
            home.setdefault(id(p), names[id(unit)])
    for name, p in model.named_parameters(remove_duplicate=False):
        unit = next((names[id(u)] for u in units if name.startswith(names[id(u)] + ".")), "")
        if id(p) in home and home[id(p)] != unit:
            raise UserError(f"model.shard: {name} is tied to a parameter of unit {home[id(p)]} but lies "
                            f"{f'in unit {unit}' if unit else 'outside the units'}; FSDP shards a tied parameter "
                            f"once: name a module that holds every tie in model.shard, or untie them")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) is FSDP2-sharded."""
    from torch.distributed.fsdp import FSDPModule
    return any(isinstance(m, FSDPModule) for m in model.modules())


def class_name(model: nn.Module) -> str:
    """The model's own class name (``SparseLSTM``, not FSDP's ``FSDPSparseLSTM``)."""
    from torch.distributed.fsdp import FSDPModule
    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next((b for b in cls.__bases__ if b is not FSDPModule), cls)
    return cls.__name__


def reshard(model: nn.Module) -> None:
    """Frees every unit's gathered parameters: after a forward without backward (evaluation, the
    start's check of the first batch) the root keeps its gathers, and its registered parameters
    are the gathered tensors, not the shards."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
