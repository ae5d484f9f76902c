"""Every ``scripts/...`` path that the README, docs/, the benchmark results or the scripts themselves
name is a file or folder of the repository (the scripts moved into scripts/bench, tune, profile and gpu;
a stale path in a command line fails here, not on the GPU machine). The guides in docs/ are held to
every repository path they name: ``bstrain/``, ``tests/``, ``scripts/``, ``benchmarks/``, ``examples/``."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md")),
        *sorted((REPO / "scripts").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.sh")), REPO / ".ci" / "run"]
PATH = re.compile(r"(?<![\w./-])scripts/[\w./-]*(?![\w./*$-])")    # not a pattern: scripts/gpu/gpu_*.sh, ..._$1.py
PLACEHOLDER = "NAME"                                                      # scripts/bench/bench_NAME.py
GUIDES = sorted((REPO / "docs").glob("*.md"))
# a path under any top folder, also as a link from docs/ (../benchmarks/x.md); bstrain/kernels/<op>.py
# stops at the placeholder and checks the folder
REPO_PATH = re.compile(r"(?<![\w./-])(?:\.\./)?((?:bstrain|tests|scripts|benchmarks|examples)/[\w./-]*)(?![\w./*$-])")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_named_script_paths_exist(doc):
    named = {m.rstrip(".") for m in PATH.findall(doc.read_text(encoding="utf-8")) if PLACEHOLDER not in m}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{doc.relative_to(REPO)} names missing paths: {missing}"


@pytest.mark.parametrize("doc", GUIDES, ids=[str(d.relative_to(REPO)) for d in GUIDES])
def test_guides_name_existing_paths(doc):
    named = {m.rstrip(".") for m in REPO_PATH.findall(doc.read_text(encoding="utf-8"))}
    assert named, f"{doc.relative_to(REPO)} names no repository path: the pattern no longer reads it"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{doc.relative_to(REPO)} names missing paths: {missing}"


def test_readme_docs_and_benchmark_index_name_scripts():
    """The three guides name scripts at all (else the test above checks nothing there)."""
    for doc in ("README.md", "docs/internals.md", "benchmarks/README.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        assert doc == "README.md" or PATH.search(text), doc
