"""Old import paths that keep working for now, with a DeprecationWarning naming the new one."""
from __future__ import annotations

import importlib
import warnings


def moved(old: str, new: str, names: tuple[str, ...]):
    """A module ``__getattr__`` for ``old`` that serves ``names`` from ``new`` with a warning."""
    def __getattr__(name: str):
        if name in names:
            warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from {new}", DeprecationWarning,
                          stacklevel=2)
            return getattr(importlib.import_module(new), name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    return __getattr__
