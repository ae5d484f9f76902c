"""Where a dynamic-sparsity update's host time goes (issue 23): trains a COST model of
bench_sparsity.py with a policy for --steps steps (updates every 100) and prints cProfile's top
functions of each update after the first (cumulative and own time), and the update's log line.

    PYTHONPATH=$PWD python scripts/profile/profile_update.py --model lstm --policy set [--balanced]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_sparsity import COST, RUN, config  # noqa: E402
from scripts.bench.bench_lstm import site_packages_glob  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(COST), default="lstm")
    ap.add_argument("--policy", choices=["set", "rigl"], default="set")
    ap.add_argument("--balanced", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import bstrain.sparsity as sp
    from bstrain.train.trainer import train
    inner = sp.DynamicSparsity._update
    seen = []

    def profiled(self, step):
        if not seen:
            seen.append(step)
            return inner(self, step)
        prof = cProfile.Profile()
        prof.enable()
        try:
            return inner(self, step)
        finally:
            prof.disable()
            for key in ("cumulative", "tottime"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
                print(f"--- update at step {step}, by {key}\n" + "\n".join(
                    line for line in s.getvalue().splitlines() if line.strip())[:6000], flush=True)
    sp.DynamicSparsity._update = profiled
    run = f"/tmp/bstrain-profile-update/{args.model}_{args.policy}{'_balanced' if args.balanced else ''}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = config(*COST[args.model], *RUN, f"data.path={site_packages_glob()}", "data.max_bytes=67108864",
                 f"sparsity={args.policy}", f"sparsity.balanced={str(args.balanced).lower()}", "sparsity.every=100",
                 "sparsity.until=1.0", f"trainer.max_steps={args.steps}", f"trainer.run_dir={run}")
    train(cfg)


if __name__ == "__main__":
    main()
