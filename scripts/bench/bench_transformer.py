"""Sparse against dense causal transformer LMs at an 8k context on the GPU (issue 11), in sub-commands:

    PYTHONPATH=$PWD python scripts/bench/bench_transformer.py curve --which sparse|dense --seconds 150 --out DIR
        Trains one model for a fixed wall-clock budget through the trainer on this machine's
        site-packages *.py sources (whole files held out for valid/test); writes
        transformer_curve_<which>.json. Run the two on two GPUs at once (CUDA_VISIBLE_DEVICES).
        sparse: block-sparse attention (strided and fixed layers, the fused kernels); dense: the same
        model with F.scaled_dot_product_attention(is_causal=True) in every layer.
    PYTHONPATH=$PWD python scripts/bench/bench_transformer.py scaling --nproc 1|2 --out DIR
        tokens/s of the sparse model, one process or torchrun DDP over two GPUs:
        transformer_scaling_<nproc>.json.
    python scripts/bench/bench_transformer.py report --out DIR
        transformer.md (and transformer.png with matplotlib) from the JSON files in DIR.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import (build, config, equal_time_curve, site_packages_glob,  # noqa: E402
                                      torchrun_tokens_per_s)

COMMON = ["config=transformer_enwik8", "data.name=bytes", "model.d_model=512", "model.n_layer=8", "model.n_head=8",
          "model.context=8192", "model.positions=rotary", "data.seq_len=8192", "data.batch_size=4",
          "trainer.precision=bf16", "trainer.progress=false", "trainer.ckpt_every=0", "trainer.log_every=20",
          "trainer.max_steps=1000000", "optim.lr=1e-3", "optim.warmup_steps=100", "optim.schedule=constant",
          "optim.weight_decay=0.1"]
# the models compared: "sparse" and "dense" are issue 11's pair (plain glue then); the others issue 21's
WHICH = {
    "dense": ["model.attention=dense"],
    "sparse": ["model.attention='strided,fixed'", "model.block_size=128", "model.window=256", "model.summary=32"],
    "fixed1024": ["model.attention=fixed", "model.block_size=64", "model.window=1024", "model.summary=64"],
    "local_fixed1024": ["model.attention='local,fixed'", "model.block_size=64", "model.window=1024",
                        "model.summary=64"],
    "local_fixed512": ["model.attention=local+fixed", "model.block_size=64", "model.window=512", "model.summary=64"],
    "strided_fixed128": ["model.attention='strided,fixed'", "model.block_size=64", "model.window=128",
                         "model.summary=16"],
}


def cmd_curve(args) -> None:
    corpus = args.corpus or site_packages_glob()
    over = [*COMMON, *WHICH[args.which], f"data.path={corpus}", f"trainer.time_limit_s={args.seconds}",
            f"trainer.eval_every={args.eval_every}", f"trainer.eval_batches={args.eval_batches}",
            f"trainer.run_dir={args.runs}/{args.which}", *args.extra]
    cfg = config(*over)

    def tokens_per_s(_res):
        log = (Path(args.runs) / args.which / "train.log").read_text()
        rates = [float(v) for v in re.findall(r" step \d+ loss .* tokens/s (\d+)", log)]
        steady = rates[2:] or rates
        return sorted(steady)[len(steady) // 2] if steady else None
    out = equal_time_curve(cfg, args.which, args.seconds, os.path.join(args.out, f"transformer_curve_{args.which}.json"),
                           params=sum(p.numel() for p in build(cfg).parameters()), tokens_per_s=tokens_per_s,
                           corpus=corpus, overrides=over)
    print(f"{args.which}: {out['tokens_per_s']} tokens/s", flush=True)


def cmd_scaling(args) -> None:
    tps, rates = torchrun_tokens_per_s(Path(args.runs) / f"scaling_{args.nproc}", args.nproc,
                                       [*COMMON, *WHICH["sparse"], f"data.path={args.corpus or site_packages_glob()}",
                                        "trainer.eval_every=0", "trainer.log_every=5", "data.max_bytes=67108864",
                                        f"trainer.max_steps={args.steps}"])
    steady = rates[2:]
    out = dict(nproc=args.nproc, tokens_per_s=tps, windows=rates, steps=args.steps, device=torch.cuda.get_device_name())
    with open(os.path.join(args.out, f"transformer_scaling_{args.nproc}.json"), "w") as f:
        json.dump(out, f)
    print(f"{args.nproc} GPU(s): {tps:.0f} tokens/s (median of {len(steady)} windows of 5 steps)", flush=True)


def cmd_report(args) -> None:
    out = Path(args.out)
    src = Path(args.curves or args.out)
    names = args.models.split(",")
    curves = {w: json.loads((src / f"transformer_curve_{w}.json").read_text())
              for w in names if (src / f"transformer_curve_{w}.json").exists()}
    scaling = {n: json.loads((out / f"transformer_scaling_{n}.json").read_text())
               for n in (1, 2) if (out / f"transformer_scaling_{n}.json").exists()} if args.scaling else {}
    device = next((c["device"] for c in curves.values()), "NVIDIA H200")
    lines = [f"# {args.title}: {device}, {datetime.date.today()}", "",
             "scripts/bench/bench_transformer.py. Shared settings: `" + " ".join(COMMON) + "`. Text: every `*.py` under "
             f"the GPU machine's site-packages, whole files held out for validation. {args.how}", "",
             "| model | overrides | parameters | steps | tokens/s (median window) | vs dense | valid bits/byte "
             "| vs dense |", "|---|---|---|---|---|---|---|---|"]
    d = curves.get("dense")
    for w, c in curves.items():
        speed = f"{c['tokens_per_s'] / d['tokens_per_s']:.2f}x" if d else "-"
        diff = f"{c['valid_bpb'] - d['valid_bpb']:+.4f}" if d else "-"
        lines.append(f"| {w} | `{' '.join(WHICH[w])}` | {c['params']:,} | {c['steps']} | {c['tokens_per_s']:,.0f} | "
                     f"{speed} | {c['valid_bpb']:.4f} | {diff} |")
    if d:
        dv = d["valid_history"]
        for w, c in curves.items():
            common = sorted(set(st for st, _, _ in c["valid_history"]) & set(st for st, _, _ in dv))
            if w != "dense" and common:
                k = common[-1]
                lines.append(f"\nAt equal steps ({k}): {w} {next(b for st, _, b in c['valid_history'] if st == k):.4f}, "
                             f"dense {next(b for st, _, b in dv if st == k):.4f}.")
    lines.append("")
    if len(scaling) == 2:
        eff = scaling[2]["tokens_per_s"] / (2 * scaling[1]["tokens_per_s"])
        lines += ["## Two GPUs (DDP, torchrun)", "",
                  f"The sparse model, batch 4 x 8192 per GPU: {scaling[1]['tokens_per_s']:,.0f} tokens/s on one GPU, "
                  f"{scaling[2]['tokens_per_s']:,.0f} on two: efficiency **{eff:.2f}**. Medians of 5-step windows "
                  "after the first two.", ""]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for w, c in curves.items():
            vs, vt, vb = zip(*c["valid_history"])
            axes[0].plot(vs, vb, marker="o", ms=3, label=f"{w}: {c['valid_bpb']:.3f}")
            axes[1].plot(vt, vb, marker="o", ms=3, label=f"{w}: {c['valid_bpb']:.3f}")
        axes[0].set(xlabel="step", ylabel="valid bits/byte")
        axes[1].set(xlabel="seconds", ylabel="valid bits/byte")
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
            ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
        fig.tight_layout()
        fig.savefig(out / f"{args.name}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("curve", "scaling", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="benchmarks")
        p.add_argument("--runs", default="/tmp/bstrain-transformer-runs")
        p.add_argument("--corpus", default=None, help="data.path (default: site-packages/**/*.py)")
    sub.choices["curve"].add_argument("--which", choices=sorted(WHICH), required=True)
    sub.choices["curve"].add_argument("--seconds", type=float, default=150)
    sub.choices["curve"].add_argument("--eval-every", type=int, default=100)
    sub.choices["curve"].add_argument("--eval-batches", type=int, default=16)
    sub.choices["curve"].add_argument("--extra", nargs="*", default=[], help="more overrides (a CPU smoke run)")
    sub.choices["report"].add_argument("--models", default="sparse,dense", help="curves to report, by WHICH name")
    sub.choices["report"].add_argument("--name", default="transformer", help="writes NAME.md and NAME.png")
    sub.choices["report"].add_argument("--curves", default=None, help="where the curve JSON files are (default --out)")
    sub.choices["report"].add_argument("--title", default="Sparse vs dense transformer LM at an 8k context")
    sub.choices["report"].add_argument("--how", default="Each run on its own H200, at the same time, for the same "
                                       "wall-clock budget.")
    sub.choices["report"].add_argument("--scaling", action="store_true", help="add the DDP scaling section")
    sub.choices["scaling"].add_argument("--nproc", type=int, default=1)
    sub.choices["scaling"].add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    {"curve": cmd_curve, "scaling": cmd_scaling, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
