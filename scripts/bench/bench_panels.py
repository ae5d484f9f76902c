"""Panels against the one-block kernel on the mLSTM's gate layout (issue 22).

    PYTHONPATH=$PWD python scripts/bench/bench_panels.py [--out DIR] [--hidden 4096] [--rows 8192] [--cpu-smoke]

The mLSTM's m -> gates weight is one (H/bs, H/bs) pattern tiled 4 times along its columns, so
every output block shares its input-block list with three others: a panel program computes those
four together and loads each activation tile once for them (``BSTRAIN_BSMM_PANEL=1``; the module
switch ``bstrain.kernels.matmul.PANELS``). For blocks of 16 and 32 and densities 0.5, 0.2 and 0.05:
the forward product Y = X·W (rows x H -> rows x 4H, bf16) with the one-block kernel and with
panels, and the dense product of the same shape (cuBLAS); medians of triton.testing.do_bench.
Writes panels.md and panels.json to --out.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as layouts  # noqa: E402
from bstrain.kernels import matmul as K  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402
from scripts import _timing  # noqa: E402


def bench(fn, smoke: bool) -> float:
    """Median ms of fn (do_bench on CUDA; one timed call on CPU)."""
    return _timing.bench(fn, smoke, cpu_calls=1)


def measure(args) -> list[dict]:
    smoke = args.cpu_smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    H, M = args.hidden, args.rows
    x = torch.randn(M, H, device=dev, dtype=dt)
    dense_w = torch.randn(H, 4 * H, device=dev, dtype=dt)
    dense_ms = bench(lambda: x @ dense_w, smoke)
    rows = []
    for bs, density, kind in [(b, d, k) for k in args.layouts for b in args.blocks for d in args.densities]:
        base = layouts.random((H // bs, H // bs), density, seed=0)
        # tiled: the gate layout (one pattern 4 times); random: an independent (H/bs, 4H/bs) draw,
        # where output blocks rarely share their input lists and panels do not apply
        lay = np.tile(base, (1, 4)) if kind == "tiled" else layouts.random((H // bs, 4 * H // bs), density, seed=0)
        luts = make_luts(lay, bs, dev)
        w = torch.randn(luts.nnz, bs, bs, device=dev, dtype=dt) / bs**0.5
        row = dict(layout=kind, bs=bs, density=float(lay.mean()), M=M, H=H, dense_ms=round(dense_ms, 4))
        outs = {}
        for name, on in (("one_block", False), ("panels", True)):
            K.PANELS = on
            outs[name] = K.bsmm_forward(x, w, luts)
            row[f"{name}_ms"] = round(bench(lambda: K.bsmm_forward(x, w, luts), smoke), 4)
        K.PANELS = False
        torch.testing.assert_close(outs["panels"], outs["one_block"], rtol=2e-2, atol=2e-2)
        useful = 2.0 * M * luts.nnz * bs * bs
        dense_rate = 2.0 * M * H * 4 * H / dense_ms
        for name in ("one_block", "panels"):
            rate = useful / row[f"{name}_ms"]
            row[f"{name}_tflops"] = round(rate / 1e9, 1)
            row[f"{name}_frac_dense_rate"] = round(rate / dense_rate, 3)
        row["panels_speedup"] = round(row["one_block_ms"] / row["panels_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], extra: dict, out: str) -> None:
    lines = [f"# Panels on the mLSTM gate layout: {extra['device']}, {extra['date']}", "",
             f"torch {extra['torch']}; scripts/bench/bench_panels.py; Y = X·W, X ({rows[0]['M']}, {rows[0]['H']}) bf16, W "
             f"{rows[0]['H']} -> {4 * rows[0]['H']}: tiled, one random (H/bs)^2 pattern 4 times (the mLSTM's gates); random, one draw over "
             f"the whole (H/bs, 4H/bs) grid; medians of "
             "triton.testing.do_bench. frac dense rate: useful FLOP/s over cuBLAS's on the dense product "
             "(targets, issue 22: >= 0.55 at blocks of 32, >= 0.3 at 16, density >= 20%).", "",
             "| layout | bs | density | one-block ms | panels ms | speedup | one-block frac dense rate | panels frac dense rate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['bs']} | {r['density']:.3f} | {r['one_block_ms']} | {r['panels_ms']} | {r['panels_speedup']} "
                     f"| {r['one_block_frac_dense_rate']} | {r['panels_frac_dense_rate']} |")
    _timing.write_report(out, "panels", lines, {"rows": rows, **extra})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--blocks", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32])
    ap.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=[0.5, 0.2, 0.05])
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["tiled", "random"])
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.hidden, args.rows, args.blocks, args.densities = 64, 300, [16], [0.5]
    os.makedirs(args.out, exist_ok=True)
    extra = _timing.environment(args.cpu_smoke)
    report(measure(args), extra, args.out)


if __name__ == "__main__":
    main()
