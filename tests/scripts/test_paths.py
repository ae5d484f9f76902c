"""Every ``scripts/...`` path that the README, docs/, the benchmark results or the scripts themselves
name is a file or folder of the repository (the scripts moved into scripts/bench, tune, profile and gpu;
a stale path in a command line fails here, not on the GPU machine)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md")),
        *sorted((REPO / "scripts").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.sh")), REPO / ".ci" / "run"]
PATH = re.compile(r"(?<![\w./-])scripts/[\w./-]*(?![\w./*$-])")    # not a pattern: scripts/gpu/gpu_*.sh, ..._$1.py
PLACEHOLDER = "NAME"                                                      # scripts/bench/bench_NAME.py


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_named_script_paths_exist(doc):
    named = {m.rstrip(".") for m in PATH.findall(doc.read_text(encoding="utf-8")) if PLACEHOLDER not in m}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{doc.relative_to(REPO)} names missing paths: {missing}"


def test_readme_docs_and_benchmark_index_name_scripts():
    """The three guides name scripts at all (else the test above checks nothing there)."""
    for doc in ("README.md", "docs/internals.md", "benchmarks/README.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        assert doc == "README.md" or PATH.search(text), doc
