"""scripts/bench/compare_runs.py matches rows on their key and flags the figures that got slower."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_compare_runs_flags_a_slower_row(tmp_path, monkeypatch, capsys):
    old = [{"layout": "causal", "S": 8192, "ms": 10.0}, {"layout": "local", "S": 8192, "ms": 4.0},
           {"layout": "gone", "S": 1, "ms": 1.0}]
    new = {"rows": [{"layout": "local", "S": 8192, "ms": 4.4}, {"layout": "causal", "S": 8192, "ms": 10.2},
                    {"layout": "added", "S": 1, "ms": 9.0}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    md = tmp_path / "cmp.md"
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                                      "--key", "layout,S", "--value", "ms", "--title", "attn", "--md", str(md)])
    runpy.run_path(str(REPO / "scripts" / "bench" / "compare_runs.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "| causal 8192 | ms | 10 | 10.2 | 1.020 |" in out
    assert "| local 8192 | ms | 4 | 4.4 | 1.100 **slower** |" in out
    assert "gone" not in out and "added" not in out
    assert out.strip().splitlines()[-1] == "attn: 2 figures, median ratio 1.060, worst 1.100, 1 of 2 within 1.05"
    assert md.read_text().startswith("### attn")
