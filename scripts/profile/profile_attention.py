"""Where the attention time goes: kernel by kernel, ours against SDPA's, with the rate each kernel
reaches (issue 21's profile for the missed attention target).

    PYTHONPATH=$PWD python scripts/profile/profile_attention.py [--out DIR] [--seq 8192] [--dims 64,128]
                                                         [--cpu-smoke]

For a causal layout (blocks of 128) and a local one (blocks of 64) at context S, B=4, H=16, bf16:
one forward+backward under torch.profiler, the GPU time of each kernel, the matrix products it does
per live tile pair (ours: forward 2, dQ 3, dK/dV 4; flash: forward 2, backward 5) and the TFLOP/s
that makes on the live blocks. SDPA causal (flash) is the yardstick: a kernel that reaches a lower
rate than SDPA's kernel of the same pass is where the ideal speedup is lost. Writes
attention_profile.md and .json to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_attention import inputs  # noqa: E402
from bstrain import layout as L  # noqa: E402
from bstrain.ops.transformer import BlocksparseTransformer  # noqa: E402
from scripts._timing import environment, write_report  # noqa: E402

PRODUCTS = {"_attn_fwd": 2, "_attn_bwd_dq": 3, "_attn_bwd_dkdv": 4, "_attn_bwd": 5}


def products(name: str) -> int:
    """Matrix products a kernel does per live tile pair (0: not a product kernel)."""
    if name in PRODUCTS:
        return PRODUCTS[name]
    low = name.lower()
    if "flash" in low or "fmha" in low or "sdpa" in low or "cudnn" in low:
        if "dot_do_o" in low or "convert_dq" in low:           # flash's delta and dQ-cast kernels
            return 0
        return 5 if any(w in low for w in ("bwd", "bprop", "backward", "dgrad")) else 2
    return 0


def kernel_ms(fn, smoke: bool, reps: int = 5) -> dict[str, float]:
    """Mean GPU ms per call of each kernel of fn()."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    acts = [ProfilerActivity.CPU] if smoke else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if not smoke:
            torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        t = ev.device_time_total if not smoke else ev.cpu_time_total
        if t and (smoke or ev.device_type.name == "CUDA"):
            out[ev.key] += t / reps / 1e3
    return dict(out)


def measure(args) -> list[dict]:
    smoke = args.cpu_smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    B, H = args.batch, args.heads
    rows = []
    for S in args.seq:
        for D in args.dims:
            (q, k, v, g), (qh, kh, vh, gh) = inputs(B, S, H, D, dev, dt)
            cases = [("causal", L.causal_mask, 128), ("local", L.local_mask(max(128, S // 8)), 64)]
            for name, mask, bs in cases:
                lay, cb = L.attention_layout(mask, S, S, bs)
                live = int(lay.sum())
                op = BlocksparseTransformer(lay, bs, heads=H, mask_callback=cb, backend="torch" if smoke else "triton")

                def ours():
                    torch.autograd.grad(op.attention(q, k, v), (q, k, v), g)
                runs = [("bstrain " + name, ours, live * bs * bs)]
                if name == "causal":
                    def sdpa():
                        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
                        torch.autograd.grad(out, (qh, kh, vh), gh)
                    runs.append(("SDPA causal", sdpa, S * (S + 1) // 2))     # flash skips the masked half
                for who, fn, pairs in runs:
                    for kern, ms in sorted(kernel_ms(fn, smoke).items(), key=lambda kv: -kv[1]):
                        n = products(kern)
                        if not n and ms < 0.01:
                            continue
                        flops = 2.0 * B * H * pairs * D * n
                        rows.append(dict(run=who, S=S, D=D, block=bs, kernel=kern[:60], ms=round(ms, 3),
                                         products=n, tflops=round(flops / ms / 1e9, 1) if n else None))
                        print(rows[-1], flush=True)
    return rows


def report(rows: list[dict], extra: dict, out: str) -> None:
    lines = [f"# Attention kernels, one by one: {extra['device']}, {extra['date']}", "",
             f"torch {extra['torch']}; scripts/profile/profile_attention.py; B={extra['B']}, H={extra['H']}, bf16; one "
             "forward+backward under torch.profiler (mean of 5). products: matrix products per live tile pair; "
             "TFLOP/s: those products on the live blocks (SDPA causal: on the lower triangle).", "",
             "| run | S | D | block | kernel | ms | products | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['S']} | {r['D']} | {r['block']} | `{r['kernel']}` | {r['ms']} | "
                     f"{r['products'] or '-'} | {r['tflops'] if r['tflops'] is not None else '-'} |")
    write_report(out, "attention_profile", lines, {"rows": rows, **extra})


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--seq", type=ints, default=[8192])
    ap.add_argument("--dims", type=ints, default=[64, 128])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.seq, args.dims, args.batch, args.heads = [512], [16], 1, 2
    os.makedirs(args.out, exist_ok=True)
    extra = {**environment(args.cpu_smoke), "B": args.batch, "H": args.heads}
    report(measure(args), extra, args.out)


if __name__ == "__main__":
    main()
