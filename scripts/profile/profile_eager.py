"""Where an eager block-sparse call spends its host time: cProfile of op(x, w) and of a
BlockSparseLinear forward + backward, and the forward's GPU time on the TMA and pointer paths.

    PYTHONPATH=$PWD python scripts/profile/profile_eager.py [--m 64] [--block 32] [--density 0.1]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.kernels import matmul as K  # noqa: E402
from bstrain.kernels import tiles  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402
from bstrain.nn import BlockSparseLinear  # noqa: E402
from scripts.bench.bench_eager import fwd_bwd, gpu_us, per_call_us  # noqa: E402


def profile_lstm(args) -> None:
    """cProfile of 5 eager trainer steps of the mLSTM at hidden 8192 (batch 64 x 32, block 32)."""
    from scripts.bench.bench_lstm import build, config
    from bstrain.nn import set_grad_group
    from bstrain.train.step import Forward, train_step
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    dev = torch.device("cuda")
    cfg = config("model.hidden=8192", f"model.density={args.density}", "model.layout=random", "model.embed=256",
                 "model.depth=2", "model.block_size=32")
    model = build(cfg).to(dev)
    set_grad_group(model, 8)
    opt = make_optimizer(model, cfg.optim, dev, capturable=False)
    forward, loss_fn, params = Forward(model, torch.bfloat16, dev), ByteLM().loss, list(model.parameters())
    x = torch.randint(0, 256, (64, 32), device=dev)

    def step():
        train_step(forward, loss_fn, x, x, None, opt, params, cfg.optim.grad_clip)
    print(f"mLSTM eager step: {per_call_us(step, dev, calls=10, repeats=3) / 1e3:.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--lstm", action="store_true", help="profile the sparse mLSTM's eager trainer step instead")
    args = ap.parse_args()
    if args.lstm:
        return profile_lstm(args)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = BlockSparseLinear(4096, 4096, bias=False, block_size=args.block, density=args.density, seed=0, device=dev)
    op, w = layer.op, layer.weight.detach().to(dt)
    x = torch.randn(args.m, 4096, device=dev, dtype=dt)
    xg, grad = torch.randn(args.m, 4096, device=dev, requires_grad=True), torch.randn(args.m, 4096, device=dev, dtype=dt)
    key = ("ds_small_m", args.block, 2, True)                            # bf16 on CUDA, M <= SMALL_M
    for tma, split in ((True, None), (False, None), (False, 1)):
        with tiles.overridden("matmul", key, tiles.MATMUL(*key).replace(tma=tma)):
            luts = make_luts(op.layout, op.block_size, dev)
            fn = lambda: K.run_forward(x, w, luts, 1, split=split)           # noqa: E731
            print(f"forward tma={tma} split={split}: {per_call_us(fn, dev):.1f} us per call, GPU {gpu_us(fn):.1f} us",
                  flush=True)
    step = fwd_bwd(layer, xg, grad, dt, dev)
    for name, fn, n in (("op(x, w)", lambda: op(x, w), 2000), ("BlockSparseLinear f+b", step, 500)):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}, {n} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
