"""The benchmarks that CI keeps in reach run on the CPU (``--cpu-smoke``): untimed, they check that the
script itself still works against the package."""
from __future__ import annotations

import json
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
    assert "bstrain sparse / strongest anchor (layers): anchor (layers, Flex block 32)" in table
    assert "| none; no graph (off); eager clip + AdamW foreach |" in table
    data = json.loads((tmp_path / "lm_anchor.json").read_text())
    anchors = [r for r in data["rows"] if r["model"].startswith("anchor")]
    assert [r["anchor"] for r in anchors] == [{"compile": "none", "graph": "no graph (off)",          # the CPU smoke's
                                               "optimizer": "eager clip + AdamW foreach"}] * 2    # every choice, recorded
    assert data["meta"]["flash"].startswith("FLASH") and data["meta"]["anchor"]["flex_backends"] == ["TRITON"]
    assert "same function, fp32 loss" in capsys.readouterr().out


def test_profile_attention_cpu_smoke(tmp_path, monkeypatch):
    """A script of scripts/profile/ that imports one of scripts/bench/ (inputs) and the shared record."""
    monkeypatch.setattr(sys, "argv", ["profile_attention.py", "--cpu-smoke", "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "profile" / "profile_attention.py"), run_name="__main__")
    assert "cpu (smoke)" in (tmp_path / "attention_profile.md").read_text()
    assert (tmp_path / "attention_profile.json").exists()


def test_timing_helpers_on_the_cpu():
    """scripts/_timing.py: the call counts the scripts rely on, and the environment record's fields."""
    import torch

    from scripts import _timing
    calls = []
    assert _timing.bench(lambda: calls.append(1), smoke=True, cpu_calls=2) >= 0
    assert len(calls) == 1 + 2                                  # one warm-up call, then the timed ones
    calls.clear()
    assert _timing.wall_per_call(lambda: calls.append(1), torch.device("cpu"), calls=4, repeats=3, warmup=2) >= 0
    assert len(calls) == 2 + 4 * 3
    env = _timing.environment(cpu_smoke=True)
    assert list(env) == ["device", "torch", "date"] and env["device"] == "cpu (smoke)"
