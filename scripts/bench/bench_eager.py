"""What an eager call costs: block-sparse ops against dense cuBLAS, called from Python, eager and
under torch.compile, and the sparse LSTM's eager step against its CUDA-graph step.

    PYTHONPATH=$PWD python scripts/bench/bench_eager.py [--out DIR] [--m 64] [--parts layer,lstm] [--cpu-smoke]

Layer part, at M rows of a C x K weight (default 64 x 4096 x 4096, bf16), per block size and density:
  dense_fwd      x @ w (cuBLAS), per call, called in a loop
  sparse_fwd     BlocksparseMatMul op(x, w), per call (the eager path)
  op_fwd         torch.ops.bstrain.bsmm(x, w, ...) called directly: the same launch through the
                 dispatcher, as a compiled graph calls it
  dense_gpu, sparse_gpu   the same calls replayed from a CUDA graph: the GPU work alone
  dense_fb       nn.Linear forward + backward under autocast, per call
  sparse_fb      BlockSparseLinear forward + backward under autocast, per call
  compile_fb     torch.compile(BlockSparseLinear, fullgraph=True) forward + backward
  ro_fb          the same with mode="reduce-overhead" (CUDA graphs through the custom ops)
  graph_fb       the eager forward + backward captured by hand in one torch.cuda.CUDAGraph,
                 replayed once per call
  triton_launch  an empty Triton kernel, per launch: the floor of any Triton call
Per-call times are wall-clock means over a loop of calls ended by one synchronize (what Python
code that calls the op pays), medians of 5 such loops; all in one process, one run.

Host part (``--parts host``): the eager host cost of one forward + backward call of a conv layer and
of the fused attention, each against its dense twin, at shapes small enough that the GPU work
(shown beside, from CUDA-graph replays) is far shorter than the host's, so the per-call wall time
is the host cost. Targets: BlockSparseConv2d ≤ 1.5× nn.Conv2d; BlocksparseTransformer.attention ≤
1.5× F.scaled_dot_product_attention. Writes eager_host.md and eager_host.json.

LSTM part (needs hydra): the trainer's step of the sparse mLSTM at hidden 8192 (batch 64 x 32,
density 0.1, block 32), eager against the CUDA-graph step.

Writes eager.md and eager.json to --out. --cpu-smoke runs the layer part on the CPU at tiny
sizes (the PyTorch path; no graph, no Triton launch) to check the script itself.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.nn import BlockSparseLinear  # noqa: E402
from scripts._timing import environment, wall_per_call, write_report  # noqa: E402


REPEATS = 5


def per_call_us(fn, device: torch.device, calls: int = 200, repeats: int | None = None) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` back-to-back calls, in µs."""
    return wall_per_call(fn, device, calls, repeats or REPEATS, warmup=10) * 1e6


def gpu_us(fn) -> float:
    """GPU time of one call, replayed from a CUDA graph (median of triton.testing.do_bench_cudagraph)."""
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def triton_launch_us(device: torch.device) -> float:
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass
    x = torch.empty(1, device=device)
    return per_call_us(lambda: _empty[(1,)](x), device)


def fwd_bwd(module, x, grad, dtype, device):
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = module(x)
        y.backward(grad)
    return step


def graphed(step, device: torch.device):
    """``step`` captured once in a CUDA graph (after warm-up on a side stream); returns replay."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def try_us(row: dict, key: str, make, device, calls=50) -> None:
    """row[key] = per-call µs of make()'s function, or None and row[key + '_error']."""
    try:
        row[key] = round(per_call_us(make(), device, calls=calls), 1)
    except Exception as exc:                      # a failure is a result too
        row[key] = None
        row[key + "_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(f"{key}: {row[key + '_error']}", flush=True)


def measure_layers(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    m, c, k = args.m, args.features, args.features
    cuda = device.type == "cuda"
    x = torch.randn(m, c, device=device, dtype=dtype)
    w_dense = torch.randn(c, k, device=device, dtype=dtype)
    dense_fwd = per_call_us(lambda: x @ w_dense, device)
    dense_gpu = gpu_us(lambda: x @ w_dense) if cuda else None
    linear = torch.nn.Linear(c, k, bias=False, device=device)
    xg = torch.randn(m, c, device=device, requires_grad=True)
    grad = torch.randn(m, k, device=device, dtype=dtype)
    dense_fb = per_call_us(fwd_bwd(linear, xg, grad, dtype, device), device, calls=50)
    dense = dict(dense_fwd_us=round(dense_fwd, 1), dense_fb_us=round(dense_fb, 1),
                 dense_gpu_us=round(dense_gpu, 1) if dense_gpu else None)
    if args.compile:
        torch._dynamo.reset()
        try_us(dense, "dense_compile_fb_us", lambda: fwd_bwd(torch.compile(linear), xg, grad, dtype, device), device)
    for bs in args.block_sizes:
        for density in args.densities:
            layer = BlockSparseLinear(c, k, bias=False, block_size=bs, density=density, seed=0, device=device)
            op, w = layer.op, layer.weight.detach().to(dtype)
            row = dict(M=m, C=c, K=k, block=bs, density=round(op.density, 4), dtype=str(dtype).split(".")[-1], **dense)
            row["sparse_fwd_us"] = round(per_call_us(lambda: op(x, w), device), 1)
            if cuda:
                row["op_fwd_us"] = round(per_call_us(lambda: torch.ops.bstrain.bsmm(x, w, op.key, 1, torch.float32),
                                                     device), 1)
                row["sparse_gpu_us"] = round(gpu_us(lambda: op(x, w)), 1)
            step = fwd_bwd(layer, xg, grad, dtype, device)
            row["sparse_fb_us"] = round(per_call_us(step, device, calls=50), 1)
            if cuda:    # fresh leaves: autograd nodes made on the default stream must not enter the capture
                fresh = fwd_bwd(copy.deepcopy(layer), xg.detach().clone().requires_grad_(), grad, dtype, device)
                try_us(row, "graph_fb_us", lambda: graphed(fresh, device), device)
            if args.compile and density in args.compile_densities:
                for mode, key in ((None, "compile_fb_us"), ("reduce-overhead", "ro_fb_us")):
                    torch._dynamo.reset()
                    try_us(row, key, lambda: fwd_bwd(torch.compile(layer, fullgraph=True, mode=mode), xg, grad,
                                                     dtype, device), device)
            row["fwd_vs_dense"] = round(row["sparse_fwd_us"] / dense_fwd, 2)
            row["fb_vs_dense"] = round(row["sparse_fb_us"] / dense_fb, 2)
            if row.get("ro_fb_us") and row.get("graph_fb_us"):
                row["ro_vs_graph"] = round(row["ro_fb_us"] / row["graph_fb_us"], 2)
            if row.get("compile_fb_us"):
                row["compile_vs_eager"] = round(row["compile_fb_us"] / row["sparse_fb_us"], 2)
            rows.append(row)
            print(row, flush=True)
            torch._dynamo.reset()
    return rows


def _host_row(name, sparse_step, dense_step, device, gpu: bool) -> dict:
    from bstrain.kernels import launch
    row = {"case": name}
    direct = launch.stats["direct"]
    try_us(row, "sparse_us", lambda: sparse_step, device, calls=100)
    row["direct_launches_per_call"] = round((launch.stats["direct"] - direct) / (100 * REPEATS + 10), 1)
    try_us(row, "dense_us", lambda: dense_step, device, calls=100)
    if gpu:
        for key, step in (("sparse_gpu_us", sparse_step), ("dense_gpu_us", dense_step)):
            try:
                row[key] = round(gpu_us(step), 1)
            except Exception as exc:
                row[key] = None
                row[key + "_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if row.get("sparse_us") and row.get("dense_us"):
        row["ratio"] = round(row["sparse_us"] / row["dense_us"], 2)
        row["met"] = row["ratio"] <= 1.5
    print(row, flush=True)
    return row


def measure_host(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Eager host cost of one fwd+bwd call: conv and attention against their dense twins."""
    import torch.nn.functional as F
    from torch import nn

    from bstrain import layout as layouts
    from bstrain.nn import BlockSparseConv2d
    from bstrain.ops.transformer import BlocksparseTransformer
    cuda = device.type == "cuda"
    rows = []
    # conv: 256 channels, blocks of 64, 25% live (the kernels' path), 4 x 16 x 16 images
    n, ch, hw = (4, 256, 16) if cuda else (1, 32, 6)
    bs = 64 if cuda else 16
    fmt = torch.channels_last if cuda else torch.contiguous_format
    sparse = BlockSparseConv2d(ch, ch, 3, padding=1, block_size=bs, density=0.25, seed=0, device=device, dtype=dtype)
    dense = nn.Conv2d(ch, ch, 3, padding=1, device=device, dtype=dtype).to(memory_format=fmt)
    x = torch.randn(n, ch, hw, hw, device=device, dtype=dtype).to(memory_format=fmt).requires_grad_()
    g = torch.randn(n, ch, hw, hw, device=device, dtype=dtype).to(memory_format=fmt)
    rows.append(_host_row(f"conv {n}x{ch}x{hw}x{hw}, 3x3, blocks of {bs}, 25% live ({sparse._path(x)})",
                          lambda: sparse(x).backward(g), lambda: dense(x).backward(g), device, cuda))
    # attention: causal, 8 heads of 64, 512 positions, blocks of 64, batch 1
    T, H, D, abs_ = (512, 8, 64, 64) if cuda else (64, 2, 16, 16)
    lay, cb = layouts.attention_layout(layouts.causal_mask, T, T, abs_)
    op = BlocksparseTransformer(lay, abs_, heads=H, mask_callback=cb)
    q, k, v = (torch.randn(1, T, H * D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(1, T, H * D, device=device, dtype=dtype)
    qh, kh, vh = (t.detach().view(1, T, H, D).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    doh = do.view(1, T, H, D).transpose(1, 2).contiguous()
    rows.append(_host_row(f"attention causal, T={T}, {H} heads of {D}, blocks of {abs_}, batch 1",
                          lambda: op.attention(q, k, v).backward(do),
                          lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).backward(doh),
                          device, cuda))
    return rows


def report_host(rows: list[dict], extra: dict, out: str) -> None:
    lines = [f"# Eager host cost of conv and attention: {extra['device']}, {extra['date']}", "",
             f"torch {extra['torch']}, triton {extra.get('triton', '-')}; `scripts/bench/bench_eager.py --parts host`. "
             f"One forward + backward call, wall time per call in a loop of calls (µs, median of {REPEATS} loops), "
             "at shapes where the GPU work (CUDA-graph replay, beside) is shorter than the host's: the wall "
             "time is the host cost. Target: ≤ 1.5× the dense twin's.", "",
             "| case | bstrain µs | dense twin µs | ratio | target ≤ 1.5 | bstrain GPU µs | dense GPU µs | direct launches per call |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "met" if r.get("met") else ("missed" if "met" in r else "-")
        lines.append(f"| {r['case']} | {r.get('sparse_us')} | {r.get('dense_us')} | {r.get('ratio', '-')} | {met} | "
                     f"{r.get('sparse_gpu_us', '-')} | {r.get('dense_gpu_us', '-')} | {r.get('direct_launches_per_call')} |")
    lines += ["", "Dense twins: `nn.Conv2d` (cuDNN) at the same shape; `F.scaled_dot_product_attention(is_causal=True)`."]
    write_report(out, "eager_host", lines, {"rows": rows, **extra})


def measure_lstm(args) -> list[dict]:
    """The sparse mLSTM's trainer step, eager and graphed, in this process (scripts/bench/bench_lstm.py)."""
    from scripts.bench.bench_lstm import config, step_time
    rows = []
    cfg = config("model.hidden=8192", f"model.density={args.lstm_density}", "model.layout=random",
                 "model.embed=256", "model.depth=2", "model.block_size=32")
    for graph in (True, False):
        ms, dens = step_time(cfg, args.lstm_batch, 32, 8, graph)
        rows.append(dict(hidden=8192, batch=args.lstm_batch, seq=32, block=32, density=round(dens, 4),
                         mode="graph" if graph else "eager", step_ms=round(ms, 2)))
        print(rows[-1], flush=True)
    return rows


def report(rows: list[dict], lstm: list[dict], extra: dict, out: str) -> None:
    lines = [f"# Eager call cost: {extra['device']}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; scripts/bench/bench_eager.py; per-call wall time of calls in a loop "
             f"(µs, median of {REPEATS} loops), all in one run. An empty Triton kernel launch: "
             f"{extra.get('triton_launch_us', 'n/a')} µs.", "",
             "Forward, M={M}: `x @ w` {d} µs per call (GPU time {g} µs).".format(
                 M=rows[0]["M"], d=rows[0]["dense_fwd_us"], g=rows[0]["dense_gpu_us"]) if rows else "", "",
             "| block | density | op(x, w) | torch.ops.bstrain.bsmm | GPU time | op / (x @ w) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['block']} | {r['density']} | {r['sparse_fwd_us']} | {r.get('op_fwd_us', '-')} | "
                     f"{r.get('sparse_gpu_us', '-')} | {r['fwd_vs_dense']} |")
    if rows:
        r0 = rows[0]
        lines += ["", f"Forward + backward under autocast: `nn.Linear` {r0['dense_fb_us']} µs per call"
                  + (f", compiled {r0.get('dense_compile_fb_us')} µs" if r0.get("dense_compile_fb_us") else "") + ".",
                  "", "| block | density | BlockSparseLinear | / nn.Linear | compiled | compiled / eager | "
                  "reduce-overhead | CUDA graph by hand | reduce-overhead / by hand |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['block']} | {r['density']} | {r['sparse_fb_us']} | {r['fb_vs_dense']} | "
                         f"{r.get('compile_fb_us', '-')} | {r.get('compile_vs_eager', '-')} | {r.get('ro_fb_us', '-')} | "
                         f"{r.get('graph_fb_us', '-')} | {r.get('ro_vs_graph', '-')} |")
    errors = sorted({f"{k}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")})
    if errors:
        lines += ["", "Errors:", *[f"- `{e}`" for e in errors]]
    if lstm:
        lines += ["", "Sparse mLSTM trainer step (hidden 8192, depth 2, bf16, grad groups of 8):", "",
                  "| batch x seq | block | density | mode | ms per step |", "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} x {r['seq']} | {r['block']} | {r['density']} | {r['mode']} | {r['step_ms']} |"
                  for r in lstm]
        by = {r["mode"]: r["step_ms"] for r in lstm}
        if "eager" in by and "graph" in by:
            lines += ["", f"Eager / graphed: {by['eager'] / by['graph']:.2f}"]
    write_report(out, "eager", lines, {"rows": rows, "lstm": lstm, **extra})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--features", type=int, default=4096)
    floats = lambda s: [float(v) for v in s.split(",")]      # noqa: E731
    ap.add_argument("--block-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128])
    ap.add_argument("--densities", type=floats, default=[0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--compile-densities", type=floats, default=[0.1])
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--parts", default="layer,lstm")
    ap.add_argument("--lstm-batch", type=int, default=64)
    ap.add_argument("--lstm-density", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5, help="loops of calls per measurement (the median is kept)")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    global REPEATS
    REPEATS = args.repeats
    os.makedirs(args.out, exist_ok=True)
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.m, args.features, args.block_sizes, args.densities = 8, 64, [16], [0.5]
        args.compile_densities = [0.5]
        args.parts = "layer" if args.parts == "layer,lstm" else args.parts
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    extra = environment(device.type != "cuda")
    if device.type == "cuda":
        import triton
        extra["triton"] = triton.__version__
        extra["triton_launch_us"] = round(triton_launch_us(device), 1)
    parts = args.parts.split(",")
    if "host" in parts:
        report_host(measure_host(args, device, dtype), extra, args.out)
    rows = measure_layers(args, device, dtype) if "layer" in parts else []
    lstm = measure_lstm(args) if "lstm" in parts else []
    if rows or lstm:
        report(rows, lstm, extra, args.out)


if __name__ == "__main__":
    main()
