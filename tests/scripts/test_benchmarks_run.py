"""The benchmarks that CI keeps in reach run on the CPU (``--cpu-smoke``): untimed, they check that the
script itself still works against the package."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_bench_eager_linear_cpu_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_eager_linear.py", "--cpu-smoke", "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "bench" / "bench_eager_linear.py"), run_name="__main__")
    table = (tmp_path / "eager_linear.md").read_text()
    assert "| 32 |" in table and "nn.Linear" in table
    assert "ratio" in capsys.readouterr().out


def test_bench_lm_anchor_cpu_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_lm_anchor.py", "--cpu-smoke", "--anchor-mask", "layers,window",
                                      "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "bench" / "bench_lm_anchor.py"), run_name="__main__")
    table = (tmp_path / "lm_anchor.md").read_text()
    assert "bstrain sparse / anchor (layers" in table and "bstrain sparse / dense twin" in table
    assert "failed" not in table and "**check" not in table
    assert (tmp_path / "lm_anchor.json").exists()
    assert "same function, fp32 loss" in capsys.readouterr().out
