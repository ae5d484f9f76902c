"""Saving and loading Hugging Face models that :func:`bstrain.nn.sparsify` changed.

``sparsify`` records each call in ``model.config.bstrain_sparsify`` (the names it replaced,
block_size, density, balanced), so ``model.save_pretrained(path)`` writes it to config.json beside
the weights (the block-sparse layers' ``layout`` buffers included). A plain
``LlamaForCausalLM.from_pretrained(path)`` builds the dense model and cannot take those weights;
:func:`from_pretrained` builds it, re-applies the recorded calls, then loads the weights::

    model.save_pretrained("out")                            # transformers' own call
    model = bstrain.hf.from_pretrained(LlamaForCausalLM, "out")

transformers is imported here only, never by ``import bstrain``.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from bstrain.nn.convert import RECORD_KEY, sparsify

__all__ = ["from_pretrained"]

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"


def _read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict saved by ``save_pretrained`` in ``path``: one safetensors file or its shards."""
    from safetensors.torch import load_file
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, _WEIGHTS)):
        files = [_WEIGHTS]
    else:
        raise FileNotFoundError(f"path: expected a directory written by save_pretrained ({_WEIGHTS} or {_INDEX}), "
                                f"got {os.fspath(path)!r} without them")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def _add_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``save_pretrained`` saves a tied parameter under one of its names (GPT-2's head under the
    embedding's): the other names take the same tensor, and ``tie_weights`` ties them again."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        saved = next((n for n in group if n in state), None)
        for name in group:
            if saved is not None and name not in state:
                state[name] = state[saved]


def _reapply(model: nn.Module, record: dict, path) -> None:
    """One recorded ``sparsify`` call, with fresh layouts (the loaded ``layout`` buffers replace them)."""
    try:
        wanted = set(record["replaced"])
        kwargs = {"block_size": record["block_size"], "density": record["density"], "balanced": record["balanced"]}
    except (KeyError, TypeError):
        raise ValueError(f"{path}/config.json: {RECORD_KEY}: expected records with keys replaced, block_size, "
                         f"density and balanced (written by bstrain.nn.sparsify), got {record!r}") from None
    names = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "")
    if not wanted <= names and prefix and {f"{prefix}.{n}" for n in wanted} <= names:
        wanted = {f"{prefix}.{n}" for n in wanted}        # sparsify was called on the base model (model.transformer)
    if not wanted <= names:
        raise ValueError(f"{path}/config.json: {RECORD_KEY} names layers this {type(model).__name__} does not have: "
                         f"{sorted(wanted - names)[:3]}; load with the model class that was saved")
    sparsify(model, lambda name, _layer: name in wanted, keep_weights=False, **kwargs)


def from_pretrained(model_class: type, path: str | os.PathLike) -> nn.Module:
    """A Hugging Face model saved by ``model.save_pretrained(path)`` after :func:`bstrain.nn.sparsify`,
    loaded exactly: the model is built from ``path``'s config.json (weights left uninitialised),
    the calls recorded in ``config.bstrain_sparsify`` are re-applied with fresh layouts, and the
    saved tensors (the ``layout`` buffers included) are assigned with
    ``load_state_dict(strict=True, assign=True)``. A directory without the record loads as a dense
    model. Returns the model in eval mode, as transformers' ``from_pretrained`` does.

    Args:
        model_class: a transformers model class (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...).
        path: the directory ``save_pretrained`` wrote.
    """
    from transformers.initialization import no_init_weights
    config = model_class.config_class.from_pretrained(path)
    records = list(getattr(config, RECORD_KEY, None) or [])
    setattr(config, RECORD_KEY, [])                     # re-applying the calls records them again
    # Built on the CPU rather than the meta device: transformers computes non-persistent buffers
    # (RoPE frequencies, position ids) at construction, and a meta build would leave them empty.
    with no_init_weights():
        model = model_class(config)
    model.tie_weights()                                 # no_init_weights skips the tying: _add_tied reads it
    for record in records:
        _reapply(model, record, path)
    state = _read_weights(path)
    if not records and any(k.endswith(".layout") for k in state):
        raise ValueError(f"{path}: expected {RECORD_KEY} in config.json beside a block-sparse checkpoint (its "
                         f"state has layout buffers), got none; save the model after bstrain.nn.sparsify so that "
                         f"its config records the call")
    _add_tied(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()
