"""One layout-table mechanism for every op family (matmul, attention, conv).

A family registers a builder ``build(*spec, device) -> tables`` under its name (:func:`family`);
``spec`` is host data (numpy arrays, ints) that fully describes a layout. :func:`layout_tables`
returns the one :class:`LayoutTables` of that content: ops and modules with equal layouts share
it, and its content key names the layout in ``torch.ops.bstrain.*`` calls, so a compiled or
exported graph holds a string constant, not an object (:func:`lookup` resolves it when the op
runs).

The rules every family gets from here, once:

- the CPU tables are built eagerly, when the op or module is constructed, as real CPU tensors:
  never on the meta device (a ``with torch.device("meta")`` block), never as fake tensors (an
  export trace) and never as inference tensors (``torch.inference_mode``);
- :meth:`LayoutTables.on` makes each device's copy once and caches it, under the same rules;
  while a graph is traced it hands back an uncached copy instead, so nothing a tracer made is
  ever kept;
- copies, deep copies and pickles resolve to the shared tables of the same content.
"""
from __future__ import annotations

import hashlib
import itertools
import weakref
from collections.abc import Callable

import numpy as np
import torch

from bstrain._tensors import real_tensors

__all__ = ["family", "layout_tables", "private_tables", "lookup", "LayoutTables", "eager", "tracing", "real_tensors"]

_BUILDERS: dict[str, Callable] = {}
_REGISTRY: "weakref.WeakValueDictionary[str, LayoutTables]" = weakref.WeakValueDictionary()
_CPU = torch.device("cpu")


def eager(t: torch.Tensor) -> bool:
    """True when a call on t runs eagerly: not under torch.compile, and t a plain tensor (not a
    fake or functional one, as torch.export and make_fx trace with). Traced calls go through the
    custom ops; eager ones take the lighter ``autograd.Function`` path."""
    return type(t) is torch.Tensor and not torch.compiler.is_compiling()


def tracing() -> bool:
    """A graph is being traced (torch.compile, torch.export, a fake-tensor mode): nothing made
    now may be cached."""
    if torch.compiler.is_compiling():
        return True
    from torch._guards import detect_fake_mode
    return detect_fake_mode() is not None


_TAKES_PRIVATE: set[str] = set()


def family(name: str, *, takes_private: bool = False):
    """Registers ``build(*spec, device)`` as the table builder of op family ``name``; with
    ``takes_private``, ``build(*spec, device, private)``: private tables (a layout that changes in
    place) may be built differently (the matmul kernels' lists leave room to grow)."""
    def register(build: Callable) -> Callable:
        _BUILDERS[name] = build
        if takes_private:
            _TAKES_PRIVATE.add(name)
        return build
    return register


def _content_key(name: str, spec: tuple) -> str:
    h = hashlib.blake2b(digest_size=12)
    for part in spec:
        if isinstance(part, np.ndarray):
            h.update(str((part.dtype.str, part.shape)).encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return f"{name}-{h.hexdigest()}"


class LayoutTables:
    """The tables of one layout of one family: ``host`` (CPU) and one copy per device.

    Attributes:
        family: the family's name ("matmul", "attention", "conv").
        key: the content key; equal layouts have equal keys and share this object. Private
            tables (:func:`private_tables`) have a key of their own, which stays when
            :meth:`rewrite` changes their layout in place.
        host: the family's tables on the CPU, built when this object is.
    """

    def __init__(self, name: str, spec: tuple, key: str, private: bool = False):
        self.family, self.spec, self.key, self.private = name, spec, key, private
        self.followers = weakref.WeakSet()     # ops reading these private tables without owning them
        with real_tensors(_CPU):
            self.host = self._build(_CPU)
        self._on: dict[torch.device, object] = {_CPU: self.host}

    def _build(self, device: torch.device):
        """The family's tables on ``device``; private ones told so where the family takes it."""
        kw = {"private": self.private} if self.family in _TAKES_PRIVATE else {}
        return _BUILDERS[self.family](*self.spec, device=device, **kw)

    def on(self, device: torch.device | str):
        """The tables on ``device``: made once per device and cached (an uncached copy while a
        graph is traced)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tables = self._on.get(device)
        if tables is not None:
            return tables
        if device.type == "meta":
            raise ValueError("device: layout tables are never made on the meta device; move the module to a real "
                             "device (to_empty) before running it")
        if tracing():
            return self._build(device)
        with real_tensors(device):
            tables = self._on[device] = self._build(device)
        return tables

    def rewrite(self, *spec) -> None:
        """Private tables only: switches them to ``spec`` in place on every device they are on, so
        that launch plans, captured CUDA graphs and compiled graphs (which name them by key) run
        the new layout. The family's tables check first (on the CPU) that the new layout fits the
        old tensors (a ValueError, with nothing changed, if not)."""
        if not self.private:
            raise RuntimeError(f"layout tables {self.key}: shared tables are never rewritten in place")
        with real_tensors(_CPU):
            for tables in self._on.values():            # every device's check before anything changes
                check = getattr(tables, "check_rewrite", None)
                if check is not None:
                    check(*spec)
            for tables in self._on.values():
                tables.rewrite(*spec)
        self.spec = spec

    def can_rewrite(self, *spec) -> bool:
        """Whether :meth:`rewrite` would take ``spec`` (private tables whose every device's tables
        fit it)."""
        if not self.private:
            return False
        try:
            for tables in self._on.values():
                check = getattr(tables, "check_rewrite", None)
                if check is not None:
                    check(*spec)
        except ValueError:
            return False
        return True

    def like(self, *spec, private: bool | None = None) -> "LayoutTables":
        """Tables of this family for ``spec`` (private if these are, or as ``private`` says), made
        at once on every GPU these are on, so that a graph traced later finds them instead of
        building them inside the trace."""
        private = self.private if private is None else private
        tables = (private_tables if private else layout_tables)(self.family, *spec)
        for d in self.devices:
            if d.type == "cuda":
                tables.on(d)
        return tables

    @property
    def devices(self) -> list[torch.device]:
        """The devices these tables have been made on (the CPU always)."""
        return list(self._on)

    def __reduce__(self):
        return (_private_copy if self.private else layout_tables), (self.family, *self.spec)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        """Shared tables are shared by the copy too; private ones (a layout that changes in place)
        are not: the copy gets private tables of its own, of the same layout, on the same devices."""
        if not self.private:
            return self
        copy = private_tables(self.family, *self.spec)
        for device in self.devices:
            copy.on(device)
        return copy

    def __repr__(self) -> str:
        return f"LayoutTables({self.key!r}, devices={[str(d) for d in self._on]})"


def layout_tables(name: str, *spec) -> LayoutTables:
    """The shared tables of family ``name`` for ``spec`` (built now if no live op holds them).
    The registry holds weak references: the ops and modules that use the tables keep them alive."""
    if name not in _BUILDERS:
        raise KeyError(f"family: no layout-table builder is registered under {name!r}")
    key = _content_key(name, spec)
    tables = _REGISTRY.get(key)
    if tables is None:
        tables = _REGISTRY[key] = LayoutTables(name, spec, key)
    return tables


_PRIVATE = itertools.count()


def private_tables(name: str, *spec) -> LayoutTables:
    """Tables of family ``name`` for ``spec`` that no other op shares, under a key of their own: a
    layout that will change in place (:meth:`LayoutTables.rewrite`, dynamic sparsity)."""
    if name not in _BUILDERS:
        raise KeyError(f"family: no layout-table builder is registered under {name!r}")
    key = f"{_content_key(name, spec)}-own{next(_PRIVATE)}"
    tables = _REGISTRY[key] = LayoutTables(name, spec, key, private=True)
    return tables


def _private_copy(name: str, *spec) -> LayoutTables:
    """Unpickling private tables: private tables of their own (another process has no others)."""
    return private_tables(name, *spec)


# Tables a traced graph (torch.compile, torch.export) names: kept alive as long as the process,
# since the graph outlives the module that made them (an exported program runs after the module
# is gone). Tables are index tensors of a layout: small.
_TRACED: dict[str, LayoutTables] = {}


def lookup(key: str) -> LayoutTables:
    """The live tables named ``key`` (the layout argument of a ``torch.ops.bstrain.*`` call)."""
    tables = _REGISTRY.get(key)
    if tables is None:
        tables = _TRACED.get(key)
    elif key not in _TRACED and tracing():
        _TRACED[key] = tables
    if tables is None:
        raise RuntimeError(f"layout: no block-sparse layout is registered under {key!r}; build the op (or the "
                           f"module holding it) in this process before running a graph that uses it")
    return tables
