"""Gradient grouping on the GPU: the dW of a recurrent block-sparse weight over T timesteps,
one launch per step (what autograd does without grouping) against one launch per group of G steps.

    PYTHONPATH=$PWD python scripts/bench/bench_grouping.py [--out DIR]

Times are medians of CUDA-graph replays; each variant also sums the per-launch dW into one
gradient, as autograd would. Writes grouping.md to --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as layouts  # noqa: E402
from bstrain.kernels import matmul as K  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402
from scripts.bench.bench_matmul import time_calls  # noqa: E402


def dw_time(luts, xs, dys, group: int) -> float:
    """ms for the whole sequence's dW with ``group`` timesteps per launch."""
    def run():
        total = None
        for s in range(0, len(xs), group):
            x = xs[s] if group == 1 else torch.cat(xs[s:s + group])        # (G*B, H)
            dy = dys[s] if group == 1 else torch.cat(dys[s:s + group])
            dw = K.bsmm_dw(x, dy, luts)
            total = dw if total is None else total.add_(dw)
        return total
    return time_calls([run], reps=20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    rows = []
    for hidden, batch, steps, bs, density in ((4096, 64, 64, 32, 0.1), (8192, 64, 64, 32, 0.05),
                                              (4096, 32, 64, 16, 0.1)):
        n = hidden // bs
        lay = layouts.barabasi_albert(n, max(1, round((density * n - 1) / 2)), seed=0)
        luts = make_luts(lay, bs, "cuda")
        xs = [torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(steps)]
        dys = [torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(steps)]
        t1 = dw_time(luts, xs, dys, 1)
        for g in (4, 8, 16):
            tg = dw_time(luts, xs, dys, g)
            rows.append((hidden, batch, steps, bs, round(float(lay.mean()), 3), g, t1, tg, t1 / tg))
            print(f"H={hidden} B={batch} T={steps} bs={bs} density={lay.mean():.3f} group={g}: "
                  f"per-step {t1*1e3:.0f}us grouped {tg*1e3:.0f}us speedup {t1/tg:.2f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grouping.md"), "w") as f:
        f.write(f"# dW grouping: {torch.cuda.get_device_name()}, {datetime.date.today()}, bf16\n\n"
                "| hidden | batch | timesteps | bs | density | group | per-step dW µs | grouped dW µs | speedup |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]*1e3:.0f} | {r[7]*1e3:.0f} | "
                    f"{r[8]:.2f}x |\n")


if __name__ == "__main__":
    main()
