"""The figures beyond one GPU (issue 44), each through torchrun and ``python -m bstrain train`` as a user runs it.

    . scripts/gpu/gpu_env.sh          # carry .whl (hydra); on nvidia-h200-x2 or -x4
    python3 scripts/bench/bench_multigpu.py scaling --config lstm_enwik8 --nprocs 1,2,4 --out $OUT
    python3 scripts/bench/bench_multigpu.py fsdp --nproc 4 --out $OUT            # --layers 24 on 2 GPUs
    python3 scripts/bench/bench_multigpu.py resume --to 1,4 --out $OUT
    python3 scripts/bench/bench_multigpu.py rigl --out $OUT
    PYTHONPATH=$PWD python scripts/bench/bench_multigpu.py scaling --config lstm_tiny --nprocs 1,2 --cpu-smoke --out /tmp/x

- scaling: the config's default step (a CUDA graph where the trainer can capture one; the train.log's
  "step:" line says which) on each process count, DDP, the same per-GPU batch: tokens (or images)
  per second, the median of the logged windows after the first two, and the efficiency rate_N / (N
  rate_1). Data: the machine's site-packages ``*.py`` files for the LMs (``--corpus``), and for
  ``convnet_cifar10`` the synthetic 3x32x32 gratings (``data.path=null``: CIFAR-10 is not on the
  GPU machine and cannot be fetched there; the same shapes, so the same step time).
- fsdp: ``transformer_fsdp`` (9.7B parameters at 48 layers) and its dense twin (``model.attention=dense``)
  under ``trainer.strategy=fsdp``: tokens/s, each rank's peak memory, and MFU = 6 x parameters x
  tokens/s / (GPUs x 989 TFLOP/s): the weight products only, the attention's FLOPs left out.
- resume: a DCP checkpoint written by 2 GPUs under fsdp at step --steps, resumed on each process
  count of --to (1: one process, else fsdp) at the same global batch; the per-step losses after it
  against the 2-GPU run's (reduction order moves them a little).
- rigl: ``sparsity=rigl`` under fsdp on 2 GPUs against one GPU at the same global batch: the
  layouts of the last checkpoints compared block by block.
Each writes multigpu_NAME.md and .json to --out (NAME: the subcommand, and the config for scaling).
--cpu-smoke: CPU processes (gloo), tiny steps, to check the script.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts._timing import environment, write_report  # noqa: E402

PEAK_TFLOPS = 989.0            # H200 dense bf16, the datasheet's
LOG = ["trainer.progress=false", "trainer.eval_every=0"]
LINE = re.compile(r" step (\d+) loss ([0-9.]+) \(avg\d+\).*? (\w+)/s (\d+)")
STEP = re.compile(r" INFO step (\d+) loss ([0-9.]+) \(avg1\) ")


def torchrun(run: Path, nproc: int, overrides: list[str], smoke: bool) -> dict:
    """Trains ``overrides`` with ``nproc`` processes in a fresh run dir; {rate, unit, windows, peaks,
    params, step_mode, log} from its train.log and the processes' exit lines."""
    shutil.rmtree(run, ignore_errors=True)
    script = Path(__file__).with_name("_train_peak.py")
    more = ["trainer.device=cpu"] if smoke else []
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          str(script), "train", *overrides, *more, f"hydra.run.dir={run}"],
                         capture_output=True, text=True)
    log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
    if out.returncode:
        raise RuntimeError(f"torchrun {nproc}: exit {out.returncode}: {out.stderr[-1500:]}")
    return {"nproc": nproc, **parse(log, out.stdout)}


def parse(log: str, stdout: str) -> dict:
    """{rate, unit, windows, peak_mem_gib, params, step_mode, losses} of a run from its train.log and
    its processes' stdout (the peak lines of _train_peak.py)."""
    lines = LINE.findall(log)
    rates = [float(r) for *_, r in lines]
    steady = rates[2:] or rates
    params = re.search(r"\| ([\d,]+) parameters", log)
    mode = re.search(r"INFO (step: .*)", log)
    return {"rate": statistics.median(steady) if steady else None,
            "unit": lines[0][2] if lines else None, "windows": rates,
            "peak_mem_gib": {int(r): float(g) for r, g in re.findall(r"peak_mem_gib rank (\d+) ([0-9.]+)", stdout)},
            "params": int(params.group(1).replace(",", "")) if params else None,
            "step_mode": mode.group(1) if mode else "eager (no graph tried)", "losses": dict(STEP.findall(log))}


def lm_data(args) -> list[str]:
    """The LMs' data overrides: the machine's site-packages sources (or --corpus), the first 64 MiB;
    none in a CPU smoke (the config's own small corpus)."""
    if args.cpu_smoke:
        return []
    from scripts.bench.bench_lstm import site_packages_glob
    return [f"data.path={args.corpus or site_packages_glob()}", "data.name=bytes", "data.max_bytes=67108864"]


def scaling(args) -> tuple[list[dict], list[str]]:
    data = ["data.path=null"] if args.config.startswith("convnet") else lm_data(args)
    over = [f"config={args.config}", *data, *LOG, "trainer.ckpt_every=0", f"trainer.log_every={args.log_every}",
            f"trainer.max_steps={args.steps}", *args.override]
    rows = [torchrun(Path(args.runs) / f"scaling_{n}", n, over, args.cpu_smoke) for n in args.nprocs]
    base = rows[0]["rate"] if rows[0]["nproc"] == 1 else None
    for r in rows:
        r["efficiency"] = round(r["rate"] / (r["nproc"] * base), 3) if base and r["rate"] else None
        r.pop("losses")
    lines = ["| GPUs | rate | unit/s | efficiency | step | peak GiB (rank 0) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['nproc']} | {r['rate'] or 0:,.0f} | {r['unit']} | {r['efficiency']} | {r['step_mode']} | "
              f"{r['peak_mem_gib'].get(0, '-')} |" for r in rows]
    where = data[0] if data else "the config's own"
    return rows, [f"DDP scaling of `config={args.config}` (the same batch per GPU; data: {where}).", ""] + lines


def fsdp(args) -> tuple[list[dict], list[str]]:
    over = ["config=transformer_fsdp", *lm_data(args), *LOG, "trainer.ckpt_every=0", f"trainer.log_every={args.log_every}",
            f"trainer.max_steps={args.steps}", f"model.n_layer={args.layers}", *args.override]
    rows = []
    for name, extra in (("sparse", []), ("dense twin", ["model.attention=dense"])):
        r = torchrun(Path(args.runs) / f"fsdp_{name.split()[0]}", args.nproc, over + extra, args.cpu_smoke)
        r.pop("losses")
        r["model"] = name
        r["mfu"] = (round(6 * r["params"] * r["rate"] / (args.nproc * PEAK_TFLOPS * 1e12), 4)
                    if r["params"] and r["rate"] else None)
        rows.append(r)
    lines = ["| model | GPUs | parameters | tokens/s | MFU | peak GiB per rank | step |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['nproc']} | {r['params'] or 0:,} | {r['rate'] or 0:,.0f} | {r['mfu']} | "
              f"{r['peak_mem_gib']} | {r['step_mode']} |" for r in rows]
    return rows, [f"transformer_fsdp at {args.layers} layers under FSDP on {args.nproc} GPUs; MFU counts "
                  f"6 x parameters per token against {PEAK_TFLOPS:.0f} TFLOP/s a GPU, attention left out.", ""] + lines


def resume(args) -> tuple[list[dict], list[str]]:
    k, glob = args.steps, args.global_batch
    over = [args.base, *lm_data(args),
            *LOG, "trainer.log_every=1", f"trainer.ckpt_every={k}", f"trainer.max_steps={2 * k}", *args.override]
    first = Path(args.runs) / "resume_from_2"
    ref = torchrun(first, 2, [*over, f"data.batch_size={glob // 2}", "trainer.strategy=fsdp"], args.cpu_smoke)
    ckpt = first / "ckpt" / f"step_{k:08d}.dcp"
    rows = [{"nproc": 2, "what": f"written at step {k}, runs on to {2 * k}", "losses": ref["losses"]}]
    for n in args.to:
        strategy = "trainer.strategy=auto" if n == 1 else "trainer.strategy=fsdp"
        r = torchrun(Path(args.runs) / f"resume_on_{n}", n, [*over, f"data.batch_size={glob // n}", strategy,
                                                             f"trainer.resume={ckpt}"], args.cpu_smoke)
        after = {s: v for s, v in r["losses"].items() if int(s) > k}
        diffs = [abs(float(v) - float(ref["losses"][s])) for s, v in after.items() if s in ref["losses"]]
        rows.append({"nproc": n, "what": f"resumed from {ckpt.name}", "losses": after, "steps_after": len(after),
                     "max_abs_diff": max(diffs) if diffs else None})
    lines = ["| GPUs | what | steps after the checkpoint | max abs loss difference to the 2-GPU run |",
             "|---|---|---|---|"]
    lines += [f"| {r['nproc']} | {r['what']} | {r.get('steps_after', k)} | {r.get('max_abs_diff', '-')} |" for r in rows]
    return rows, [f"A DCP checkpoint of `{args.base}` written by 2 GPUs (fsdp) at step {k}, resumed at the same "
                  f"global batch of {glob}.", ""] + lines


def rigl(args) -> tuple[list[dict], list[str]]:
    from bstrain.train.checkpoint import load_checkpoint
    glob, steps = args.global_batch, args.steps
    over = [args.base, *lm_data(args),
            *LOG, "trainer.log_every=1", "sparsity=rigl", f"sparsity.every={max(1, steps // 3)}",
            "sparsity.fraction=0.3", "sparsity.until=1.0", f"trainer.max_steps={steps}", f"trainer.ckpt_every={steps}",
            *args.override]
    one, two = Path(args.runs) / "rigl_1", Path(args.runs) / "rigl_2"
    torchrun(one, 1, [*over, f"data.batch_size={glob}"], args.cpu_smoke)
    torchrun(two, 2, [*over, f"data.batch_size={glob // 2}", "trainer.strategy=fsdp"], args.cpu_smoke)
    a = load_checkpoint(one / "ckpt" / f"step_{steps:08d}.pt")["model"]
    b = load_checkpoint(two / "ckpt" / f"step_{steps:08d}.dcp")["model"]
    rows = [{"layout": k, "blocks": int(a[k].numel()), "live": int(a[k].sum()),
             "differ": int((a[k].bool() != b[k].bool()).sum())} for k in a if k.endswith("layout")]
    lines = ["| layout | blocks | live (1 GPU) | blocks that differ (fsdp, 2 GPUs) |", "|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['blocks']} | {r['live']} | {r['differ']} |" for r in rows]
    return rows, [f"RigL (`{args.base}`, every {max(1, steps // 3)} steps, {steps} steps) under fsdp on 2 GPUs "
                  f"against 1 GPU at the global batch of {glob}.", ""] + lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["scaling", "fsdp", "resume", "rigl"])
    ints = lambda s: [int(v) for v in s.split(",") if v]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--runs", default="/tmp/bstrain-multigpu-runs")
    ap.add_argument("--corpus", default=None, help="data.path of the LMs (default: site-packages/**/*.py)")
    ap.add_argument("--config", default="lstm_enwik8", help="scaling: lstm_enwik8, transformer_enwik8, convnet_cifar10")
    ap.add_argument("--nprocs", type=ints, default=[1, 2], help="scaling: process counts, the first 1")
    ap.add_argument("--nproc", type=int, default=4, help="fsdp: GPUs")
    ap.add_argument("--layers", type=int, default=48, help="fsdp: model.n_layer (48: 9.7B; 24 fits 2 GPUs)")
    ap.add_argument("--to", type=ints, default=[1, 4], help="resume: process counts to resume on")
    ap.add_argument("--base", default=None, help="resume, rigl: the config (config=transformer_enwik8, "
                                                  "config=lstm_enwik8: block-sparse weights for RigL to move)")
    ap.add_argument("--global-batch", type=int, default=0, help="resume, rigl: sequences a step over all GPUs "
                                                                "(0: resume 8, rigl 64)")
    ap.add_argument("--steps", type=int, default=0, help="training steps (resume: the checkpoint's step); 0: "
                                                        "scaling 60, fsdp 30, resume 10, rigl 30")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--override", action="append", default=[], help="a Hydra override for every run (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU processes (gloo), tiny runs")
    args = ap.parse_args()
    args.steps = args.steps or {"scaling": 60, "fsdp": 30, "resume": 10, "rigl": 30}[args.what]
    args.base = args.base or {"rigl": "config=lstm_enwik8"}.get(args.what, "config=transformer_enwik8")
    args.global_batch = args.global_batch or {"rigl": 64}.get(args.what, 8)
    need = {"scaling": max(args.nprocs), "fsdp": args.nproc, "resume": max(2, *args.to), "rigl": 2}[args.what]
    if not args.cpu_smoke and torch.cuda.device_count() < need:
        raise SystemExit(f"bench_multigpu {args.what}: needs {need} GPUs, found {torch.cuda.device_count()}")
    rows, lines = {"scaling": scaling, "fsdp": fsdp, "resume": resume, "rigl": rigl}[args.what](args)
    env = environment(args.cpu_smoke)
    name = f"multigpu_{args.what}" + (f"_{args.config}" if args.what == "scaling" else "")
    head = [f"# {args.what}: {env['device']} x {torch.cuda.device_count() or 'CPU processes'}, {env['date']}, "
            f"torch {env['torch']}", "", f"`python3 scripts/bench/bench_multigpu.py {' '.join(sys.argv[1:])}`", ""]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_report(args.out, name, head + lines, {"rows": rows, **env, "command": sys.argv})


if __name__ == "__main__":
    main()
