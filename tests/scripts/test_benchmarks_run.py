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


_SHRINK = {   # issue 40's GPU-sized pairs made CPU-sized: the script's and the configs' smoke
    "transformer": ("wide", ["model.context=128", "data.seq_len=128", "data.batch_size=2", "model.d_model=64",
                             "model.n_layer=1", "model.n_head=2", "model.window=32", "model.summary=16",
                             "model.block_size=16", "model.ffn_block_size=16", "data.max_bytes=200000"]),
    "lstm": ("wide", ["model.hidden=128", "model.embed=32", "model.block_size=16", "data.seq_len=16",
                      "data.batch_size=4", "trainer.eval_batches=2", "data.max_bytes=200000"]),
    "convnet": ("sparse", ["model.widths='16,32'", "model.depth=1", "model.block_size=8", "data.batch_size=8",
                           "data.synthetic_size=64"]),
}


def test_bench_sparse_weights_cpu_smoke(tmp_path, monkeypatch, capsys):
    """transformer_wide, lstm_wide and the convnet pair train through the script (3 steps each, shrunk),
    and the report writes its table and one plot per family."""
    corpus = str(REPO / "bstrain" / "**" / "*.py")
    script = str(REPO / "scripts" / "bench" / "bench_sparse_weights.py")
    for family, (which, shrink) in _SHRINK.items():
        monkeypatch.setattr(sys, "argv", [
            "bench_sparse_weights.py", "curve", "--family", family, "--which", which, "--seconds", "60",
            "--out", str(tmp_path), "--runs", str(tmp_path / "runs"), "--corpus", corpus, "--extra", *shrink,
            "trainer.precision=fp32", "trainer.max_steps=3", "trainer.eval_every=3"])
        runpy.run_path(script, run_name="__main__")
    monkeypatch.setattr(sys, "argv", ["bench_sparse_weights.py", "report", "--out", str(tmp_path)])
    runpy.run_path(script, run_name="__main__")
    table = (tmp_path / "sparse_weights.md").read_text()
    for family, (which, _) in _SHRINK.items():
        data = __import__("json").loads((tmp_path / f"sparse_weights_{family}_{which}.json").read_text())
        assert data["steps"] == 3 and data["valid_history"] and data["throughput"] > 0
        assert f"| {which} |" in table
    assert "bpb" in table and "acc" in table and "tokens/s" in table and "images/s" in table
