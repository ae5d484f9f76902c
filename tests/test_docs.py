"""Every ``bstrain.x.y`` dotted name that docs/internals.md writes in backticks imports: a module, or
an attribute of the longest module prefix that imports (a renamed function or a moved module
fails here, not in a reader's session). The paths the guides name: tests/scripts/test_paths.py."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).parents[1] / "docs" / "internals.md"
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])bstrain(?:\.\w+)+")        # not torch.ops.bstrain.bsmm: an op, not a module


def _dotted_names() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    return sorted({name for span in CODE.findall(text) for name in DOTTED.findall(span)})


def _resolve(name: str):
    """The object ``name`` names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:cut]).startswith(e.name):
                raise                                   # a module that exists failed to import
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_internals_names_dotted_names():
    assert len(_dotted_names()) >= 5, "the pattern no longer reads docs/internals.md's names"


@pytest.mark.parametrize("name", _dotted_names())
def test_dotted_name_imports(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"docs/internals.md names `{name}`, which does not import: {e}")
