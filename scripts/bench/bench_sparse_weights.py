"""Block-sparse weights against their dense twins at equal GPU time (issue 40), in sub-commands:

    PYTHONPATH=$PWD python scripts/bench/bench_sparse_weights.py curve --family F --which W --seconds 600 --out DIR
        Trains one model of a family's pair for a fixed wall-clock budget through the trainer and
        writes sparse_weights_<F>_<W>.json: the validation metric against wall seconds and steps,
        throughput (tokens/s or images/s), parameters, device, date and the overrides. Text is every
        *.py under this machine's site-packages, whole files held out for validation (--corpus to
        change it); images are data.path=--images (default null: the synthetic set).
    python scripts/bench/bench_sparse_weights.py report --out DIR
        sparse_weights.md (one table per family, each model against its dense twin) and
        sparse_weights_<F>.png (validation metric against wall seconds) from the JSON files in DIR.
    python scripts/bench/bench_sparse_weights.py list
        The families and their models, with the overrides of each.

Families (each `dense` is the shipped dense twin; the others are the sparse candidates, chosen
with `python -m bstrain advise`):
    transformer: the FFN. dense = transformer_enwik8 (ffn_mult 4, dense); wide = transformer_wide
        (ffn_mult 8 at density 0.25, blocks of 128) and variants of width, block size and RigL.
    lstm: the seed's claim. dense = hidden 1024; wide = lstm_wide (hidden 2048 at density 0.25,
        blocks of 128: the same recurrent parameters) and a 4x-wide variant.
    convnet: the sparse ResNet against its dense twin (model.density=1) on the same images.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import build, config, site_packages_glob  # noqa: E402

_LM = ["trainer.precision=bf16", "trainer.progress=false", "trainer.ckpt_every=0", "trainer.log_every=50",
       "trainer.max_steps=1000000", "optim.schedule=constant", "data.name=bytes"]
FAMILIES = {
    "transformer": {
        "common": [*_LM, "trainer.eval_every=200", "trainer.eval_batches=16"],
        "models": {
            "dense": ["config=transformer_enwik8"],
            "wide": ["config=transformer_wide"],
            "wide_b64": ["config=transformer_wide", "model.ffn_block_size=64"],
            "wide12": ["config=transformer_wide", "model.ffn_mult=12"],
            "wide_rigl": ["config=transformer_wide", "sparsity=rigl", "sparsity.balanced=false"],
        },
    },
    "lstm": {
        "common": [*_LM, "data.seq_len=64", "data.batch_size=128", "model.embed=128", "model.depth=2",
                   "trainer.eval_every=1000", "trainer.eval_batches=200", "optim.warmup_steps=200"],
        "models": {
            "dense": ["config=lstm_enwik8", "model.hidden=1024", "model.sparse=false"],
            "wide": ["config=lstm_wide"],
            "wide4": ["config=lstm_wide", "model.hidden=4096", "model.density=0.0625"],
            "wide_rigl": ["config=lstm_wide", "sparsity=rigl", "sparsity.balanced=true"],
        },
    },
    "convnet": {
        "common": ["trainer.precision=bf16", "trainer.progress=false", "trainer.ckpt_every=0",
                   "trainer.log_every=50", "trainer.max_steps=1000000", "trainer.eval_every=500",
                   "trainer.eval_batches=0"],
        "models": {
            "dense": ["config=convnet_cifar10", "model.density=1"],
            "sparse": ["config=convnet_cifar10"],
            "sparse125": ["config=convnet_cifar10", "model.density=0.125"],
        },
    },
}


def overrides(family: str, which: str, data: str, seconds: float, runs: str, extra: list[str]) -> list[str]:
    """Every override of one run: the model's (its config= first), the family's, the data, the budget."""
    fam = FAMILIES[family]
    model = fam["models"][which]
    return [model[0], *fam["common"], *model[1:], f"data.path={data}", f"trainer.time_limit_s={seconds}",
            f"trainer.run_dir={runs}/{family}_{which}", *extra]


def cmd_curve(args) -> None:
    from bstrain.train.trainer import train
    data = args.images if args.family == "convnet" else (args.corpus or site_packages_glob())
    over = overrides(args.family, args.which, data, args.seconds, args.runs, args.extra)
    cfg = config(*over)
    params = sum(p.numel() for p in build(cfg).parameters())
    res = train(cfg)
    rates = [r for r in res["throughput"][2:] or res["throughput"]]
    out = dict(family=args.family, which=args.which, seconds=args.seconds, steps=res["steps"], params=params,
               metric=next(k for k in res["valid"] if k != "loss") if len(res["valid"]) > 1 else "loss",
               valid=res["valid"], valid_history=res["valid_history"], history=res["history"],
               throughput=sorted(rates)[len(rates) // 2] if rates else None, unit=res["unit"], data=res["data"],
               step_mode=res["step_mode"], overrides=over, date=str(datetime.date.today()),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               command="python scripts/bench/bench_sparse_weights.py " + " ".join(sys.argv[1:]))
    path = Path(args.out) / f"sparse_weights_{args.family}_{args.which}.json"
    path.write_text(json.dumps(out))
    print(f"{args.family}/{args.which}: {res['steps']} steps, valid {out['metric']} "
          f"{out['valid'].get(out['metric'], float('nan')):.4f}, {out['throughput']} {out['unit']}", flush=True)


def _final(c: dict) -> float:
    return c["valid"].get(c["metric"], float("nan"))


def _table(family: str, curves: dict) -> list[str]:
    d = curves.get("dense")
    lines = [f"## {family}", "", f"Shared overrides: `{' '.join(FAMILIES[family]['common'])}`.", "",
             "| model | overrides | parameters | steps | throughput | vs dense | valid metric at the end | vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    for w, c in curves.items():
        speed = f"{c['throughput'] / d['throughput']:.2f}x" if d and c["throughput"] and d["throughput"] else "-"
        diff = f"{_final(c) - _final(d):+.4f}" if d else "-"
        lines.append(f"| {w} | `{' '.join(FAMILIES[family]['models'][w])}` | {c['params']:,} | {c['steps']} | "
                     f"{c['throughput'] or 0:,.0f} {c['unit']}/s | {speed} | {c['metric']} {_final(c):.4f} | {diff} |")
    return lines + [""]


def cmd_report(args) -> None:
    out = Path(args.out)
    lines = ["# Block-sparse weights against dense at equal GPU time (issue 40)", "",
             "scripts/bench/bench_sparse_weights.py: each model trains for the same wall-clock budget on one GPU "
             "(bf16, the default CUDA-graphed step); validation on whole held-out files. Plots: "
             "validation metric against wall seconds.", ""]
    for family in FAMILIES:
        curves = {w: json.loads((out / f"sparse_weights_{family}_{w}.json").read_text())
                  for w in FAMILIES[family]["models"] if (out / f"sparse_weights_{family}_{w}.json").exists()}
        if not curves:
            lines += [f"## {family}", "", "Not run yet.", ""]
            continue
        c0 = next(iter(curves.values()))
        lines += _table(family, curves) + [f"Device {c0['device']}, {c0['date']}, {c0['seconds']:.0f} s each; "
                                           f"data: {c0['data']}.", ""]
        _plot(family, curves, out / f"sparse_weights_{family}.png")
    (out / "sparse_weights.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(family: str, curves: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for w, c in curves.items():
        if c["valid_history"]:
            _, seconds, metric = zip(*c["valid_history"])
            ax.plot(seconds, metric, marker="o", ms=3, label=f"{w}: {_final(c):.3f}")
    ax.set(xlabel="wall seconds", ylabel=f"valid {next(iter(curves.values()))['metric']}", title=family)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    curve = sub.add_parser("curve")
    curve.add_argument("--family", choices=sorted(FAMILIES), required=True)
    curve.add_argument("--which", required=True)
    curve.add_argument("--seconds", type=float, default=600)
    curve.add_argument("--out", default="benchmarks")
    curve.add_argument("--runs", default="/tmp/bstrain-sparse-weights-runs")
    curve.add_argument("--corpus", default=None, help="data.path of the LMs (default: site-packages/**/*.py)")
    curve.add_argument("--images", default="null", help="data.path of the convnet (a CIFAR folder, mnist5k; null: the synthetic set)")
    curve.add_argument("--extra", nargs="*", default=[], help="more overrides (a CPU smoke run)")
    sub.add_parser("report").add_argument("--out", default="benchmarks")
    sub.add_parser("list")
    args = ap.parse_args()
    if args.cmd == "curve" and args.which not in FAMILIES[args.family]["models"]:
        ap.error(f"--which: expected one of {', '.join(FAMILIES[args.family]['models'])} for {args.family}")
    if args.cmd == "list":
        for family, fam in FAMILIES.items():
            for w, over in fam["models"].items():
                print(f"{family:12} {w:10} {' '.join(over)}")
        return
    {"curve": cmd_curve, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
