"""``sparsify``: replace a dense model's layers by block-sparse ones, and the registry of the layer
types it converts (``register_sparsifiable``): ``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2's
transposed linear, recognised by name so that bstrain never imports transformers) and
``nn.Conv2d`` are its first entries."""
from __future__ import annotations

import difflib
import fnmatch
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import nn

from bstrain import layout as layouts
from bstrain.nn._sparse import sparsify_candidates
from bstrain.nn.conv import BlockSparseConv2d, _check_convertible
from bstrain.nn.linear import BlockSparseLinear, linear_parts
from bstrain.ops.matmul import check_block_size

__all__ = ["SparsifyResult", "register_sparsifiable", "sparsify"]

HF_CONV1D = "transformers.pytorch_utils.Conv1D"
RECORD_KEY = "bstrain_sparsify"          # the PretrainedConfig attribute sparsify's records go in


@dataclass(frozen=True)
class _Entry:
    to_sparse: Callable[..., nn.Module]
    check: Callable[[str, nn.Module, int], None] | None


_REGISTRY: dict[type | str, _Entry] = {}


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_sparsifiable(cls: type | str, *, to_sparse: Callable[..., nn.Module],
                          check: Callable[[str, nn.Module, int], None] | None = None) -> None:
    """Lets :func:`sparsify` convert layers of exactly type ``cls`` (not its subclasses).

    Args:
        cls: the dense layer class, or its qualified name (``"transformers.pytorch_utils.Conv1D"``)
            to recognise it without importing its package. Registering a type again replaces it.
        to_sparse: ``(layer, *, block_size, density, keep_weights, balanced) -> nn.Module``, the
            block-sparse layer put in its place (with ``keep_weights``, the dense layer's
            largest-norm blocks; without, a fresh layout on the layer's device and dtype).
        check: ``(name, layer, block_size) -> None`` raising a ValueError that starts with
            ``name`` when ``layer`` cannot be converted; ``sparsify`` then raises it before
            replacing anything, or skips the layer under ``errors="skip"``.
    """
    if not (isinstance(cls, type) or (isinstance(cls, str) and "." in cls)):
        raise TypeError(f"cls: expected a layer class or its qualified name ('package.module.Class'), got {cls!r}")
    if not callable(to_sparse) or not (check is None or callable(check)):
        raise TypeError("to_sparse, check: expected functions (check may be None)")
    _REGISTRY[cls] = _Entry(to_sparse, check)


def _entry(cls: type) -> _Entry | None:
    return _REGISTRY.get(cls) or _REGISTRY.get(_type_name(cls))


def _check_linear(name: str, layer: nn.Module, block_size: int) -> None:
    """A ValueError naming ``name`` when ``layer`` (an nn.Linear or a Conv1D) has no
    BlockSparseLinear equivalent."""
    C, K, _, _ = linear_parts(layer)
    if C % block_size or K % block_size:
        raise ValueError(f"{name}: expected in/out features that are multiples of block_size={block_size}, "
                         f"got {C} and {K}")


def _linear_to_sparse(layer: nn.Module, *, block_size: int, density: float, keep_weights: bool,
                      balanced: bool) -> BlockSparseLinear:
    if keep_weights:
        return BlockSparseLinear.from_dense(layer, block_size=block_size, density=density)
    C, K, weight, bias = linear_parts(layer)
    return BlockSparseLinear(C, K, bias is not None, block_size=block_size, density=density, balanced=balanced,
                             device=weight.device, dtype=weight.dtype)


def _conv_to_sparse(conv: nn.Conv2d, *, block_size: int, density: float, keep_weights: bool,
                    balanced: bool) -> BlockSparseConv2d:
    return BlockSparseConv2d.sparsified(conv, block_size=block_size, density=density, keep_weights=keep_weights)


register_sparsifiable(nn.Linear, to_sparse=_linear_to_sparse, check=_check_linear)
register_sparsifiable(HF_CONV1D, to_sparse=_linear_to_sparse, check=_check_linear)
register_sparsifiable(nn.Conv2d, to_sparse=_conv_to_sparse, check=_check_convertible)


class SparsifyResult(list):
    """What :func:`sparsify` returns: the list of names it replaced (it compares and prints as that
    list), and ``skipped``, {name: why} of each chosen layer it left dense under ``errors="skip"``
    (every name of the layer; empty otherwise)."""

    def __init__(self, replaced=(), skipped: dict[str, str] | None = None):
        super().__init__(replaced)
        self.skipped = dict(skipped or {})


def _asks(include: Callable, name: str, module: nn.Module) -> bool:
    """``include(name, module)`` for the error message only: a function written for the layers
    it expects may fail on other modules, which then count as not chosen."""
    try:
        return bool(include(name, module))
    except Exception:                                    # noqa: BLE001 (any failure means "not this one")
        return False


def _nothing_chosen(model: nn.Module, include, convertible: list[str]) -> str:
    """The message of a ``sparsify`` call whose ``include`` chose no convertible layer."""
    names = [(n, m) for n, m in model.named_modules() if n]
    if isinstance(include, str):
        what, matched = f"include={include!r}", [(n, m) for n, m in names if fnmatch.fnmatchcase(n, include)]
    else:
        what = f"include={getattr(include, '__name__', type(include).__name__)}"
        matched = [(n, m) for n, m in names if _asks(include, n, m)]
    if matched:
        types = sorted({type(m).__name__ for _, m in matched})
        inside = isinstance(include, str) and any(f"{n}." in c for n, _ in matched for c in convertible)
        hint = f" (to reach the layers inside them, try {include + '.*'!r})" if inside else ""
        return (f"{what}: expected a layer sparsify converts, got {len(matched)} module(s) of type(s) "
                f"{', '.join(types)}{hint}; to convert a type of your own, call "
                f"bstrain.nn.register_sparsifiable({types[0]}, to_sparse=...)")
    if not isinstance(include, str):
        return (f"{what}: expected it to choose a module of {type(model).__name__}, it chose none; its convertible "
                f"layers include {', '.join(repr(n) for n in convertible[:3]) or 'none'}")
    close = difflib.get_close_matches(include, [n for n, _ in names], n=3, cutoff=0.0)
    return (f"{what}: expected a glob matching module names of {type(model).__name__}, it matches none; "
            f"the closest are {', '.join(repr(n) for n in close) or 'none (the model has no submodule)'}")


def _record(model: nn.Module, record: dict) -> None:
    """Appends ``record`` to ``model.config.bstrain_sparsify`` when ``model`` carries a Hugging Face
    config, so that ``save_pretrained`` writes it to config.json and
    :func:`bstrain.hf.from_pretrained` can re-apply the call."""
    transformers = sys.modules.get("transformers")        # a HF config means transformers is loaded
    config = getattr(model, "config", None)
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return
    setattr(config, RECORD_KEY, [*(getattr(config, RECORD_KEY, None) or []), record])


def sparsify(model: nn.Module, include: str | Callable[[str, nn.Module], bool], *, block_size: int = 32,
             density: float, keep_weights: bool = True, balanced: bool = True,
             errors: str = "raise") -> SparsifyResult:
    """Replaces, in place, the layers of ``model`` chosen by ``include`` whose type is registered
    (:func:`register_sparsifiable`: ``nn.Linear`` and Hugging Face's ``Conv1D`` become
    :class:`BlockSparseLinear`, ``nn.Conv2d`` :class:`BlockSparseConv2d`).

    Layers are replaced per module object, as ``torch.nn.utils.parametrize`` works: a layer
    registered under several names (``model.dec = model.enc``, twice in an ``nn.ModuleList``,
    under two parents) is chosen when ``include`` chooses any of its names, and one block-sparse
    layer then takes every registration, so the sharing stays. To keep such a layer dense, choose
    none of its names. A layer whose parameter is tied to another module's (``b.weight =
    a.weight``, a head tied to an ``nn.Embedding``) cannot be converted: a copy would untie them.
    Only layers of exactly the registered types are candidates (subclasses such as
    ``nn.MultiheadAttention``'s ``out_proj``, whose weight their owner reads, are left alone).

    A ``include`` that chooses no convertible layer is a ValueError naming the closest module
    names, or the types of the modules it chose (a warning under ``errors="skip"``). When
    ``model`` has a Hugging Face config, the call is recorded in ``model.config.bstrain_sparsify``
    (the names replaced, block_size, density, balanced), so that ``model.save_pretrained(path)``
    saves it and :func:`bstrain.hf.from_pretrained` loads it back.

    Args:
        include: a glob on qualified module names (``"blocks.*.mlp.*"``, ``"*"``), or a function
            ``(name, layer) -> bool``, asked for each name of a layer of a registered type.
        density: fraction of live blocks of each new layer.
        keep_weights: True keeps the largest-norm blocks of the dense weights and the biases
            (``from_dense``); False draws a fresh layout and initialises it.
        balanced: for linear layers without keep_weights, draw a balanced layout (the default) or
            an independent one; conv layouts are always balanced.
        errors: what a chosen layer that cannot be converted (features or channels not multiples
            of block_size, a grouped conv, a tied parameter) does: "raise" (the default) raises a
            ValueError naming it before any layer is replaced; "skip" leaves it dense, warns once
            listing the skipped layers and why, and records them in the result's ``skipped``.
    Returns the names replaced, in module order, every name of a layer registered under several
    (a list: a :class:`SparsifyResult`, whose ``skipped`` is {name: why} under ``errors="skip"``).
    """
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors: expected 'raise' or 'skip', got {errors!r}")
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    block_size, density = int(block_size), layouts.check_density(density)
    entries = {t: e for t in {type(m) for m in model.modules()} if (e := _entry(t)) is not None}
    chosen, problems = sparsify_candidates(model, include, block_size,
                                           {t: e.check or (lambda *_: None) for t, e in entries.items()})
    if not chosen and not problems:
        convertible = [n for n, m in model.named_modules() if n and type(m) in entries]
        message = _nothing_chosen(model, include, convertible)
        if errors == "raise":
            raise ValueError(message)
        warnings.warn(f"sparsify replaced nothing (errors='skip'): {message}", stacklevel=2)
        return SparsifyResult()
    if any(entries[type(m)].check is _check_linear for m in [m for _, m in chosen] + [m for m, _, _ in problems]):
        check_block_size(block_size)         # the Linear kernels' sizes, whatever errors says; conv takes any
    if problems and errors == "raise":
        raise ValueError(problems[0][2])
    new: dict[int, nn.Module] = {}                       # one replacement per layer object
    for _, m in chosen:
        if id(m) not in new:
            new[id(m)] = entries[type(m)].to_sparse(m, block_size=block_size, density=density,
                                                    keep_weights=keep_weights, balanced=balanced)
    for name, m in chosen:                               # built all first: a failed build replaces nothing
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new[id(m)])
    skipped = {name: why for _, names, why in problems for name in names}
    if skipped:
        warnings.warn(f"sparsify left {len(problems)} chosen layer(s) dense (errors='skip'): "
                      + "; ".join(why for *_, why in problems), stacklevel=2)
    replaced = [name for name, _ in chosen]
    if replaced:
        _record(model, {"replaced": replaced, "block_size": block_size, "density": density, "balanced": balanced})
    return SparsifyResult(replaced, skipped)
