"""The model a run trains, built from its config: the ``model`` section by its ``_target_``
(:func:`instantiate`), then the ``sparsify`` section's :func:`bstrain.nn.sparsify` call on it
(:func:`build_model`). Training, resume, ``eval``, ``sample`` and ``convert`` all build the model
here, so a checkpoint's saved config rebuilds the model it was saved from.

A user's mistake in either section is one :class:`bstrain.errors.UserError` line naming the key.
An exception raised inside a user's own constructor is one
:class:`bstrain.errors.UserCodeError` line naming the class and the exception; its traceback goes
to the run's train.log.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from omegaconf import OmegaConf

from bstrain.errors import UserCodeError, UserError
from bstrain.train import fsdp
from bstrain.train.progress import log

_SPARSIFY_KEYS = ("include", "density", "block_size", "keep_weights", "balanced", "errors")


def _constructor_failed(key: str, target: str, exc: BaseException) -> UserCodeError | None:
    """One line for an exception a user's constructor raised, its traceback written to train.log
    only; None (the caller keeps the traceback) where there is no train.log to write it to."""
    files = [h.baseFilename for h in log.handlers if isinstance(h, logging.FileHandler)]
    if not files and os.environ.get("RANK", "0") == "0":       # (under torchrun, rank 0 writes the log)
        return None
    log.error("%s (%s): the constructor raised", key, target, exc_info=exc, extra={"file_only": True})
    where = f"; the traceback is in {files[0]}" if files else ""
    return UserCodeError(f"{key} ({target}): {type(exc).__name__}: {exc}{where}")


def instantiate(node, key: str):
    """Builds the ``key`` section from its ``_target_``; the user's mistakes (an unknown class, a
    wrong or missing argument, a value the constructor rejects, an exception raised by a user's
    own constructor) become one-line UserErrors."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate
    if not OmegaConf.is_dict(node) or "_target_" not in node:
        raise UserError(f"{key}: expected a mapping with a _target_ (a class path such as my_package.MyModel), "
                        f"got {OmegaConf.to_container(node) if OmegaConf.is_config(node) else node!r}")
    try:
        return hydra_instantiate(node, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if cause is None or isinstance(cause, (ValueError, ImportError)) or (
                isinstance(cause, TypeError) and "argument" in str(cause)):
            msg = " ".join(str(cause or exc).split())
            raise UserError(f"{key} ({node._target_}): {msg}") from None
        target = str(node._target_)
        if isinstance(cause, Exception) and not target.startswith("bstrain."):     # bstrain's own bugs: traceback
            error = _constructor_failed(key, target, cause)
            if error is not None:
                raise error from None
        raise


def without_shard(node):
    """(the model section without ``shard``, its ``shard`` list or None): ``model.shard`` names a
    user model's FSDP units and is not the model's argument."""
    if not OmegaConf.is_dict(node) or fsdp.SHARD_KEY not in node:
        return node, None
    whole = OmegaConf.to_container(node, resolve=True)       # (interpolations resolved while the root is there)
    spec = whole.pop(fsdp.SHARD_KEY)
    return OmegaConf.create(whole), spec


def build_model(cfg, rebuild: bool = False) -> tuple[torch.nn.Module, list | None]:
    """(the model, its ``model.shard`` list or None): the model section built by its ``_target_``,
    then sparsified as the ``sparsify`` section says (a config without one, saved before it
    existed, is not sparsified).

    rebuild: the model is rebuilt for a checkpoint whose weights and layouts are loaded after
    (eval, sample, convert, on the meta device too): fresh layouts stand in for keep_weights.
    """
    node, shard_spec = without_shard(cfg.model)
    model = instantiate(node, "model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model ({cfg.model._target_}): expected an nn.Module, got {type(model).__name__}")
    section = cfg.get("sparsify")
    if section is not None and section.get("include") is not None:
        sparsify_model(model, section, str(cfg.model._target_), rebuild)
    return model, shard_spec


def sparsify_model(model: torch.nn.Module, section, target: str, rebuild: bool = False) -> list[str]:
    """:func:`bstrain.nn.sparsify` with the ``sparsify`` section's keys; returns the names it
    replaced and logs how many. Its ValueErrors (a glob that matches nothing among them) are
    UserErrors naming the ``sparsify.*`` key; its warnings go to train.log too."""
    from bstrain.nn import sparsify
    plain = OmegaConf.to_container(section, resolve=True, enum_to_str=True) if OmegaConf.is_config(section) \
        else dict(section)
    opts = {k: plain.get(k) for k in _SPARSIFY_KEYS}
    include = str(opts.pop("include"))
    if rebuild:
        opts["keep_weights"] = False                 # the checkpoint's weights and layouts replace what is drawn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            replaced = sparsify(model, include, **opts)
        except ValueError as exc:
            raise UserError(_sparsify_line(" ".join(str(exc).split()))) from None
    for w in caught:                                 # errors=skip's warning: into train.log as well
        log.warning("sparsify.include=%s: %s", include, w.message)
    log.info("sparsify.include=%s: %d layer(s) of %s made block-sparse (density %g, block size %d)", include,
             len(replaced), target, opts["density"], opts["block_size"])
    return list(replaced)


def _sparsify_line(msg: str) -> str:
    """sparsify's ValueError as a line naming the sparsify.* key: its own argument name, or for a
    layer it cannot convert, block_size when that is why, else include (which chose the layer)."""
    name, colon, _ = msg.partition(":")
    if colon and name.partition("=")[0] in _SPARSIFY_KEYS:      # "density: ..." or "include='x': ..."
        return f"sparsify.{msg}"
    key = "sparsify.block_size" if "block_size" in msg else "sparsify.include"
    return f"{key}: {msg} (sparsify.errors=skip leaves such layers dense)"
