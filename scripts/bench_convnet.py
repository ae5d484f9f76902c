"""Sparse against dense ResNets on the embedded image set (issue 12), through the trainer.

    PYTHONPATH=$PWD python scripts/bench_convnet.py [--out benchmarks] [--steps 300] [--seeds 0,1]

Three models on the synthetic gratings at 30 classes (data.synthetic_classes=30, 3000 images,
no download), each trained for the same number of steps with the convnet_tiny settings:
  dense          widths 32,64, density 1 (nn.Conv2d)
  sparse-equal   widths 64,128 at density 0.25: about the dense model's parameters
  sparse-half    widths 64,128 at density 0.125: about half of them
Writes convnet.md and convnet.json: parameters, validation accuracy, training seconds
(on whatever machine runs it; the committed table says which).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = ["config=convnet_tiny", "data.synthetic_classes=30", "model.classes=30", "data.synthetic_size=3000",
          "trainer.progress=false", "trainer.ckpt_every=0", "trainer.log_every=50"]
MODELS = {"dense": ["model.widths='32,64'", "model.density=1"],
          "sparse-equal": ["model.widths='64,128'", "model.density=0.25"],
          "sparse-half": ["model.widths='64,128'", "model.density=0.125"]}


def main() -> None:
    from bench_lstm import build, config

    from bstrain.train.trainer import train
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--runs", default="/tmp/bstrain-convnet-runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    args = ap.parse_args()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, over in MODELS.items():
            run = f"{args.runs}/{name}-{seed}"
            cfg = config(*COMMON, *over, f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}",
                         f"trainer.seed={seed}", f"trainer.run_dir={run}")
            params = sum(p.numel() for p in build(cfg).parameters())
            t = time.perf_counter()
            res = train(cfg)
            secs = time.perf_counter() - t
            rows.append(dict(model=name, seed=seed, params=params, steps=res["steps"], seconds=round(secs, 1),
                             valid_acc=round(res["valid"]["acc"], 4), overrides=over))
            print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    lines = [f"# Sparse vs dense ResNet on the embedded image set ({datetime.date.today()})", "",
             f"scripts/bench_convnet.py on {machine}. Synthetic gratings, 30 classes, 2400/300/300 images "
             f"(train/valid/test), {args.steps} steps of batch 64 with the `convnet_tiny` settings "
             f"(`{' '.join(COMMON)}`); accuracy on the 300 validation images.", "",
             "| model | widths | density | parameters | seed | valid acc | train s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["overrides"][0].split("=")[1].strip("'")
        d = r["overrides"][1].split("=")[1]
        lines.append(f"| {r['model']} | {w} | {d} | {r['params']:,} | {r['seed']} | {r['valid_acc']:.3f} | "
                     f"{r['seconds']:.0f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convnet.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "convnet.json"), "w") as f:
        json.dump(dict(rows=rows, machine=machine, date=str(datetime.date.today())), f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
