"""What one eager BlockSparseLinear forward + backward costs against nn.Linear's: the figure a layer
with no sparsity policy must keep (target: at most 1.3x nn.Linear).

    PYTHONPATH=$PWD python scripts/bench/bench_eager_linear.py [--m 64] [--features 4096] [--density 0.1]
        [--blocks 32,64,128] [--out DIR] [--profile] [--cpu-smoke]

Both layers hold fp32 master weights and run under bf16 autocast (fp32 on the CPU), on an fp32
input that needs its gradient, as a training step's layer does; the gradient accumulates into
.grad across calls. Per call: the mean wall time of ``calls`` back-to-back calls ended by one
synchronize, the median of ``repeats`` such loops, with the two layers' loops interleaved; the
ratio is the median of the ratios of neighbouring loops, since the host's speed drifts between
loops far more than within one pair. At M=64 the GPU work is a few µs: the figure is the host's
cost. ``--profile`` adds a cProfile of the sparse call (the top functions by own time) and the
number of kernels each call launches. ``--cpu-smoke`` runs the same code on the CPU at a small size
(the PyTorch path) to check the script itself; CI runs it so.

Writes eager_linear.md and eager_linear.json to --out (nothing without --out).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.nn import BlockSparseLinear  # noqa: E402
from scripts._timing import sync  # noqa: E402


def fwd_bwd(layer, x: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype):
    """One training call of ``layer``: forward under autocast, backward of a fixed output gradient."""
    device = x.device

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = layer(x)
        y.backward(grad)
    return step


def loop_us(fn, device: torch.device, calls: int) -> float:
    sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t) / calls * 1e6


def interleaved_us(fns: dict, device: torch.device, calls: int, repeats: int) -> dict[str, list[float]]:
    """{name: the per-call µs of ``calls`` calls, for each of ``repeats`` loops}, loops interleaved."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(loop_us(fn, device, calls))
    return times


def kernels_per_call(fn, device: torch.device) -> int | None:
    """Kernels one call launches (torch.profiler's device events), None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        sync(device)
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return round(n / 10)


def profile_host(fn, device: torch.device, calls: int = 300) -> None:
    fn()
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync(device)
    prof.disable()
    print(f"--- cProfile, {calls} calls, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="a small size on the CPU: checks the script")
    args = ap.parse_args()
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.m, args.features, args.blocks, args.calls, args.repeats = 8, 128, "32", 3, 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    m = c = k = args.features
    m = args.m
    torch.manual_seed(0)
    x = torch.randn(m, c, device=device, requires_grad=True)
    grad = torch.randn(m, k, device=device, dtype=dtype)
    linear = torch.nn.Linear(c, k, bias=False, device=device)
    rows = []
    for bs in (int(b) for b in args.blocks.split(",")):
        layer = BlockSparseLinear(c, k, bias=False, block_size=bs, density=args.density, seed=0, device=device)
        sparse, dense = fwd_bwd(layer, x, grad, dtype), fwd_bwd(linear, x, grad, dtype)
        us = interleaved_us({"dense": dense, "sparse": sparse}, device, args.calls, args.repeats)
        # the ratio of each pair of neighbouring loops, then their median: the host's speed drifts
        # between loops far more than within one pair
        ratios = [s / d for s, d in zip(us["sparse"], us["dense"])]
        row = dict(M=m, C=c, K=k, block=bs, density=round(layer.op.density, 4),
                   dense_us=round(statistics.median(us["dense"]), 1), sparse_us=round(statistics.median(us["sparse"]), 1),
                   ratio=round(statistics.median(ratios), 2), ratio_range=[round(min(ratios), 2), round(max(ratios), 2)],
                   dense_kernels=kernels_per_call(dense, device), sparse_kernels=kernels_per_call(sparse, device))
        rows.append(row)
        print(row, flush=True)
        if args.profile:
            profile_host(sparse, device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = (f"# Eager BlockSparseLinear forward + backward against nn.Linear: {device_name}, "
            f"{datetime.date.today()}\n\ntorch {torch.__version__}; scripts/bench/bench_eager_linear.py; "
            f"M={m}, {c}x{k}, fp32 master weights under {str(dtype).split('.')[-1]} autocast; per-call wall time "
            f"(µs), median of {args.repeats} interleaved loops of {args.calls} calls; ratio: the median of the "
            f"{args.repeats} neighbouring loops' ratios (their range beside). Target: ratio <= 1.3.\n")
    lines = [head, "| block | density | nn.Linear µs | BlockSparseLinear µs | ratio | range | kernels (dense, sparse) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['block']} | {r['density']} | {r['dense_us']} | {r['sparse_us']} | {r['ratio']} | "
              f"{r['ratio_range'][0]}–{r['ratio_range'][1]} | {r['dense_kernels']}, {r['sparse_kernels']} |"
              for r in rows]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "eager_linear.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "eager_linear.json"), "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
