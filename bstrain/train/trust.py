"""A checkpoint is data, not code: what may be built from a checkpoint's stored config, and how a
sharded (DCP) checkpoint's pickles are read.

``eval``, ``sample``, ``convert`` and a resume on the saved config (``train trainer.resume=...``
without ``config=``) build the model, data and task that the checkpoint's config names by
``_target_``; Hydra's ``instantiate`` calls whatever a ``_target_`` names (``shutil.copyfile`` with
the config's paths as arguments writes a file). So every ``_target_`` of a stored config, at any
depth, is built only when it is

- one of bstrain's own classes (a ``bstrain.*`` path that names a class bstrain defines: not a
  function, not a name another module's import left in a bstrain module), or
- set by the user on the command line (``model._target_=my_pkg.Net`` when resuming), or
- matched by a glob the user gives in ``trust=[my_pkg.*,transformers.*]`` (dotted paths,
  ``fnmatch`` globs; Hugging Face asks for ``trust_remote_code`` the same way).

Anything else is refused in one line, before anything is built (:func:`check_config`). A fresh
``train`` run builds the user's own config and is not checked.

A DCP directory's ``.metadata`` is a pickle that torch reads with plain ``pickle.load``, and DCP
reads its non-tensor items with ``torch.load(weights_only=False)``: :class:`CheckedReader` reads
the first through an unpickler that admits only DCP's metadata classes, and the second weights-only.
"""
from __future__ import annotations

import contextlib
import fnmatch
import pickle
import re
from collections.abc import Collection, Iterator, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader

from bstrain.errors import CheckpointError

__all__ = ["check_config", "untrusted", "trust_argument", "globs", "is_bstrain_class", "CheckedReader", "read_metadata",
           "refusals_unwrapped"]


# --- _target_s of a stored config ---------------------------------------------------------------------
def globs(value) -> list[str]:
    """The ``trust`` value as a list of globs: a list, one string, or nothing."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value]


def _leaves(node, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf of a plain config of dicts and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{path}.{i}" if path else str(i))
    else:
        yield path, node


def is_bstrain_class(target) -> bool:
    """True for a ``bstrain.*`` path naming a class that bstrain defines (importing it runs only
    bstrain's code: the path stays inside the bstrain package until it names something else)."""
    if not isinstance(target, str) or not target.startswith("bstrain."):
        return False
    from hydra._internal.utils import _locate       # (hydra.utils.get_class logs an error for each miss)
    try:
        found = _locate(target)
    except Exception:                   # (no such name: not ours either; the trust line says how to build it)
        return False
    return isinstance(found, type) and (found.__module__ == "bstrain" or found.__module__.startswith("bstrain."))


def _glob_for(target) -> str:
    """The glob a user would write for a target: its package's (``shutil.*`` for ``shutil.copyfile``),
    or the path itself for a ``bstrain.*`` path that is not one of its classes (``bstrain.*`` would
    trust every function any bstrain module imports)."""
    text = str(target)
    package = text.split(".")[0]
    return f"{package}.*" if "." in text and package != "bstrain" else text


def check_config(config: dict, source, trusted: Sequence[str] = (), overridden: Collection[str] = ()) -> None:
    """CheckpointError, in one line, for a ``_target_`` of ``config`` (a checkpoint's stored config,
    plain dicts and lists) that is not trusted (module docstring), or for an interpolation in it.

    Args:
        source: the checkpoint, named in the message.
        trusted: the user's globs (``trust=[...]``).
        overridden: the dotted keys of the ``_target_``s the user set on the command line.
    """
    for key, value in _leaves(config):
        if isinstance(value, str) and "${" in value:
            # bstrain stores configs resolved; an interpolation (oc.create ...) could make a _target_ on the way
            raise CheckpointError(f"checkpoint {source}: its config's {key} holds an interpolation ({value!r}); "
                                  f"bstrain stores configs resolved, so this one was edited; nothing was built")
    if refused := untrusted(config, trusted, overridden):
        (key, target), more = refused[0], refused[1:]
        also = f" (and {', '.join(f'{k}: {v}' for k, v in more)})" if more else ""
        raise CheckpointError(f"checkpoint {source}: its config's {key} is {target}{also}, code from outside bstrain "
                              f"that loading it would run; nothing was built. If you trust the checkpoint's author, "
                              f"add {trust_argument(refused)}")


def untrusted(config: dict, trusted: Sequence[str] = (), overridden: Collection[str] = ()) -> list[tuple[str, object]]:
    """(dotted key, value) of each ``_target_`` in ``config`` that :func:`check_config` refuses."""
    return [(key, value) for key, value in _leaves(config)
            if key.rpartition(".")[2] == "_target_" and key not in overridden and not is_bstrain_class(value)
            and not any(isinstance(value, str) and fnmatch.fnmatchcase(value, g) for g in trusted)]


def trust_argument(refused: list[tuple[str, object]]) -> str:
    """``'trust=[shutil.*,transformers.*]'``: the argument that trusts the targets :func:`untrusted` lists."""
    return f"'trust=[{','.join(dict.fromkeys(_glob_for(v) for _, v in refused))}]'"


# --- DCP's pickles ------------------------------------------------------------------------------------
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),      # where each item lies in the .distcp files
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),                           # torch.strided ... from its name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),             # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})
"""The globals of a DCP ``.metadata`` besides the metadata module's classes and torch's dtypes (a
real one, listed: a model, AdamW's state and param groups, bf16 and fp16 tensors)."""


def _admitted(module: str, name: str) -> bool:
    if "." in name:                                     # (an attribute of an admitted class: Path.touch)
        return False
    if (module, name) in _ADMITTED:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == _DCP_METADATA:
        import importlib
        found = getattr(importlib.import_module(module), name, None)
        return isinstance(found, type) and found.__module__ == module
    return False


class _Refused(pickle.UnpicklingError):
    """A global the metadata unpickler does not admit (the message is its dotted name)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global but DCP's metadata classes (the pattern of Python's
    pickle docs, "Restricting Globals")."""

    def find_class(self, module: str, name: str):
        if not _admitted(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(stream, path):
    """A DCP ``Metadata`` from ``stream`` (the file ``path``); CheckpointError naming a refused global."""
    try:
        return _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise CheckpointError(f"checkpoint: {path} holds the global {exc}, which DCP metadata never does; "
                              f"refused, nothing of it was run") from None


class _WeightsOnlyBytes:
    """A load planner whose byte items are unpickled weights-only first: DCP's own ``load_bytes``
    uses ``torch.load(weights_only=False)``, which runs whatever the pickle calls."""

    def __init__(self, planner, path):
        self._planner, self._path = planner, path

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"WeightsUnpickler error: ([^.]*)", str(exc))      # (torch's says which global)
            reason = found.group(1) if found else "not weights-only data"
            raise CheckpointError(f"checkpoint: {self._path}: its item {read_item.dest_index.fqn!r} needs code to "
                                  f"unpickle ({reason}); refused, nothing of it was run") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class CheckedReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading the metadata with :func:`read_metadata` and byte items
    weights-only; pass it as ``storage_reader`` wherever DCP reads a directory."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:       # (as FileSystemReader.read_metadata does)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _WeightsOnlyBytes(planner, self.path))


@contextlib.contextmanager
def refusals_unwrapped():
    """A refusal of :class:`CheckedReader` as itself: DCP's load wraps what a rank raises in a
    ``CheckpointException`` (a BaseException) with every rank's traceback."""
    from torch.distributed.checkpoint import CheckpointException
    try:
        yield
    except CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise
