"""Benchmark block-sparse matmul against dense cuBLAS and torch's BSR kernels, on one GPU, in one run.

    PYTHONPATH=$PWD python scripts/bench/bench_matmul.py [--out DIR] [--sweep] [--quick]

Times are medians of CUDA-graph replays (launch overhead excluded for every contender), with
inputs rotated over several copies so that the working set is larger than L2. Writes
matmul.md (table), matmul.csv and matmul.png to --out.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import dataclasses
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as layouts  # noqa: E402
from bstrain.kernels import matmul as K  # noqa: E402
from bstrain.kernels import tiles  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402
from scripts._timing import event_times_ms, software as this_software  # noqa: E402

L2_BYTES = 60 << 20
TARGET_FWD = {128: 0.85, 64: 0.75, 32: 0.60, 16: 0.35}


def time_calls(calls, reps=25):
    """Median ms per call of a list of closures, captured in one CUDA graph (fallback: eager)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        run = g.replay
    except Exception:  # not capturable: time eager launches
        torch.cuda.synchronize()

        def run():
            for c in calls:
                c()
    run()
    torch.cuda.synchronize()
    return statistics.median(t / len(calls) for t in event_times_ms(run, reps))


def copies(make, bytes_each):
    n = max(1, min(32, math.ceil(3 * L2_BYTES / max(1, bytes_each))))
    return [make() for _ in range(n)]


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_calls([lambda: y.copy_(x)], reps=10)
    return 2 * x.numel() / ms / 1e9  # TB/s, read + write


def dense_times(M, C, Kf, dtype):
    sets = copies(lambda: (torch.randn(M, C, device="cuda", dtype=dtype),
                           torch.randn(C, Kf, device="cuda", dtype=dtype),
                           torch.randn(M, Kf, device="cuda", dtype=dtype)), (M * C + C * Kf + M * Kf) * 2)
    return {"fwd": time_calls([lambda s=s: s[0] @ s[1] for s in sets]),
            "dx": time_calls([lambda s=s: s[2] @ s[1].t() for s in sets]),
            "dw": time_calls([lambda s=s: s[0].t() @ s[2] for s in sets])}


def bsr_times(lay, bs, M, dtype, w):
    """torch.sparse._triton_ops.bsr_dense_mm for Y^T = W^T X^T and dX^T = W dY^T."""
    try:
        from torch.sparse._triton_ops import bsr_dense_mm
        wd = torch.zeros(lay.shape[0], bs, lay.shape[1], bs, device="cuda", dtype=dtype)
        ci, ki = (torch.as_tensor(v, device="cuda") for v in lay.nonzero())
        wd[ci, :, ki, :] = w
        wd = wd.reshape(lay.shape[0] * bs, lay.shape[1] * bs)                  # (C, K)
        wt_bsr = wd.t().contiguous().to_sparse_bsr((bs, bs))
        w_bsr = wd.contiguous().to_sparse_bsr((bs, bs))
        xt = torch.randn(wd.shape[0], M, device="cuda", dtype=dtype)
        dyt = torch.randn(wd.shape[1], M, device="cuda", dtype=dtype)
        return {"fwd": time_calls([lambda: bsr_dense_mm(wt_bsr, xt)]),
                "dx": time_calls([lambda: bsr_dense_mm(w_bsr, dyt)])}
    except Exception as exc:  # report, don't hide
        print(f"  torch BSR failed at bs={bs}: {type(exc).__name__}: {str(exc)[:120]}")
        return {"fwd": float("nan"), "dx": float("nan")}


def ours_times(lay, bs, M, dtype, axis=1, ops=("fwd", "dx", "dw")):
    luts = make_luts(lay, bs, "cuda")
    C, Kf = luts.C, luts.K
    shape_x = (M, C) if axis == 1 else (C, M)
    shape_y = (M, Kf) if axis == 1 else (Kf, M)
    per = (M * C + M * Kf + luts.nnz * bs * bs) * 2
    sets = copies(lambda: (torch.randn(shape_x, device="cuda", dtype=dtype),
                           torch.randn(luts.nnz, bs, bs, device="cuda", dtype=dtype),
                           torch.randn(shape_y, device="cuda", dtype=dtype)), per)
    outs = {"y": torch.empty(shape_y, device="cuda", dtype=dtype),
            "dx": torch.empty(shape_x, device="cuda", dtype=dtype),
            "dw": torch.empty(luts.nnz, bs, bs, device="cuda", dtype=torch.float32)}
    fns = {"fwd": lambda s: K.bsmm_forward(s[0], s[1], luts, axis, out=outs["y"]),
           "dx": lambda s: K.bsmm_dx(s[2], s[1], luts, axis, out=outs["dx"]),
           "dw": lambda s: K.bsmm_dw(s[0], s[2], luts, axis, out=outs["dw"])}
    t = {op: time_calls([lambda s=s, f=fns[op]: f(s) for s in sets]) for op in ops}
    return t, luts.nnz, sets[0][1]


def _dw(block_n, group, warps, stages, tma):
    """A dW candidate in the sweep's (BLOCK_N, group, warps, stages, TMA) order."""
    return tiles.Tile(0, block_n, warps, stages, tma, group)


def _sweep_table(kernel, bs, cands, measure, label):
    """Times each candidate tile of ``kernel`` (bstrain.kernels.tiles.MATMUL, bf16 on CUDA) at
    block size bs, keeps the fastest there (an override), returns it."""
    key = (kernel, bs, 2, True)
    results = []
    for cfg in cands:
        tiles.override("matmul", key, cfg)
        try:
            results.append((measure(), cfg))
        except Exception as exc:
            print(f"  {label} bs={bs} {cfg} failed: {type(exc).__name__}: {str(exc)[:160]}")
    results.sort(key=lambda r: r[0])
    for t, cfg in results:
        print(f"sweep {label} bs={bs} {cfg} {t*1e3:.1f}us")
    tiles.override("matmul", key, results[0][1])
    return results[0][1]


def sweep_low_density(density, sizes):
    """ds tiles for layouts with few blocks per output block ("ds_few"), at M=8192, bf16."""
    D = tiles.Tile
    cands = {bs: [tiles.MATMUL("ds", bs, 2, True), D(128, min(64, bs), 4, 2, True), D(64, min(64, bs), 4, 3, True),
                  D(64, min(64, bs), 4, 2, True), D(128, 32, 4, 3, True), D(64, 32, 4, 4, True),
                  D(128, min(64, bs), 8, 2, True)] for bs in sizes}
    for bs in sizes:
        lay = layouts.random((4096 // bs, 4096 // bs), density, seed=0)

        def fwd_dx():
            t, _, _ = ours_times(lay, bs, 8192, torch.bfloat16, ops=("fwd", "dx"))
            return t["fwd"] + t["dx"]
        _sweep_table("ds_few", bs, cands[bs], fwd_dx, f"ds_few(d={density})")


def sweep(out_dir, sizes=(128, 64, 32, 16, 8)):
    """Tile configs per block size at density 0.2, bf16: M=8192 (fwd+dx, dw) and M=64 (fwd+dx)."""
    D, W = tiles.Tile, _dw
    big = {bs: [D(128, min(64, bs), 4, 4, True), D(128, min(64, bs), 8, 3, True), D(128, 32, 4, 5, True),
                D(256, min(64, bs), 8, 3, True), D(128, min(128, bs), 8, 3, True), D(128, min(64, bs), 4, 3, True),
                D(256, 32, 8, 4, True), D(64, min(64, bs), 4, 4, True)] for bs in (32, 64, 128)}
    for bs in (8, 16):
        big[bs] = [D(256, 64, 8, 3, False), D(128, 64, 4, 4, False), D(256, 128, 8, 3, False),
                   D(128, 128, 8, 3, False)]
    small = {bs: [D(64, min(64, bs), 4, 4, True), D(64, min(64, bs), 4, 6, True), D(64, 32, 4, 8, True),
                  D(64, min(128, bs), 4, 4, True), D(64, 64, 4, 4, False)] for bs in (32, 64, 128)}
    dw = {128: [W(64, 1, 8, 3, True), W(32, 1, 8, 4, True), W(128, 1, 8, 3, True), W(64, 1, 4, 4, True)],
          64: [W(64, 1, 8, 3, True), W(64, 1, 4, 4, True), W(128, 1, 4, 3, True), W(32, 2, 8, 4, False),
               W(128, 1, 8, 3, True)],
          32: [W(64, 8, 8, 3, False), W(64, 4, 4, 3, False), W(128, 1, 4, 3, True), W(64, 1, 4, 4, True),
               W(128, 4, 8, 3, False)],
          16: [W(64, 8, 4, 3, False), W(64, 16, 8, 3, False), W(128, 8, 8, 3, False)],
          8: [W(64, 16, 4, 3, False), W(64, 32, 8, 3, False), W(128, 16, 8, 3, False)]}
    best = {}
    for bs in sizes:
        lay = layouts.random((4096 // bs, 4096 // bs), 0.2, seed=0)
        dtype = torch.bfloat16

        def fwd_dx(M):
            t, _, _ = ours_times(lay, bs, M, dtype, ops=("fwd", "dx"))
            return t["fwd"] + t["dx"]
        best[bs] = {"ds": _sweep_table("ds", bs, big[bs], lambda: fwd_dx(8192), "ds"),
                    "dw": _sweep_table("dw", bs, dw[bs],
                                       lambda: ours_times(lay, bs, 8192, dtype, ops=("dw",))[0]["dw"], "dw")}
        if bs in small:
            best[bs]["ds_small"] = _sweep_table("ds_small_m", bs, small[bs], lambda: fwd_dx(64), "ds_small")
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump({str(k): {n: list(dataclasses.astuple(c)) for n, c in v.items()} for k, v in best.items()}, f)
    print("best:", best)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--sweep", action="store_true", help="tune tile configs first")
    ap.add_argument("--sweep-bs", default="128,64,32,16,8", help="block sizes to sweep")
    ap.add_argument("--sweep-density", type=float, default=None, help="sweep the ds_few tiles at this density")
    ap.add_argument("--from-csv", help="rebuild matmul.md/png from a saved matmul.csv (adds roofline)")
    ap.add_argument("--device-name", default="NVIDIA H200", help="with --from-csv")
    ap.add_argument("--date", default=None, help="with --from-csv")
    ap.add_argument("--software", default=None, help="with --from-csv: versions the run used")
    ap.add_argument("--quick", action="store_true", help="bf16 only, densities 0.2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_csv:
        rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(open(args.from_csv))]
        write_outputs(rows, args.out, float(rows[0]["copy_bw_tbs"]), args.device_name, args.date,
                      args.software)
        return
    torch.manual_seed(0)
    if args.sweep:
        sweep(args.out, tuple(int(b) for b in args.sweep_bs.split(",")))
    if args.sweep_density:
        sweep_low_density(args.sweep_density, tuple(int(b) for b in args.sweep_bs.split(",")))
        return
    C = Kf = 4096
    bw = copy_bandwidth()
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    densities = [0.2] if args.quick else [0.5, 0.2, 0.05]
    rows = []
    for dtype in dtypes:
        for M in (8192, 64):
            dense = dense_times(M, C, Kf, dtype)
            for bs in (16, 32, 64, 128):
                for dens in densities:
                    lay = layouts.random((C // bs, Kf // bs), dens, seed=1)
                    t, nnz, w = ours_times(lay, bs, M, dtype)
                    bsr = bsr_times(lay, bs, M, dtype, w)
                    useful = 2 * M * nnz * bs * bs
                    for op in ("fwd", "dx", "dw"):
                        ours_tf = useful / (t[op] * 1e-3) / 1e12
                        dense_tf = 2 * M * C * Kf / (dense[op] * 1e-3) / 1e12
                        rows.append(dict(
                            dtype=str(dtype).replace("torch.", ""), M=M, bs=bs, density=dens,
                            real_density=round(nnz * bs * bs / (C * Kf), 4), op=op,
                            ours_us=round(t[op] * 1e3, 2), dense_us=round(dense[op] * 1e3, 2),
                            bsr_us=round(bsr.get(op, float("nan")) * 1e3, 2),
                            ours_tflops=round(ours_tf, 1), frac_dense_rate=round(ours_tf / dense_tf, 3),
                            speedup_vs_dense=round(dense[op] / t[op], 2),
                            speedup_vs_bsr=round(bsr.get(op, float("nan")) / t[op], 2),
                            vs_fwd_time=round(t[op] / t["fwd"], 2),
                            weight_stream_frac=round(nnz * bs * bs * 2 / (t[op] * 1e-3) / 1e12 / bw, 3),
                            copy_bw_tbs=round(bw, 3), nnz=nnz))
                    r = rows[-3]
                    print(f"{r['dtype']} M={M} bs={bs} d={dens}: fwd {r['ours_tflops']} TF/s "
                          f"({r['frac_dense_rate']} of dense), vs BSR {r['speedup_vs_bsr']}x, "
                          f"dx/fwd {rows[-2]['vs_fwd_time']}, dw/fwd {rows[-1]['vs_fwd_time']}", flush=True)
    write_outputs(rows, args.out, bw)


def _number(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def add_roofline(rows):
    """roofline_frac: the time floor over our time. The floor is the larger of useful FLOPs at the
    dense cuBLAS rate measured in the same run and the bytes that must move (each operand read
    once, the output written once) at the measured copy bandwidth."""
    C = Kf = 4096
    for r in rows:
        M, bs, nnz, op = int(r["M"]), int(r["bs"]), int(r["nnz"]), r["op"]
        w_bytes = nnz * bs * bs * (4 if op == "dw" else 2)
        act_bytes = M * (C + Kf) * 2
        dense_rate = 2 * M * C * Kf / float(r["dense_us"])
        floor = max(2 * M * nnz * bs * bs / dense_rate, (act_bytes + w_bytes) / (float(r["copy_bw_tbs"]) * 1e6))
        r["floor_us"] = round(floor, 2)
        r["roofline_frac"] = round(floor / float(r["ours_us"]), 3)
    return rows


def write_outputs(rows, out, bw, dev=None, stamp=None, software=None):
    rows = add_roofline(rows)
    dev = dev or torch.cuda.get_device_name()
    stamp = stamp or datetime.date.today().isoformat()
    software = software or this_software()
    with open(os.path.join(out, "matmul.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    cols = ["dtype", "M", "bs", "density", "op", "ours_us", "dense_us", "bsr_us", "ours_tflops",
            "frac_dense_rate", "speedup_vs_dense", "speedup_vs_bsr", "vs_fwd_time", "weight_stream_frac",
            "floor_us", "roofline_frac"]
    with open(os.path.join(out, "matmul.md"), "w") as f:
        f.write(f"# bsmm benchmark: {dev}, {stamp}, {software}\n\n"
                f"4096x4096 weight, random layouts. Copy bandwidth (read+write) measured in the same run: "
                f"{bw:.2f} TB/s. Times: median of CUDA-graph replays, inputs rotated past L2. "
                f"floor_us: max(useful FLOPs at the dense cuBLAS rate, bytes moved at copy bandwidth); "
                f"roofline_frac = floor_us / ours_us.\n\n")
        f.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[c]) for c in cols) + " |\n")
    plot(rows, out, dev, stamp)


def plot(rows, out, dev, stamp):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, op in zip(axes, ("fwd", "dx", "dw")):
        for bs in (16, 32, 64, 128):
            sel = [r for r in rows if r["op"] == op and r["bs"] == bs and r["M"] == 8192 and r["dtype"] == "bfloat16"]
            ax.plot([r["density"] for r in sel], [r["frac_dense_rate"] for r in sel], "o-", label=f"bs={bs}")
            if op == "fwd" and bs in TARGET_FWD:
                ax.axhline(TARGET_FWD[bs], ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.set_xscale("log")
        ax.set_title(f"{op}: useful TFLOP/s / dense cuBLAS (bf16, M=8192)")
        ax.set_xlabel("density")
    axes[0].set_ylabel("fraction of dense rate")
    axes[0].legend()
    fig.suptitle(f"bstrain bsmm on {dev}, {stamp} (dotted: forward targets)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "matmul.png"), dpi=110)


if __name__ == "__main__":
    main()
