"""Sweep the attention kernels' tile shapes on the GPU, one kernel at a time (issue 11).

    PYTHONPATH=$PWD python scripts/tune/tune_attention.py [--out DIR] [--seq 8192] [--dims 64,128]
                                                     [--layouts causal,strided] [--budget-s 240]

For each head dim, each kernel (fwd, dq, dkdv) and each candidate (BO, BI, warps, stages, TMA, warp specialisation), the
median time (triton.testing.do_bench) on each layout (B=4, H=16, bf16, 128-blocks), with the
compiled kernel's registers and spills. The best candidate per (kernel, head dim) minimises the
summed time over the layouts. Writes tune_attention.json ({"best": {...}, "rows": [...]}), which
bench_attention.py --tiles reads, and prints a table; dense SDPA causal is timed for scale.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as L  # noqa: E402
from bstrain.kernels import attention as K  # noqa: E402
from bstrain.kernels import tiles  # noqa: E402
from bstrain.ops.transformer import BlocksparseTransformer  # noqa: E402

CANDIDATES = {      # (BO, BI, warps, stages[, tma]): bstrain.kernels.tiles.Tile(block_m, block_n, ...)
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 128, 8, 3, True), (128, 128, 8, 2)],
    "dq": [(64, 64, 4, 3), (64, 64, 4, 3, True), (64, 64, 4, 4, True), (128, 64, 8, 3, True), (64, 32, 4, 3, True)],
    "dkdv": [(64, 32, 4, 3), (64, 64, 4, 3, True), (128, 64, 8, 2, True), (64, 32, 4, 3, True), (128, 64, 8, 3, True)],
}
MASKS = {"causal": lambda w: L.causal_mask, "local": lambda w: L.local_mask(4 * w),
         "strided": lambda w: L.strided_mask(w), "fixed": lambda w: L.fixed_mask(w, summary=w // 8)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dims", type=ints, default=[64, 128])
    ap.add_argument("--layouts", default="causal,strided")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this long")
    ap.add_argument("--kernels", default="fwd,dq,dkdv", help="the kernels to sweep")
    args = ap.parse_args()
    import triton
    t_start = time.time()
    B, H, S, bs, dt = 4, 16, args.seq, 128, torch.bfloat16
    w = max(128, S // 32)
    rows, best = [], {}
    for D in args.dims:
        q, k, v, do = (torch.randn(B, S, H * D, device="cuda", dtype=dt) for _ in range(4))
        qh, kh, vh = (t.view(B, S, H, D).transpose(1, 2).contiguous() for t in (q, k, v))
        sdpa = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
                                       return_mode="median")
        print(f"D={D}: SDPA causal fwd {sdpa:.3f} ms", flush=True)
        ops = {}
        for name in args.layouts.split(","):
            lay, cb = L.attention_layout(MASKS[name](w), S, S, bs)
            ops[name] = BlocksparseTransformer(lay, bs, heads=H, mask_callback=cb, backend="triton")
        scale = D ** -0.5
        state = {}
        for name, op in ops.items():
            luts = op.luts(q.device)
            o, lse = K.attention_forward(q, k, v, luts, scale)
            delta = torch.empty_like(lse)
            K.launch("dq", luts, (q, k, v, o, do, lse, delta, torch.empty_like(q)), None,
                     (scale * K.LOG2E, 0.0, scale))
            state[name] = (luts, o, lse, delta)
        for kernel, cands in ((n, CANDIDATES[n]) for n in args.kernels.split(",")):
            totals = {}
            for cand in cands:
                if time.time() - t_start > args.budget_s:
                    break
                tiles.override("attention", (kernel, bs, 2, D), tiles.Tile(*cand))
                row = dict(kernel=kernel, D=D, tiles=list(cand))
                try:
                    for name, (luts, o, lse, delta) in state.items():
                        if kernel == "fwd":
                            ts, sc = (q, k, v, torch.empty_like(q), torch.empty_like(lse)), (scale * K.LOG2E, 0.0)
                        elif kernel == "dq":
                            ts = (q, k, v, o, do, lse, torch.empty_like(delta), torch.empty_like(q))
                            sc = (scale * K.LOG2E, 0.0, scale)
                        else:
                            ts = (q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v))
                            sc = (scale * K.LOG2E, 0.0, scale)
                        K.launch(kernel, luts, ts, None, sc)             # a new override: a new plan
                        row[name] = round(triton.testing.do_bench(
                            lambda: K.launch(kernel, luts, ts, None, sc), warmup=10, rep=60,
                            return_mode="median"), 4)
                    totals[cand] = sum(row[n] for n in state)
                except Exception as exc:                                # out of resources, say
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
                print(row, flush=True)
            tiles.override("attention", (kernel, bs, 2, D), None)
            if totals:
                pick = min(totals, key=totals.get)
                best[f"{kernel},{D}"] = list(pick)
                print(f"best {kernel} D={D}: {pick} ({totals[pick]:.3f} ms summed)", flush=True)
        state.clear()
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_attention.json"), "w") as f:
        json.dump({"best": best, "rows": rows, "seq": S, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__}, f, indent=1)
    print("| kernel | D | best (BO, BI, warps, stages, tma, ws) |\n|---|---|---|")
    for key, v in best.items():
        kern, D = key.split(",")
        print(f"| {kern} | {D} | {tuple(v)} |")


def apply(path: str) -> None:
    """Override the attention tiles (bstrain.kernels.tiles.ATTENTION) with a tune_attention.json's
    best (bf16/fp16, 128-blocks)."""
    with open(path) as f:
        best = json.load(f)["best"]
    for key, v in best.items():
        kern, D = key.split(",")
        for itemsize in (2,):
            tiles.override("attention", (kern, 128, itemsize, int(D)), tiles.Tile(*v))


if __name__ == "__main__":
    main()
