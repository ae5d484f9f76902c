"""Sparse LSTM results on the GPU (issue 4):

1. Step time of the sparse mLSTM at hidden 8192 and >= 90% sparsity against density x the dense
   step time (target: ratio <= 1.5).
2. A sparse and a dense mLSTM of equal parameter count trained on the same real text (the
   embedded default corpus) for the same number of steps: learning curves and validation bpb.

    PYTHONPATH=$PWD python scripts/bench_lstm.py [--out DIR] [--seconds S]
Writes lstm.md, lstm.csv and lstm.png to --out.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hydra import compose, initialize_config_module  # noqa: E402

from bstrain.configs.schema import register  # noqa: E402
from bstrain.models.lstm import build_model  # noqa: E402
from bstrain.train.trainer import make_optimizer, train  # noqa: E402


def config(*overrides):
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def recurrent_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(("w_hm", "deep", "w_mg")) and n.endswith("weight"))


def step_time(cfg, batch: int, seq: int, group: int, reps: int = 3) -> float:
    """Seconds per optimizer step (fwd + bwd + AdamW) in bf16 on random bytes."""
    torch.manual_seed(0)
    model = build_model(cfg.model).cuda()
    opt = make_optimizer(model, cfg.optim, torch.device("cuda"))
    x = torch.randint(0, 256, (batch, seq), device="cuda")
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(x, None, group_size=group)
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    del model, opt
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--seconds", type=float, default=90.0, help="training time of the sparse run")
    ap.add_argument("--runs", default="/tmp/bstrain-lstm-runs", help="run directories (checkpoints, logs)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = []
    # 1. step time at hidden 8192, ~5% density (95% sparse), block 32, against density x dense
    sparse = config("model.hidden=8192", "model.density=0.05", "model.layout=random", "model.embed=256")
    dense = config("model.hidden=8192", "model.sparse=false", "model.embed=256")
    ts, td = step_time(sparse, 64, 32, 8), step_time(dense, 64, 32, 1)
    probe = build_model(sparse.model)
    dens = recurrent_params(probe) / (6 * 8192 * 8192)
    del probe
    ratio = ts / (dens * td)
    lines.append(f"step time, hidden 8192, batch 64 x 32 steps, bf16: sparse {ts*1e3:.0f} ms at density "
                 f"{dens:.3f} (group 8), dense {td*1e3:.0f} ms; sparse / (density x dense) = {ratio:.2f} "
                 f"(target <= 1.5)")
    print(lines[-1], flush=True)
    # 2. equal parameters (7.2M each): sparse H=2048 at density 0.21 vs dense H=1024
    common = ["data.seq_len=64", "data.batch_size=32", "trainer.precision=bf16", "trainer.eval_every=0",
              "trainer.eval_batches=50", "trainer.progress=false", "trainer.ckpt_every=0", "optim.lr=2e-3",
              "model.embed=128", "trainer.log_every=50"]
    results = {}
    sp = config(*common, "model.hidden=2048", "model.density=0.22", "model.layout=barabasi_albert",
                "trainer.max_steps=100000", f"trainer.time_limit_s={args.seconds}",
                f"trainer.run_dir={args.runs}/sparse")
    results["sparse"] = train(sp)
    steps = results["sparse"]["steps"]
    dn = config(*common, "model.hidden=1024", "model.sparse=false", f"trainer.max_steps={steps}",
                f"trainer.run_dir={args.runs}/dense")
    results["dense"] = train(dn)
    for name, cfg in (("sparse", sp), ("dense", dn)):
        m = build_model(cfg.model)
        r = results[name]
        lines.append(f"{name}: hidden {cfg.model.hidden}, {recurrent_params(m):,} recurrent / {m.num_params():,} "
                     f"total parameters, {r['steps']} steps, valid {r['valid_bpb']:.4f} bits/byte")
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "lstm.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "step", "train_loss"])
        for name, r in results.items():
            w.writerows([name, s, l] for s, l in r["history"])
    with open(os.path.join(args.out, "lstm.md"), "w") as f:
        f.write(f"# sparse mLSTM: {torch.cuda.get_device_name()}, {datetime.date.today()}\n\n")
        f.write("\n".join(f"- {line}" for line in lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, r in results.items():
            s, l = zip(*r["history"])
            k = 20
            smooth = [sum(l[max(0, i - k):i + 1]) / len(l[max(0, i - k):i + 1]) for i in range(len(l))]
            ax.plot(s, [v / 0.6931 for v in smooth], label=f"{name} (valid {r['valid_bpb']:.3f} bpb)")
        ax.set_xlabel("step")
        ax.set_ylabel("train bits/byte (20-step mean)")
        ax.set_title("sparse (H=2048, density 0.21) vs dense (H=1024), equal parameters")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "lstm.png"), dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
