"""Every ```python block of the README and of docs/seed.md runs exactly as written, each in a fresh namespace, on
whatever machine runs the tests (CPU-only in CI: a block that names "cuda" without asking for it fails here), and
prints what its ``print(...)  # comment`` lines say. A failure names the block by its README line, and the
traceback points at README.md's own lines.

To check the README against another checkout's package (say, before its API lands here), run
pytest from outside both trees so that PYTHONPATH decides which ``bstrain`` is imported:

    cd /tmp && PYTHONPATH=/path/to/other python -m pytest --import-mode=importlib \
        -c /path/to/this/pyproject.toml --rootdir=/path/to/this /path/to/this/tests/test_readme.py
"""
from __future__ import annotations

import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
README = REPO / "README.md"
MAX_LINES = 400


def python_blocks(path: Path = README) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) for every ```python block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 2, textwrap.dedent("\n".join(lines[i + 1:end]))))
            i = end
        i += 1
    return blocks


def readme_block(containing: str) -> tuple[int, str]:
    """The one README block whose code contains ``containing``."""
    found = [b for b in python_blocks() if containing in b[1]]
    assert len(found) == 1, f"{len(found)} README python blocks contain {containing!r}"
    return found[0]


def run_block(line: int, code: str, path: Path = README) -> dict:
    """Runs one block as written in a fresh namespace; returns the namespace, with what it printed
    under ``"_printed"``. The code is compiled at its own line numbers of ``path``, so a traceback
    shows the README's lines."""
    namespace = {"__name__": f"readme_line_{line}"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
    namespace["_printed"] = out.getvalue().splitlines()
    return namespace


def promised_output(line: int, code: str) -> list[tuple[int, str | None]]:
    """(README line, comment) of each top-level ``print(...)`` line of a block, in order."""
    promised = []
    for i, text in enumerate(code.splitlines()):
        if text.startswith("print("):
            comment = re.search(r"\)\s+#\s*(.+)$", text)
            promised.append((line + i, comment.group(1).strip() if comment else None))
    return promised


def matches(printed: str, promise: str) -> bool:
    """The comment is the printed line ("..." stands for anything), or begins with it and a colon
    that starts an explanation (``# ['0', '2']: both are ...``)."""
    pattern = ".*".join(re.escape(part) for part in promise.split("..."))
    return bool(re.fullmatch(pattern, printed)) or promise.startswith(printed + ":")


SEED_DOC = REPO / "docs" / "seed.md"
BLOCKS = [(README, *b) for b in python_blocks()] + [(SEED_DOC, *b) for b in python_blocks(SEED_DOC)]


@pytest.mark.parametrize("path, line, code", BLOCKS, ids=[f"{p.name}:{line}" for p, line, _ in BLOCKS])
def test_readme_python_block_runs(path, line, code):
    try:
        printed = run_block(line, code, path)["_printed"]
    except Exception as e:
        raise AssertionError(f"the README's python block at line {line} failed: {type(e).__name__}: {e}") from e
    promised = promised_output(line, code)
    assert len(printed) == len(promised), (f"the README's block at line {line} printed {len(printed)} lines for "
                                           f"{len(promised)} print lines: {printed}")
    for got, (at, promise) in zip(printed, promised):
        assert promise is None or matches(got, promise), f"README.md:{at} promises {promise!r}, printed {got!r}"


def test_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; measurements go to benchmarks/README.md"


def test_readme_links_point_at_files():
    """Every relative link of the README and of benchmarks/README.md names a file of the repository."""
    for doc in (README, REPO / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)}: link to a missing {target}"


def test_readme_test_command_is_what_ci_runs():
    """The README's test command is the one .ci/run runs, so what the README says of it (in parallel with
    -n auto, the extras it installs) is what CI checks."""
    readme = README.read_text(encoding="utf-8")
    commands = [line.strip() for line in readme.splitlines() if "python -m pytest" in line and "pip install" in line]
    assert len(commands) == 1, f"expected one install-and-test command in the README, found {commands}"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    quiet = commands[0].replace("pip install ", "pip install -q ")
    assert quiet in ci, f".ci/run does not run the README's test command {commands[0]!r}"
    assert "-n auto" in commands[0], "the README says the tests run in parallel (-n auto)"
