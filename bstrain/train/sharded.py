"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories for FSDP runs.

Under ``trainer.strategy=fsdp`` a checkpoint is a directory ``step_NNNNNNNN.dcp/``:

- the model's and the optimizer's state as DCP writes them, each rank its own shards, keyed by
  parameter name (``get_state_dict``), so any number of processes can read them back;
- ``extra.pt``: everything else the file checkpoints hold (:data:`bstrain.train.state.KEYS`:
  step, loss scale, data position, rank 0's RNG as under DDP, every rank's carried states,
  metrics, config, schedule), written by rank 0.

Every rank writes into ``step_NNNNNNNN.dcp.tmp/``; rank 0 renames it when all have finished, so a
run killed mid-write leaves the previous checkpoint whole. Reading:

- an fsdp run of any size loads its own shards (:func:`load_sharded_into`: DCP reshards);
- one process (``trainer.strategy=single``, ``python -m bstrain eval`` and ``sample``) reads the
  whole state into memory (:func:`read_full`), as from a file checkpoint;
- an fsdp run resuming a file checkpoint (one process or DDP wrote it) shards it as it loads
  (:func:`load_full_into`).

Every read goes through :class:`bstrain.train.trust.CheckedReader`: DCP's pickles are data.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from bstrain.train.trust import CheckedReader, refusals_unwrapped

EXTRA = "extra.pt"
_SINGLE_PROCESS = "torch.distributed is .*assuming the intent is to (save|load) in a single process"
SUFFIX = ".dcp"


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and path.name.endswith(SUFFIX) and (path / EXTRA).is_file()


def _fqn_state(model, optimizer, ema=None):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd, **({"ema": ema.state_dict()} if ema is not None else {})}


def save_sharded(path: Path, model, optimizer, extra: dict | None, world, ema=None) -> Path:
    """Writes the checkpoint directory ``path`` (collective: every rank calls it); ``extra`` is
    rank 0's dict of the other entries (None elsewhere); ``ema``: the sharded EMA copy, if kept."""
    import torch.distributed.checkpoint as dcp

    from bstrain.train.distributed import barrier
    tmp = path.with_name(path.name + ".tmp")
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    dcp.save(_fqn_state(model, optimizer, ema), checkpoint_id=str(tmp))
    if world.main:
        with open(tmp / EXTRA, "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier(world)
    return path


def read_extra(path: str | Path) -> dict:
    """The entries besides the tensors DCP holds; its model and optimizer entries None (in DCP)."""
    return {**torch.load(Path(path) / EXTRA, map_location="cpu", weights_only=True), "model": None, "optimizer": None}


def read_full(path: str | Path, extra: dict | None = None) -> dict:
    """The whole checkpoint in this process's memory, as a file checkpoint reads: the model's
    state dict of full tensors, the optimizer's keyed by parameter name (``optimizer_fqn``), and
    the extra entries (``extra``: :func:`read_extra`'s, when read already). Needs no process group."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    reader = CheckedReader(str(path))
    reader.read_metadata()        # (a refused pickle in one line here: DCP's own call wraps the error)
    state: dict = {}              # (what torch's dcp_to_torch_save does: every entry, whole, in one process)
    with refusals_unwrapped():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    out = dict(extra) if extra is not None else read_extra(path)
    out["model"] = state["model"]
    if "ema" in state:                                  # (written by fsdp; a converted file's EMA is in extra)
        out["ema"] = state["ema"]
    out["optimizer"] = None
    out["optimizer_fqn"] = state.get("optimizer")
    return out


def model_entries(path: str | Path) -> dict:
    """The model entries a checkpoint directory holds, as meta tensors of their shapes (no data
    read): what :func:`bstrain.train.checkpoint.check_model_entries` compares with a model."""
    keys = CheckedReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): torch.empty(tuple(v.size), device="meta")
            for k, v in keys.items() if k.startswith("model.")}


def load_sharded_into(path: str | Path, model, optimizer, ema=None) -> None:
    """Loads the checkpoint's model, optimizer and EMA (when both keep one) into a sharded model,
    its optimizer and EMA copy, each rank reading the shards it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    reader = CheckedReader(str(path))
    keys = reader.read_metadata().state_dict_metadata
    with_ema = ema is not None and any(k.startswith("ema.") for k in keys)
    state = _fqn_state(model, optimizer, ema if with_ema else None)
    with refusals_unwrapped():
        dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if with_ema:
        ema.load_state_dict(state["ema"])


def parameter_order(model, optimizer) -> list[str]:
    """The parameters' names in ``optimizer``'s order, the order its state dict numbers them in
    (the same config builds the same groups in the same order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_by_name(saved: dict, order: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index (``Optimizer.state_dict``) keyed by name."""
    saved_order = [i for g in saved["param_groups"] for i in g["params"]]
    if len(saved_order) != len(order):
        from bstrain.errors import CheckpointError
        raise CheckpointError(f"checkpoint: its optimizer holds {len(saved_order)} parameters, the model its config "
                              f"builds {len(order)}; use the config that wrote it")
    by_index = dict(zip(saved_order, order))
    return {"state": {by_index[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**_plain(g), "params": [by_index[i] for i in g["params"]]} for g in saved["param_groups"]]}


def _plain(group: dict) -> dict:
    """A param group's settings with 0-dim tensors as numbers: a graphed run keeps ``lr`` as a
    device tensor, which DCP would store as a tensor where an eager optimizer holds a float."""
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v) for k, v in group.items()}


def optimizer_by_index(saved: dict, order: list[str]) -> dict:
    """The inverse of :func:`optimizer_by_name`."""
    index = {n: i for i, n in enumerate(order)}
    if missing := [n for g in saved["param_groups"] for n in g["params"] if n not in index]:
        from bstrain.errors import CheckpointError
        raise CheckpointError(f"checkpoint: its optimizer holds {missing[0]!r}, which the model its config builds "
                              f"lacks; use the config that wrote it")
    return {"state": {index[n]: s for n, s in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]}


def fqn_optimizer_state(model, optimizer, saved: dict) -> dict:
    """A file checkpoint's optimizer state keyed by the names of ``model``'s parameters."""
    return optimizer_by_name(saved, parameter_order(model, optimizer))


def write_whole(path: Path, model_state: dict, optim_state: dict, extra: dict) -> Path:
    """A sharded checkpoint directory written by one process from whole state dicts (a conversion);
    the EMA, when ``extra`` holds one, goes with the model, as fsdp writes it."""
    import torch.distributed.checkpoint as dcp
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    extra = dict(extra)
    ema = extra.pop("ema", None)
    extra["ema"] = None
    with warnings.catch_warnings():     # one process on purpose: DCP's warning that it assumes so says nothing
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.save({"model": model_state, "optimizer": optim_state, **({"ema": ema} if ema is not None else {})},
                 checkpoint_id=str(tmp), no_dist=True)
    with open(tmp / EXTRA, "wb") as f:
        torch.save(extra, f)
    os.replace(tmp, path)
    return path


def load_full_into(model, optimizer, model_state: dict, optim_state: dict) -> None:
    """Full (unsharded) state dicts, keyed by name, into a sharded model and its optimizer: each
    rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def load_full_ema(ema, state: dict) -> None:
    """A whole EMA state dict (``module.*`` and ``n_averaged``) into a sharded EMA copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(ema.module, {k.removeprefix("module."): v for k, v in state.items() if k.startswith("module.")},
                         options=StateDictOptions(full_state_dict=True))
    ema.n_averaged.copy_(state["n_averaged"])
