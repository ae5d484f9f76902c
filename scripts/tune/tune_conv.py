"""Sweep the block-sparse convolution kernels' (BLOCK_M, warps, stages) on the GPU (issue 12).

    PYTHONPATH=$PWD python scripts/tune/tune_conv.py [--out DIR] [--block-sizes 32,64] [--budget-s 200]

At the benchmark's layer (N=128, C=K=256, 32x32, 3x3, bf16, channels-last, 25% live, balanced
random layout), each kernel (fwd, dx, dw; the TMA kernels "*_tma" of stride-1 channels-last
convolutions, and/or the pointer-load kernels) alone, per candidate: the median time
(triton.testing.do_bench), with the compiled kernel's registers and spills. Writes
tune_conv.json ({"best": {"kernel,bs": [BLOCK_M, warps, stages]}, "rows": [...]}) and prints the
best per kernel; dense cuDNN fwd time for scale.
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
from bstrain.kernels import conv as K  # noqa: E402
from bstrain.kernels import tiles  # noqa: E402
from bstrain.nn import BlockSparseConv2d  # noqa: E402

TMA_CANDIDATES = [(64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 8, 2), (256, 8, 3)]
CANDIDATES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3), (64, 8, 3),
              (32, 4, 3), (64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 8, 1)]


def main() -> None:
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--block-sizes", default="32,64")
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--paths", default="tma", help="tma (stride-1 TMA kernels), pointer, or both: tma,pointer")
    args = ap.parse_args()
    t0 = time.time()
    N, C, S = 128, 256, 32
    x = torch.randn(N, C, S, S, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    dense_w = torch.randn(C, C, 3, 3, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    dense = triton.testing.do_bench(lambda: F.conv2d(x, dense_w, padding=1), return_mode="median")
    print(f"dense cuDNN fwd {dense:.4f} ms", flush=True)
    rows, best = [], {}
    for bs in [int(v) for v in args.block_sizes.split(",")]:
        conv = BlockSparseConv2d(C, C, 3, padding=1, block_size=bs, density=args.density, seed=0, backend="triton",
                                 bias=False).to(device="cuda", dtype=torch.bfloat16)
        luts = conv._layout_tables().on(x.device).luts
        wt = conv.weight.detach().permute(0, 3, 4, 2, 1).contiguous()
        dy = torch.randn_like(x)
        calls = {"fwd": lambda: K.conv_forward(x, wt, luts, C, S, S, (1, 1), (1, 1), (1, 1)),
                 "dx": lambda: K.conv_dx(dy, wt, luts, C, S, S, (1, 1), (1, 1), (1, 1), x),
                 "dw": lambda: K.conv_dw(x, dy, luts, 3, 3, (1, 1), (1, 1), (1, 1))}
        for path, (kernel, call) in [(p, kc) for p in args.paths.split(",") for kc in calls.items()]:
            K.USE_TMA = path == "tma"
            kernel = f"{kernel}_tma" if path == "tma" else kernel
            times = {}
            for cand in TMA_CANDIDATES if path == "tma" else CANDIDATES:
                if time.time() - t0 > args.budget_s:
                    break
                tiles.override("conv", (kernel, bs, 2), conv_tile(cand))
                row = dict(kernel=kernel, bs=bs, config=list(cand))
                try:
                    call()
                    row["ms"] = round(triton.testing.do_bench(call, warmup=10, rep=80, return_mode="median"), 4)
                    row["ratio_vs_dense_x_live"] = round(row["ms"] / (dense * conv.density), 2)
                    times[cand] = row["ms"]
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
                print(row, flush=True)
            tiles.override("conv", (kernel, bs, 2), None)
            if times:
                pick = min(times, key=times.get)
                best[f"{kernel},{bs}"] = list(pick)
                print(f"best {kernel} bs={bs}: {pick} {times[pick]:.4f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_conv.json"), "w") as f:
        json.dump({"best": best, "rows": rows, "dense_fwd_ms": dense, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__}, f, indent=1)


def conv_tile(config) -> tiles.Tile:
    """A (BLOCK_M, warps, stages) of tune_conv.json as a tile of bstrain.kernels.tiles.CONV."""
    block_m, warps, stages = config
    return tiles.Tile(block_m, 0, warps, stages)


def apply(path: str) -> None:
    """Override the conv tiles (bstrain.kernels.tiles.CONV) with a tune_conv.json's best (16-bit)."""
    with open(path) as f:
        for key, v in json.load(f)["best"].items():
            kernel, bs = key.split(",")
            tiles.override("conv", (kernel, int(bs), 2), conv_tile(v))


if __name__ == "__main__":
    main()
