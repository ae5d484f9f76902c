"""What an eager call costs (issue 10): block-sparse ops against dense cuBLAS, called from Python.

    PYTHONPATH=$PWD python scripts/bench_eager.py [--out DIR] [--m 64] [--cpu-smoke]

For each block size and density, at M rows of a C x K weight (default 64 x 4096 x 4096, bf16):
  dense_fwd      x @ w (cuBLAS), per call, called in a loop
  sparse_fwd     BlocksparseMatMul op(x, w), per call, called in a loop
  sparse_graph   the same call replayed from a CUDA graph: the GPU work alone
  dense_fb       nn.Linear forward + backward under autocast, per call
  sparse_fb      BlockSparseLinear forward + backward under autocast, per call
  compile_fb     torch.compile(BlockSparseLinear, fullgraph=True) forward + backward (or its error)
  triton_launch  an empty Triton kernel, per launch: the floor of any Triton call
Per-call times are wall-clock means over a loop of calls ended by one synchronize (what Python
code that calls the op pays), medians of 5 such loops. Writes eager.md and eager.json to --out.
--cpu-smoke runs the same code on the CPU at tiny sizes (the PyTorch path; no graph, no
Triton launch) to check the script itself.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bstrain.models.layers import BlockSparseLinear  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, device: torch.device, calls: int = 200, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` back-to-back calls, in µs."""
    for _ in range(10):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def graph_us(fn, device: torch.device) -> float:
    """GPU time of one call, replayed from a CUDA graph (median of triton.testing.do_bench_cudagraph)."""
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def triton_launch_us(device: torch.device) -> float:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr, n: tl.constexpr):
        pass
    x = torch.empty(1, device=device)
    return per_call_us(lambda: _empty[(1,)](x, 1), device)


def fwd_bwd(module, x, grad, dtype, device):
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = module(x)
        y.backward(grad)
    return step


def measure(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    m, c, k = args.m, args.features, args.features
    x = torch.randn(m, c, device=device, dtype=dtype)
    w_dense = torch.randn(c, k, device=device, dtype=dtype)
    dense_fwd = per_call_us(lambda: x @ w_dense, device)
    linear = torch.nn.Linear(c, k, bias=False, device=device)
    xg = torch.randn(m, c, device=device, requires_grad=True)
    grad = torch.randn(m, k, device=device, dtype=dtype)
    dense_fb = per_call_us(fwd_bwd(linear, xg, grad, dtype, device), device, calls=50)
    for bs in args.block_sizes:
        for density in args.densities:
            layer = BlockSparseLinear(c, k, bias=False, block_size=bs, density=density, seed=0, device=device)
            op, w = layer.op, layer.weight.detach().to(dtype)
            row = dict(M=m, C=c, K=k, block=bs, density=round(op.density, 4), dtype=str(dtype).split(".")[-1],
                       dense_fwd_us=round(dense_fwd, 1), dense_fb_us=round(dense_fb, 1))
            row["sparse_fwd_us"] = round(per_call_us(lambda: op(x, w), device), 1)
            row["sparse_fb_us"] = round(per_call_us(fwd_bwd(layer, xg, grad, dtype, device), device, calls=50), 1)
            if device.type == "cuda":
                row["sparse_graph_us"] = round(graph_us(lambda: op(x, w), device), 1)
            try:
                compiled = torch.compile(layer, fullgraph=True)
                row["compile_fb_us"] = round(per_call_us(fwd_bwd(compiled, xg, grad, dtype, device), device,
                                                         calls=50), 1)
            except Exception as exc:                     # the failure is a result too (issue 10)
                row["compile_fb_us"] = None
                row["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            row["fwd_vs_dense"] = round(row["sparse_fwd_us"] / dense_fwd, 2)
            row["fb_vs_dense"] = round(row["sparse_fb_us"] / dense_fb, 2)
            rows.append(row)
            print(row, flush=True)
            torch._dynamo.reset()
    return rows


def report(rows: list[dict], extra: dict, out: str) -> None:
    lines = [f"# Eager call cost: {extra['device']}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; per-call wall time of calls in a loop (µs, median of 5 loops). "
             f"An empty Triton kernel launch: {extra.get('triton_launch_us', 'n/a')} µs.", "",
             "| block | density | x @ w | op(x, w) | graph | fwd / dense | nn.Linear f+b | BlockSparseLinear f+b | "
             "f+b / dense | compiled f+b |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        compiled = r["compile_fb_us"] if r["compile_fb_us"] is not None else "fails"
        lines.append(f"| {r['block']} | {r['density']} | {r['dense_fwd_us']} | {r['sparse_fwd_us']} | "
                     f"{r.get('sparse_graph_us', '-')} | {r['fwd_vs_dense']} | {r['dense_fb_us']} | "
                     f"{r['sparse_fb_us']} | {r['fb_vs_dense']} | {compiled} |")
    errors = sorted({r["compile_error"] for r in rows if r.get("compile_error")})
    if errors:
        lines += ["", "torch.compile(fullgraph=True) errors:", *[f"- `{e}`" for e in errors]]
    with open(os.path.join(out, "eager.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "eager.json"), "w") as f:
        json.dump({"rows": rows, **extra}, f, indent=1)
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--block-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128])
    ap.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=[0.05, 0.2, 0.5])
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.m, args.features, args.block_sizes, args.densities = 8, 64, [16], [0.5]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    extra = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"}
    if device.type == "cuda":
        extra["triton_launch_us"] = round(triton_launch_us(device), 1)
    report(measure(args, device, dtype), extra, args.out)


if __name__ == "__main__":
    main()
