"""The kernels behind issue 22's conv and small-block matmul figures, one launch each, for ncu.

    ncu --clock-control none --kernel-name regex:'_conv|_bsmm|conv|xmma|gemm' --section SpeedOfLight \\
        python3 scripts/profile/profile_conv.py

Runs, after one warm-up call each (so that the profiled launch is not the compiling one): the
block-sparse conv kernels (forward, dX, dW; N=128, C=K=256, 32x32, 3x3, bf16, channels-last) at
blocks of 64 with 25% live and blocks of 32 with ~10% live, the dense cuDNN forward of that
layer, and the bsmm forward at blocks of 32 (M=8192, 4096 -> 4096, 20% live, random layout).
Prints one line per call, in launch order, so that ncu's report can be matched to it.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as layouts  # noqa: E402
from bstrain.kernels import conv as KC  # noqa: E402
from bstrain.kernels import matmul as KM  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402
from bstrain.nn import BlockSparseConv2d  # noqa: E402


def twice(name, fn):
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print("profiled:", name, flush=True)


def main() -> None:
    dev = torch.device("cuda")
    N, C, S = 128, 256, 32
    x = torch.randn(N, C, S, S, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    dense_w = torch.randn(C, C, 3, 3, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    twice("dense conv fwd", lambda: F.conv2d(x, dense_w, padding=1))
    for bs, density in ((64, 0.25), (32, 0.1)):
        conv = BlockSparseConv2d(C, C, 3, padding=1, block_size=bs, density=density, seed=0, backend="triton",
                                 bias=False).to(device=dev, dtype=torch.bfloat16)
        luts = conv._layout_tables().on(dev).luts
        wt = conv.weight.detach().permute(0, 3, 4, 2, 1).contiguous()
        twice(f"conv fwd bs{bs} {conv.density:.3f}", lambda: KC.conv_forward(x, wt, luts, C, S, S, (1, 1), (1, 1), (1, 1)))
        twice(f"conv dx bs{bs}", lambda: KC.conv_dx(dy, wt, luts, C, S, S, (1, 1), (1, 1), (1, 1), x))
        twice(f"conv dw bs{bs}", lambda: KC.conv_dw(x, dy, luts, 3, 3, (1, 1), (1, 1), (1, 1)))
    H, M, bs = 4096, 8192, 32
    a = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    mluts = make_luts(layouts.random((H // bs, H // bs), 0.2, seed=0), bs, dev)
    w = torch.randn(mluts.nnz, bs, bs, device=dev, dtype=torch.bfloat16) / bs**0.5
    twice("bsmm fwd bs32 0.2", lambda: KM.bsmm_forward(a, w, mluts))
    dw = torch.randn(H, H, device=dev, dtype=torch.bfloat16)
    twice("dense mm 8192x4096x4096", lambda: a @ dw)


if __name__ == "__main__":
    main()
