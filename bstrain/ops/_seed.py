"""The seed's arguments that mean nothing here, accepted so that code written for ``blocksparse``
runs: ``name=`` (a TensorFlow op name) and ``bench=`` (a kernel benchmark count)."""
from __future__ import annotations

import functools
import inspect

__all__ = ["ignores"]


def ignores(*names: str):
    """Decorator: the function also takes the keyword arguments ``names`` (default None) and ignores
    them; its signature shows them."""
    def wrap(fn):
        sig = inspect.signature(fn)
        extra = [n for n in names if n not in sig.parameters]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            for n in extra:
                kwargs.pop(n, None)
            return fn(*args, **kwargs)
        params = list(sig.parameters.values())
        tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        head = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        call.__signature__ = sig.replace(parameters=head + [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in extra] + tail)
        return call
    return wrap
