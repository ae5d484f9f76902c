"""Block-sparse convolution against dense conv2d and cuDNN grouped conv, in one run (issue 12).

    PYTHONPATH=$PWD python scripts/bench/bench_conv.py [--out DIR] [--block-sizes 32,64] [--cpu-smoke]

A ResNet-like layer: N=128, C=K=256, 32x32, 3x3, stride 1, SAME, bf16, in NCHW and channels-last.
For each live fraction (25%, 10%), forward and forward+backward medians (triton.testing.do_bench) of
  dense      F.conv2d over all channels (the reference time)
  grouped    cuDNN grouped conv at 4 and 8 groups (25% and 12.5% live; the orientation: the best
             case of structured sparsity)
  bstrain    BlockSparseConv2d on a balanced random block layout of that density, per block size,
             backend "grouped" (gather, one grouped conv, scatter-add), "dense" (masked filter) and
             "triton" (the implicit-GEMM kernels of bstrain.kernels.conv)
and ratio = time / (dense time x live fraction); the target is ratio <= 1.5.
Writes conv.md, conv.json and conv.png (with matplotlib) to --out.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.nn import BlockSparseConv2d  # noqa: E402
from scripts._timing import bench, environment, write_report  # noqa: E402  (median ms: do_bench on CUDA, timed calls on CPU)


def gpu_ms(fn, reps: int = 20) -> float:
    """Summed GPU time of fn's kernels per call (torch.profiler): the work, without the host's
    launch overhead, which a single small layer timed alone exposes."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1e3


def timed(forward, params, x, smoke):
    """(fwd ms, fwd+bwd ms, fwd GPU ms, fwd+bwd GPU ms) of y = forward(x), gradients for x and params."""
    g = torch.randn_like(forward(x))

    def fb():
        y = forward(x)
        torch.autograd.grad(y, [x, *params], g)

    def f():
        with torch.no_grad():
            forward(x)
    if smoke:
        return bench(f, smoke), bench(fb, smoke), float("nan"), float("nan")
    return bench(f, smoke), bench(fb, smoke), gpu_ms(f), gpu_ms(fb)


def row(fmt, method, live, block, t, dense) -> dict:
    """A table row: times (wall and GPU) and ratio = time / (dense time x live fraction)."""
    keys = ("fwd_ms", "fb_ms", "fwd_gpu_ms", "fb_gpu_ms")
    r = dict(format=fmt, method=method, density=round(live, 4), block=block, **{k: round(v, 4) for k, v in zip(keys, t)})
    for k, v, d in zip(keys, t, dense):
        r["ratio_" + k[:-3]] = round(v / (d * live), 2)
    return r


def measure(args) -> list[dict]:
    smoke = args.cpu_smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    N, C, HW = args.batch, args.channels, args.size
    rows = []
    for fmt in args.formats.split(","):
        mf = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
        x = torch.randn(N, C, HW, HW, device=dev, dtype=dt).to(memory_format=mf).requires_grad_()
        w = (torch.randn(C, C, 3, 3, device=dev, dtype=dt) * 0.05).to(memory_format=mf).requires_grad_()
        dense = timed(lambda t: F.conv2d(t, w, padding=1), [w], x, smoke)
        rows.append(row(fmt, "dense", 1.0, None, dense, dense))
        print(rows[-1], flush=True)
        for groups in args.groups:
            wg = (torch.randn(C, C // groups, 3, 3, device=dev, dtype=dt) * 0.05).to(memory_format=mf)
            wg.requires_grad_()
            t = timed(lambda t: F.conv2d(t, wg, padding=1, groups=groups), [wg], x, smoke)
            rows.append(row(fmt, f"cuDNN groups={groups}", 1 / groups, C // groups, t, dense))
            print(rows[-1], flush=True)
        for density in args.densities:
            for bs in args.block_sizes:
                for backend in args.backends.split(","):
                    conv = BlockSparseConv2d(C, C, 3, padding=1, bias=False, block_size=bs, density=density, seed=0,
                                             backend=backend).to(device=dev, dtype=dt)
                    live = conv.density
                    try:
                        t = timed(conv, [conv.weight], x, smoke)
                    except Exception as exc:                            # keep the other rows
                        print(f"bstrain bs={bs} {backend}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    rows.append(row(fmt, f"bstrain {backend}", live, bs, t, dense))
                    print(rows[-1], flush=True)
    return rows


def compiled(args) -> list[dict]:
    """fwd+bwd wall time under torch.compile(mode="reduce-overhead") (CUDA graphs: no host launch
    overhead per call) for dense, cuDNN groups=4 and BlockSparseConv2d (triton, dense) at 25% live,
    block 64, channels-last: the eager wall times above, without the host."""
    from torch import nn
    N, C, HW = args.batch, args.channels, args.size
    x = torch.randn(N, C, HW, HW, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    x.requires_grad_()
    mods = {"dense": nn.Conv2d(C, C, 3, padding=1, bias=False), "cuDNN groups=4": nn.Conv2d(C, C, 3, padding=1,
                                                                                             bias=False, groups=4)}
    for backend in ("triton", "dense"):
        mods[f"bstrain {backend}"] = BlockSparseConv2d(C, C, 3, padding=1, bias=False, block_size=64, density=0.25, seed=0,
                                                       backend=backend)
    out = []
    for name, m in mods.items():
        m = m.to(device="cuda", dtype=torch.bfloat16)
        if isinstance(m, nn.Conv2d):
            m = m.to(memory_format=torch.channels_last)
        params = list(m.parameters())
        try:
            fn = torch.compile(m, mode="reduce-overhead", fullgraph=True)
            g = torch.randn_like(m(x))

            def fb():
                torch.autograd.grad(fn(x), [x, *params], g)
            for _ in range(3):
                fb()
            out.append(dict(method=name, compiled_fb_ms=round(bench(fb, False), 4)))
        except Exception as exc:                                         # keep the other rows
            out.append(dict(method=name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
        print(out[-1], flush=True)
    return out


def report(rows, extra, args) -> None:
    lines = [f"# Block-sparse convolution: {extra['device']}, {extra['date']}", "",
             f"torch {extra['torch']}; scripts/bench/bench_conv.py; N={args.batch}, C=K={args.channels}, "
             f"{args.size}x{args.size}, 3x3, SAME, {extra['dtype']}; medians of triton.testing.do_bench. "
             "ratio = time / (dense time x live fraction); target fwd+bwd ratio <= 1.5.", "",
             "Wall: do_bench of the eager call (host launch overhead included); GPU: the summed kernel "
             "time per call (torch.profiler), what a layer costs inside a network that keeps the GPU busy.", "",
             "| format | method | live | block | fwd ms | fwd+bwd ms | GPU fwd ms | GPU fwd+bwd ms | ratio fwd "
             "| ratio fwd+bwd | GPU ratio fwd | GPU ratio fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['method']} | {r['density']:.3f} | {r['block'] or '-'} | {r['fwd_ms']} | "
                     f"{r['fb_ms']} | {r['fwd_gpu_ms']} | {r['fb_gpu_ms']} | {r['ratio_fwd']} | {r['ratio_fb']} | "
                     f"{r['ratio_fwd_gpu']} | {r['ratio_fb_gpu']} |")
    if extra.get("compiled"):
        lines += ["", "fwd+bwd under torch.compile(mode=\"reduce-overhead\", fullgraph=True), channels-last, 25% live, "
                  "block 64 (do_bench median):", "", "| method | fwd+bwd ms |", "|---|---|"]
        lines += [f"| {r['method']} | {r.get('compiled_fb_ms', r.get('error'))} |" for r in extra["compiled"]]
    write_report(args.out, "conv", lines, {"rows": rows, **extra})
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    pts = [r for r in rows if r["method"] != "dense"]
    labels = [f"{r['method']}\n{r['format'][:8]} bs={r['block']} {r['density']:.2f}" for r in pts]
    ax.bar(range(len(pts)), [r["ratio_fb_gpu"] for r in pts])
    ax.axhline(1.5, ls="--", c="grey", lw=1)
    ax.set_xticks(range(len(pts)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("fwd+bwd GPU time / (dense x live fraction)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "conv.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=[0.25, 0.1])
    ap.add_argument("--block-sizes", type=ints, default=[32, 64])
    ap.add_argument("--groups", type=ints, default=[4, 8], help="cuDNN grouped conv rows (orientation)")
    ap.add_argument("--formats", default="channels_last,nchw")
    ap.add_argument("--configs", help="a tune_conv.json whose best kernel configs to use")
    ap.add_argument("--backends", default="grouped,dense,triton",
                    help="BlockSparseConv2d backends to time (auto: the one it picks for this layer)")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--compiled", action="store_true", help="also time fwd+bwd under torch.compile(reduce-overhead)")
    args = ap.parse_args()
    if args.configs and not os.path.exists(args.configs):
        print(f"--configs {args.configs}: no such file; the kernels' default configs are used", flush=True)
    elif args.configs:
        from tune_conv import apply
        apply(args.configs)
    if args.cpu_smoke:
        args.batch, args.channels, args.size, args.block_sizes, args.formats = 2, 64, 8, [16], "nchw"
    os.makedirs(args.out, exist_ok=True)
    extra = {**environment(args.cpu_smoke), "dtype": "fp32" if args.cpu_smoke else "bf16"}
    rows = measure(args)
    if args.compiled and not args.cpu_smoke:
        extra["compiled"] = compiled(args)
    report(rows, extra, args)


if __name__ == "__main__":
    main()
