"""Do the op library's Triton kernels earn their place? Each against torch eager and torch.compile.

    PYTHONPATH=$PWD python scripts/bench/bench_ops.py [--out DIR] [--parts seed,glue] [--widths 512,1024]
    PYTHONPATH=$PWD python scripts/bench/bench_ops.py --parts glue --cpu-smoke --out /tmp/x     # CI: tiny, CPU

Part ``seed`` (ops.md, ops.csv, ops.png):
For each fused op, forward+backward time (median of triton.testing.do_bench) of:
  ours      the Triton kernel path of bstrain.ops (fused_lstm_gates, layer_norm's general case)
  eager     the same math in PyTorch (the op's *_ref)
  compile   torch.compile of that PyTorch math
A kernel is kept only if it beats torch.compile by at least 1.2x (the "keep" column).

Part ``glue`` (ops_glue.md and .json, issue 41): the transformer's fused glue kernels at
transformer_enwik8's step (4 x 8192 tokens, bf16, d_model of --widths, heads of 64 and 128), forward
and backward apart (backward = forward+backward - forward), against torch.compile of the same math
(the ops' ``*_ref``), each as a share of the HBM bandwidth measured in the same run (a device copy):
the least bytes each pass must move (inputs read once, outputs written once; the table's "bytes"):
  add_layer_norm  h = x + r, y = LN(h)     fwd: read x, r, write y, h;   bwd: read dy, dh, h, write dx
  bias_gelu       gelu(x + b), x (N, 4C)   fwd: read x, write y;         bwd: read dy, x, write dx
  apply_rotary    q and k of a qkv (N, 3C) fwd: read x, write y;         bwd: read dy, write dx
  cross_entropy   bf16 logits (N, 256)     fwd: read logits;             bwd: read logits, write dlogits
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.ops import ew, norms  # noqa: E402
from scripts._timing import bench, environment, software, write_report  # noqa: E402

KEEP_RATIO = 1.2


def bench_fwd_bwd(fn, inputs, grad_out):
    """Median ms of fn(*inputs) followed by backward(grad_out)."""
    def step():
        out = fn(*inputs)
        out = out[1] if isinstance(out, tuple) else out
        out.backward(grad_out)
    return triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=list(inputs), return_mode="median")


def cases(dtype):
    """(name, ours, reference, inputs, grad_out) for each fused op and size."""
    dev = "cuda"
    out = []
    for n, k in ((256, 4096), (8192, 4096)):
        c = torch.randn(n, k, device=dev, dtype=dtype, requires_grad=True)
        h = torch.randn(n, 4 * k, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(4 * k, device=dev, dtype=dtype, requires_grad=True)

        def ref_lstm(c, h, b):
            return ew.fused_lstm_gates_ref(c, *(h + b).chunk(4, 1))
        out.append((f"fused_lstm_gates N={n} K={k}+bias", lambda c, h, b: ew.fused_lstm_gates(c, h, bias=b),
                    ref_lstm, (c, h, b), torch.randn(n, k, device=dev, dtype=dtype)))
    for axis, seg, relu, (n, c) in ((0, 1, False, (8192, 4096)), (0, 1, True, (8192, 4096)),
                                    (1, 4, False, (8192, 4096)), (1, 1, True, (8192, 4096))):
        shape = (n, c) if axis == 1 else (c, n)
        x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
        g = torch.rand(c, device=dev, dtype=dtype, requires_grad=True)
        bb = torch.randn(c, device=dev, dtype=dtype, requires_grad=True)
        kw = dict(axis=axis, segments=seg, relu=relu)
        out.append((f"layer_norm axis={axis} seg={seg} relu={relu} {shape}",
                    lambda x, g, b, kw=kw: norms.layer_norm(x, g, b, **kw),
                    lambda x, g, b, kw=kw: norms.layer_norm_ref(x, g, b, **kw), (x, g, bb),
                    torch.randn(shape, device=dev, dtype=dtype)))
    return out


def glue_cases(width: int, head_dim: int, tokens: int, dev, dtype):
    """(name, ours, math, inputs, grads, (fwd bytes, bwd bytes)) of each glue op at one width."""
    from bstrain.ops.bias_act import bias_gelu, bias_gelu_ref
    from bstrain.ops.cross_entropy import cross_entropy, cross_entropy_ref
    from bstrain.ops.residual_norm import add_layer_norm, add_layer_norm_ref
    from bstrain.ops.rotary import apply_rotary, apply_rotary_ref, rotary_tables
    N, C, e, T = tokens, width, torch.finfo(dtype).bits // 8, min(tokens, 8192)
    rand = lambda *shape, grad=True: torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)  # noqa: E731
    heads = C // head_dim
    cos, sin = rotary_tables(T, head_dim, dev)
    labels = torch.randint(0, 256, (N,), device=dev)
    return [
        (f"add_layer_norm C={C}", add_layer_norm, add_layer_norm_ref,
         (rand(N, C), rand(N, C), rand(C), rand(C)), (rand(N, C, grad=False), rand(N, C, grad=False)),
         (4 * N * C * e, 4 * N * C * e)),
        (f"bias_gelu C={4 * C}", bias_gelu, bias_gelu_ref, (rand(N, 4 * C), rand(4 * C)),
         (rand(N, 4 * C, grad=False),), (2 * N * 4 * C * e, 3 * N * 4 * C * e)),
        (f"apply_rotary qkv C={3 * C} D={head_dim}",
         lambda x: apply_rotary(x, cos, sin, head_dim, 2 * heads),
         lambda x: apply_rotary_ref(x, cos, sin, head_dim, 2 * heads),
         (rand(N // T, T, 3 * C),), (rand(N // T, T, 3 * C, grad=False),), (2 * N * 3 * C * e, 2 * N * 3 * C * e)),
        ("cross_entropy V=256", lambda z: cross_entropy(z, labels), lambda z: cross_entropy_ref(z, labels),
         (rand(N, 256),), (torch.ones(N, device=dev),), (N * 256 * e + 8 * N + 4 * N, 2 * N * 256 * e + 4 * N)),
    ]


def fwd_and_bwd_ms(fn, inputs, grads, smoke: bool) -> tuple[float, float]:
    """(forward ms, backward ms): medians of the forward and of forward+backward, the backward their difference."""
    def fb():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grads)
    fwd = bench(lambda: fn(*inputs), smoke)
    return fwd, max(bench(fb, smoke) - fwd, 0.0)


def hbm_bytes_per_ms(smoke: bool) -> float | None:
    """Measured device bandwidth: bytes read plus written per ms of a 2 GiB device-to-device copy."""
    if smoke:
        return None
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    del a, b
    return 2 * (1 << 31) / ms


def glue(args) -> None:
    """The glue part: ops_glue.md and .json in --out."""
    smoke = args.cpu_smoke
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    tokens = 128 if smoke else 4 * 8192
    bw = hbm_bytes_per_ms(smoke)
    rows = []
    for width in args.widths:
        head_dim = min(64 if width <= 512 else 128, width // 2)           # transformer_enwik8's D64 / D128
        for name, ours, ref, inputs, grads, (fwd_bytes, bwd_bytes) in glue_cases(width, head_dim, tokens, dev, dtype):
            times = {"ours": fwd_and_bwd_ms(ours, inputs, grads, smoke),
                     "compile": fwd_and_bwd_ms(ref if smoke else torch.compile(ref), inputs, grads, smoke)}
            for pas, i, nbytes in (("fwd", 0, fwd_bytes), ("bwd", 1, bwd_bytes)):
                row = {"op": name, "pass": pas, "bytes": nbytes, "ours_us": round(times["ours"][i] * 1e3, 1),
                       "compile_us": round(times["compile"][i] * 1e3, 1)}
                row["vs_compile"] = round(times["compile"][i] / times["ours"][i], 2) if times["ours"][i] else None
                for who in ("ours", "compile"):
                    ms = times[who][i]
                    row[f"{who}_hbm_pct"] = round(100 * nbytes / ms / bw, 1) if bw and ms else None
                rows.append(row)
                print(row, flush=True)
    env = environment(smoke)
    cols = ["op", "pass", "bytes", "ours_us", "compile_us", "vs_compile", "ours_hbm_pct", "compile_hbm_pct"]
    lines = [f"# Glue kernels against torch.compile: {env['device']}, {env['date']}, {software()}", "",
             f"4 x 8192 tokens ({tokens} in a CPU smoke), {str(dtype).replace('torch.', '')}; medians of do_bench; "
             "bwd = fwd+bwd - fwd; compile: torch.compile of the op's PyTorch reference (the same math); hbm %: "
             f"the pass's least bytes over its time, against the measured copy bandwidth "
             f"({'-' if bw is None else f'{bw / 1e9:.0f} GB/s'}).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    write_report(args.out, "ops_glue", lines, {"rows": rows, "hbm_bytes_per_s": bw and bw * 1e3, **env,
                                               "command": " ".join(sys.argv)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--parts", default="seed", help="comma list: seed (ops.md), glue (ops_glue.md)")
    ap.add_argument("--widths", default="512,1024", help="glue: d_model values (heads of 64 at 512, else 128)")
    ap.add_argument("--cpu-smoke", action="store_true", help="glue at tiny sizes on the CPU: checks the script")
    args = ap.parse_args()
    args.widths = [int(w) for w in args.widths.split(",") if w]
    parts = set(args.parts.split(","))
    if parts - {"seed", "glue"}:
        raise SystemExit(f"--parts: expected seed and/or glue, got {args.parts!r}")
    if args.cpu_smoke:
        parts, args.widths = {"glue"}, [32]
    os.makedirs(args.out, exist_ok=True)
    if "glue" in parts:
        glue(args)
    if "seed" in parts:
        seed(args)


def seed(args) -> None:
    rows = []
    for dtype in (torch.bfloat16,):
        for name, ours, ref, inputs, grad in cases(dtype):
            compiled = torch.compile(ref)
            t = {"ours": bench_fwd_bwd(ours, inputs, grad), "eager": bench_fwd_bwd(ref, inputs, grad),
                 "compile": bench_fwd_bwd(compiled, inputs, grad)}
            row = dict(op=name, dtype=str(dtype).replace("torch.", ""), ours_us=round(t["ours"] * 1e3, 1),
                       eager_us=round(t["eager"] * 1e3, 1), compile_us=round(t["compile"] * 1e3, 1),
                       vs_eager=round(t["eager"] / t["ours"], 2), vs_compile=round(t["compile"] / t["ours"], 2))
            row["keep"] = row["vs_compile"] >= KEEP_RATIO
            rows.append(row)
            print(f"{name:52s} ours {row['ours_us']:9.1f}us  eager {row['eager_us']:9.1f}us  "
                  f"compile {row['compile_us']:9.1f}us  vs compile {row['vs_compile']:.2f}x", flush=True)
    write(rows, args.out)


def write(rows, out):
    dev, stamp = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    with open(os.path.join(out, "ops.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    with open(os.path.join(out, "ops.md"), "w") as f:
        f.write(f"# bench_ops: {dev}, {stamp}, {software()}\n\n"
                f"Forward+backward, median of triton.testing.do_bench. keep: beats torch.compile by "
                f">= {KEEP_RATIO}x.\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[c]) for c in cols) + " |\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    names = [r["op"] for r in rows]
    ax.barh(names, [r["vs_compile"] for r in rows], color=["tab:green" if r["keep"] else "tab:gray" for r in rows])
    ax.axvline(KEEP_RATIO, ls=":", color="k")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speedup of the Triton kernel over torch.compile (fwd+bwd)")
    ax.set_title(f"bstrain fused ops on {dev}, {stamp} (green: kept)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ops.png"), dpi=110)


if __name__ == "__main__":
    main()
