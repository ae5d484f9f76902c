"""The test suite itself: no test reads or writes an absolute path outside the repository.

A test that names /tmp, /work, a home directory or site-packages passes on one machine only; use
tmp_path, a path relative to the repository (Path(__file__).parents[...]) or, for a real corpus,
the running Python's stdlib through sysconfig.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
# The first component of a path that exists on some machine and not in the repository.
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(tmp|work|root|home|opt|usr|var|etc|mnt|srv|media|proc|sys|dev|lib\w*|bin|"
                          r"sbin|Users|Volumes|private)(/|\b)|site-packages|dist-packages")
ALLOWED = {
    "/dev/null": "exists on every POSIX machine; a sink, never data",
}


def _machine_paths(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant naming a machine path that ALLOWED does not list."""
    found = []
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}   # docstrings: text, not paths used
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value
            for allowed in ALLOWED:
                text = text.replace(allowed, "")
            if MACHINE_PATH.search(text):
                found.append((node.lineno, node.value))
    return sorted(found)


def test_no_test_names_an_absolute_path_outside_the_repository():
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}: {text!r}"
                 for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__)
                 for line, text in _machine_paths(path.read_text())]
    assert not offenders, "absolute machine paths in tests (use tmp_path or a repo-relative path):\n" + \
        "\n".join(offenders)


def test_the_scan_catches_what_it_is_for():
    caught = _machine_paths('A = "/work/shared/data/x.txt"\nB = Path("/tmp/run")\nC = f"{sp}/site-packages/x"\n'
                            'D = "/home/me/data"\nE = "/usr/lib/python3.11"\n')
    assert sorted(line for line, _ in caught) == [1, 2, 3, 4, 5]
    assert not _machine_paths('"""cd /tmp && pytest"""\nA = "/dev/null"\nB = "~/src/**/*.py"\n'
                              'C = "no/such/corpus.txt"\nD = "a/tmp/b"\nE = "file:///theirs"\nF = "x//tmp"\n')
