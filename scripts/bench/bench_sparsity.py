"""Dynamic block sparsity on the GPU (issue 23), in sub-commands:

    PYTHONPATH=$PWD python scripts/bench/bench_sparsity.py cost --out DIR [--steps 400]
        The update's share of training time: each model (lstm_enwik8; transformer_enwik8 with a 25%
        block-sparse FFN) trained through the trainer for --steps steps with sparsity=static and with
        sparsity=rigl (and set) at every=100; the share is 1 - (mean tokens/s with updates) / (static's),
        over the logged windows after the first. Writes sparsity_cost.json.
    PYTHONPATH=$PWD python scripts/bench/bench_sparsity.py curve --which NAME --seconds 600 --out DIR
        One model for a fixed wall-clock budget on this machine's site-packages *.py sources (whole
        files held out): lstm_dense, lstm_static, lstm_set, lstm_rigl (equal parameters, as
        bench_lstm.py's pair; lstm_rigl_balanced and lstm_rigl_mean: RigL balanced, and with
        sparsity.grown_moments=mean), ffn_sparse (transformer, 25% FFN blocks, RigL), ffn_dense (the
        dense FFN of equal parameters). Writes sparsity_curve_NAME.json.
    python scripts/bench/bench_sparsity.py report --out DIR
        sparsity.md (and sparsity.png with matplotlib) from the JSON files in DIR.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import (CURVE_COMMON, PAIR, build, config, equal_time_curve,  # noqa: E402
                                      site_packages_glob)

RUN = ["trainer.progress=false", "trainer.ckpt_every=0", "trainer.max_steps=1000000", "optim.lr=1e-3",
       "optim.warmup_steps=200", "optim.schedule=constant"]
FFN = ["config=transformer_enwik8", "data.name=bytes", "model.attention=dense", "trainer.precision=bf16",
       "model.ffn_block_size=64", "trainer.eval_every=500", "trainer.eval_batches=16", "trainer.log_every=50"]
SPARSE = ["sparsity.every=100", "sparsity.fraction=0.3", "sparsity.until=0.75"]
WHICH = {
    "lstm_dense": CURVE_COMMON + PAIR["dense"],
    "lstm_static": CURVE_COMMON + PAIR["sparse"],
    "lstm_set": CURVE_COMMON + PAIR["sparse"] + ["sparsity=set"] + SPARSE,
    "lstm_rigl": CURVE_COMMON + PAIR["sparse"] + ["sparsity=rigl"] + SPARSE,
    "lstm_rigl_balanced": CURVE_COMMON + PAIR["sparse"] + ["sparsity=rigl", "sparsity.balanced=true"] + SPARSE,
    "lstm_rigl_mean": CURVE_COMMON + PAIR["sparse"] + ["sparsity=rigl", "sparsity.grown_moments=mean"] + SPARSE,
    # 25% of a 4x FFN's blocks against a dense 1x FFN: equal FFN parameters
    "ffn_sparse": FFN + ["model.ffn_density=0.25", "sparsity=rigl"] + SPARSE,
    "ffn_dense": FFN + ["model.ffn_mult=1"],
}
COST = {"lstm": ["config=lstm_enwik8", "data.name=bytes", "trainer.eval_every=0", "trainer.log_every=50"],
        "ffn": FFN[:-3] + ["model.ffn_density=0.25", "trainer.eval_every=0", "trainer.log_every=50"]}


def _rates(run_dir: Path) -> list[float]:
    return [float(v) for v in re.findall(r" step \d+ loss .* tokens/s (\d+)", (run_dir / "train.log").read_text())]


# the policies the cost is measured for: balanced updates keep the captured step (tables rewritten
# in place); unbalanced ones capture it again after each update
POLICIES = {"static": ["sparsity=static"], "set": ["sparsity=set"], "rigl": ["sparsity=rigl"],
            "set_balanced": ["sparsity=set", "sparsity.balanced=true"],
            "rigl_balanced": ["sparsity=rigl", "sparsity.balanced=true"]}


def cmd_cost(args) -> None:
    from bstrain.train.trainer import train
    corpus = args.corpus or site_packages_glob()
    out = {}
    cost = Path(args.out) / "sparsity_cost.json"
    if cost.exists() and set(args.models.split(",")) != set(COST):     # keep the other model's earlier row
        out = {k: v for k, v in json.loads(cost.read_text()).items() if k in COST and k not in args.models.split(",")}
    for model in args.models.split(","):
        over, row = COST[model], {"steps": args.steps}
        for policy in args.policies.split(","):
            sparsity = POLICIES[policy]
            run = Path(args.runs) / f"cost_{model}_{policy}"
            shutil.rmtree(run, ignore_errors=True)
            cfg = config(*over, *RUN, f"data.path={corpus}", "data.max_bytes=67108864", *sparsity,
                         "sparsity.every=100", "sparsity.until=1.0", f"trainer.max_steps={args.steps}",
                         f"trainer.run_dir={run}")
            train(cfg)
            rates = _rates(run)[1:]
            log = (run / "train.log").read_text()
            updates = [dict(step=int(a), ms=float(c), in_place=b == "tables rewritten in place")
                       for a, b, c in re.findall(r"sparsity: step (\d+), .*?, (tables rewritten in place|new tables), "
                                                 r"(\d+) ms", log)]
            row[policy] = {"mean_tokens_per_s": statistics.fmean(rates), "windows": rates, "updates": updates}
            if policy != "static":
                row[policy]["share"] = 1 - row[policy]["mean_tokens_per_s"] / row["static"]["mean_tokens_per_s"]
            print(model, policy, round(row[policy]["mean_tokens_per_s"]),
                  f"{100 * row[policy].get('share', 0):.1f}%", updates, flush=True)
            out[model] = row
            out["device"] = torch.cuda.get_device_name()
            with open(os.path.join(args.out, "sparsity_cost.json"), "w") as f:      # what is done so far
                json.dump(out, f)


def cmd_curve(args) -> None:
    corpus = args.corpus or site_packages_glob()
    over = [*WHICH[args.which], *RUN, f"data.path={corpus}", f"trainer.time_limit_s={args.seconds}",
            f"data.max_bytes={args.max_bytes}", f"trainer.run_dir={args.runs}/{args.which}"]
    steps = args.max_steps
    if args.max_steps_from:          # the static run's steps in the same time, and a margin
        done = json.loads((Path(args.out) / f"sparsity_curve_{args.max_steps_from}.json").read_text())["steps"]
        steps = int(1.05 * done)
    if steps:                        # the policy's schedule (fraction decay, until) counts trainer.max_steps
        over = [o for o in over if not o.startswith("trainer.max_steps=")] + [f"trainer.max_steps={steps}"]
    shutil.rmtree(f"{args.runs}/{args.which}", ignore_errors=True)
    cfg = config(*over)
    equal_time_curve(cfg, args.which, args.seconds, os.path.join(args.out, f"sparsity_curve_{args.which}.json"),
                     params=sum(p.numel() for p in build(cfg).parameters()), corpus=corpus, overrides=over)


def _share_cells(row: dict, policy: str) -> str:
    """The update's share of training time: over the windows after the first, and (in brackets)
    over those after the first update's window."""
    if policy not in row:
        return "-"
    r, static = row[policy], row["static"]
    if len(r.get("windows", [])) < 3:
        return f"{100 * r['share']:.1f}%"
    later = 1 - statistics.fmean(r["windows"][1:]) / statistics.fmean(static["windows"][1:])
    return f"{100 * r['share']:.1f}% ({100 * later:.1f}%)"


def cmd_report(args) -> None:
    out = Path(args.out)
    curves = {w: json.loads((out / f"sparsity_curve_{w}.json").read_text())
              for w in WHICH if (out / f"sparsity_curve_{w}.json").exists()}
    lines = [f"# Dynamic block sparsity (issue 23), {datetime.date.today()}", "",
             "`scripts/bench/bench_sparsity.py`. Curves: equal wall time on this machine's site-packages `*.py` sources, "
             "whole files held out.", ""]
    cost = out / "sparsity_cost.json"
    if cost.exists():
        c = json.loads(cost.read_text())
        others = [p for p in POLICIES if p != "static"]
        lines += [f"Share of training time spent on updates at every=100 (target <= 2%), {c['device']}; updates at steps 100, 200, ... "
                  "(`bench_sparsity.py cost`): 1 - tokens/s with "
                  "updates / tokens/s of the static run, over the logged windows after the first; in brackets, over "
                  "the windows after the first update's (its one-time warm-up left out)."
                  + (f" Runs: {c['note']}." if "note" in c else ""), "",
                  "| model | steps per run | static tokens/s | " + " | ".join(others) + " |",
                  "|---|---|---|" + "---|" * len(others)]
        for model in COST:
            if model in c:
                r = c[model]
                lines.append(f"| {model} | {r.get('steps', c.get('steps'))} | {r['static']['mean_tokens_per_s']:,.0f} | "
                             + " | ".join(_share_cells(r, p) for p in others) + " |")
        lines += ["", "Host time of one update (mean over the run's updates, ms; the trainer's log line) and whether "
                  "every layer's tables were rewritten in place (the captured step kept):", "",
                  "| model | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
        for model in COST:
            if model in c:
                cells = []
                for p in others:
                    ups = c[model].get(p, {}).get("updates", [])
                    cells.append(f"{statistics.fmean(u['ms'] for u in ups):.0f} ms, "
                                 f"{'in place' if all(u['in_place'] for u in ups) else 'new tables'}" if ups else "-")
                lines.append(f"| {model} | " + " | ".join(cells) + " |")
        lines += ["", "The steps between updates alone (the windows with no update: the cost command logs every 50 "
                  "steps and updates every 100): 1 - their tokens/s / static's, what the layouts an update leaves cost "
                  "the kernels:", "",
                  "| model | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
        for model in COST:
            if model in c:
                r = c[model]
                lines.append(f"| {model} | " + " | ".join(
                    f"{100 * (1 - statistics.fmean(r[p]['windows'][1::2]) / statistics.fmean(r['static']['windows'][1::2])):.1f}%"
                    if len(r.get(p, {}).get("windows", [])) >= 3 else "-" for p in others) + " |")
        lines.append("")
    if curves:
        lines += ["| model | parameters | seconds | steps | valid bits/byte |", "|---|---|---|---|---|"]
        for w, cv in curves.items():
            lines.append(f"| {w} | {cv['params']:,} | {cv['seconds']:.0f} | {cv['steps']} | {cv['valid_bpb']:.4f} |")
    (out / "sparsity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if curves:
        panels = [(k, t) for k, t in (("lstm", "LSTM, equal parameters"), ("ffn", "transformer FFN, equal parameters"))
                  if any(w.startswith(k) for w in curves)]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (kind, title) in zip(axes[0], panels):
            for w, cv in curves.items():
                if w.startswith(kind):
                    _, t, b = zip(*cv["valid_history"])
                    ax.plot(t, b, marker="o", ms=3, label=f"{w}: {cv['valid_bpb']:.3f}")
            ax.set(xlabel="seconds", ylabel="valid bits/byte", title=title)
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "sparsity.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("cost", "curve", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="benchmarks")
        p.add_argument("--runs", default="/tmp/bstrain-sparsity-runs")
        p.add_argument("--corpus", default=None, help="data.path (default: site-packages/**/*.py)")
    sub.choices["cost"].add_argument("--steps", type=int, default=400)
    sub.choices["curve"].add_argument("--which", choices=sorted(WHICH), required=True)
    sub.choices["curve"].add_argument("--seconds", type=float, default=600)
    sub.choices["curve"].add_argument("--max-bytes", type=int, default=1 << 26, help="data.max_bytes")
    sub.choices["curve"].add_argument("--max-steps", type=int, default=0,
                                      help="trainer.max_steps (a policy's schedule spans it; the time limit binds)")
    sub.choices["curve"].add_argument("--max-steps-from", default=None,
                                      help="trainer.max_steps = 1.05 x the steps of this earlier curve in --out")
    sub.choices["cost"].add_argument("--models", default=",".join(COST), help="of " + ", ".join(COST))
    sub.choices["cost"].add_argument("--policies", default=",".join(POLICIES),
                                     help="comma-separated, static first")
    args = ap.parse_args()
    if args.cmd == "cost" and args.policies.split(",")[0] != "static":
        ap.error(f"--policies: expected static first (the others' share is against it), got {args.policies}")
    os.makedirs(args.out, exist_ok=True)
    {"cost": cmd_cost, "curve": cmd_curve, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
