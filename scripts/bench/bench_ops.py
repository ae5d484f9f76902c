"""Do the op library's Triton kernels earn their place? Each against torch eager and torch.compile.

    PYTHONPATH=$PWD python scripts/bench/bench_ops.py [--out DIR]

For each fused op, forward+backward time (median of triton.testing.do_bench) of:
  ours      the Triton kernel path of bstrain.ops (fused_lstm_gates, layer_norm's general case)
  eager     the same math in PyTorch (the op's *_ref)
  compile   torch.compile of that PyTorch math
A kernel is kept only if it beats torch.compile by at least 1.2x (the "keep" column).
Writes ops.md, ops.csv and ops.png to --out.
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
from scripts._timing import software  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
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
