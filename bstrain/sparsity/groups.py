"""Which layers a policy manages and how they group: the block-sparse layers of a model, ``ops``
pairs seen as layers, the layers that share one weight (an update gives them one layout), an
``also`` copy's layers, and the checks that refuse the ties an update cannot keep."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


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
        local = w.to_local() if hasattr(w, "to_local") else w          # a DTensor's own shard (FSDP)
        if w.is_meta or local.numel() == 0:
            continue
        first = seen.setdefault(local.data_ptr(), (name, id(w)))
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


def _twin_layers(module: nn.Module, layers: list, groups: list) -> dict:
    """The layers of an ``also`` module (an ``AveragedModel``'s own model), by name: the same
    names, shapes and layouts as the model's ``layers`` (a ValueError otherwise); ``groups``: the
    model's layers by weight (:func:`_weight_groups`)."""
    from torch.optim.swa_utils import AveragedModel
    twin = dict(sparse_layers(module.module if isinstance(module, AveragedModel) else module))
    for name, layer in layers:
        if isinstance(layer, _OpLayer):
            continue
        other = twin.get(name)
        if other is None or tuple(other.weight.shape) != tuple(layer.weight.shape) or \
                not np.array_equal(other.block_layout(), layer.block_layout()):
            raise ValueError(f"also: expected modules shaped like the model, with its layouts; its layer "
                             f"{name!r} is {'missing' if other is None else 'of another shape or layout'} in "
                             f"a {type(module).__name__}")
    mine = {id(layer.weight): name for name, layer in layers}
    owner: dict[int, tuple[int, str]] = {}          # id(twin weight) -> (the model's group, a layer name)
    for index, group in enumerate(groups):
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
    _check_no_aliases([(f"the model's {name!r}", layer.weight) for name, layer in layers] +
                      [(f"the {type(module).__name__}'s {name!r}", layer.weight) for name, layer in twin.items()],
                      "also")
    return twin
