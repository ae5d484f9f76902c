"""bstrain.advise: the block-size advisor reads the committed bsmm measurements exactly, interpolates
between them, and refuses what it cannot answer in one line."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from bstrain.advise import DENSITIES, advise, format_advice

REPO = Path(__file__).parents[1]


def _bench_rates(dtype: str) -> dict:
    """{(M, bs, density): rate} from benchmarks/matmul.csv, computed here independently."""
    acc: dict = {}
    for r in csv.DictReader(open(REPO / "benchmarks" / "matmul.csv")):
        if r["dtype"] == dtype:
            a = acc.setdefault((int(r["M"]), int(r["bs"]), float(r["density"])), [0.0, 0.0, float(r["real_density"])])
            a[0] += float(r["ours_us"])
            a[1] += float(r["dense_us"])
    return {k: dense * d / ours for k, (ours, dense, d) in acc.items()}


def test_packaged_table_is_the_committed_measurement():
    """bstrain/measurements/bsmm_h200.csv holds benchmarks/matmul.csv's rows (a copy the package ships)."""
    bench = list(csv.DictReader(open(REPO / "benchmarks" / "matmul.csv")))
    lines = (REPO / "bstrain" / "measurements" / "bsmm_h200.csv").read_text().splitlines()
    shipped = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert len(shipped) == len(bench)
    for b, s in zip(bench, shipped):
        fields = ("dtype", "M", "bs", "density", "real_density", "op", "ours_us", "dense_us")
        assert [s[k] for k in fields] == [b[k] for k in fields]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_measured_points_are_reproduced(dtype):
    rates = _bench_rates({"bf16": "bfloat16", "fp16": "float16"}[dtype])
    for (m, bs, d), rate in rates.items():
        (row,) = [a for a in advise(4096, 4096, tokens=m, density=d, dtype=dtype, device="H200") if a.block_size == bs]
        assert row.block_size == bs and row.in_range
        assert row.rate == pytest.approx(rate, rel=1e-9)
        assert row.speedup == pytest.approx(rate / d, rel=1e-9)


def test_interpolation_lies_between_its_neighbours():
    rates = _bench_rates("bfloat16")
    for bs in (16, 32, 64, 128):
        lo, hi = sorted((rates[8192, bs, 0.2], rates[8192, bs, 0.5]))
        (mid,) = [a for a in advise(4096, 4096, 8192, density=0.3) if a.block_size == bs]
        assert lo <= mid.rate <= hi
        lo, hi = sorted((rates[64, bs, 0.2], rates[8192, bs, 0.2]))
        (mid,) = [a for a in advise(4096, 4096, 1024, density=0.2) if a.block_size == bs]
        assert lo <= mid.rate <= hi and mid.in_range


def test_ranking_and_divisibility():
    rows = advise(96, 4096, 8192)
    assert {a.block_size for a in rows} == {16, 32}                    # only sizes that divide 96
    assert [a.rate for a in rows] == sorted((a.rate for a in rows), reverse=True)
    assert {a.density for a in rows} == set(DENSITIES)
    outside = advise(4096, 4096, 8192, density=0.9)
    assert not any(a.in_range for a in outside)
    assert "outside the measured range" in format_advice(outside)


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=100, out_features=4096), "no measured block size"),
    (dict(in_features=0, out_features=4096), "in_features: expected a positive int"),
    (dict(in_features=4096, out_features=4096, dtype="fp8"), "dtype: expected one of"),
    (dict(in_features=4096, out_features=4096, device="NVIDIA A100"), "device: no measurements for 'NVIDIA A100'"),
    (dict(in_features=4096, out_features=4096, density=0.0), "density"),
], ids=["indivisible", "zero", "dtype", "device", "density"])
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        advise(**kwargs)


def test_command_prints_the_table_and_one_line_errors():
    run = [sys.executable, "-m", "bstrain", "advise"]
    ok = subprocess.run(run + ["in_features=512", "out_features=2048", "tokens=8192", "density=0.25", "top=2"],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[2].split()[:2] == ["128", "0.25"] and len(ok.stdout.splitlines()) == 4
    bad = subprocess.run(run + ["in_features=512", "out_feature=2048"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "out_feature=2048" in bad.stderr
