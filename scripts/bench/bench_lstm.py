"""Sparse mLSTM results on the GPU (issues 4 and 9), in sub-commands:

    PYTHONPATH=$PWD python scripts/bench/bench_lstm.py steptime --out DIR
        Step time (forward + backward + clipping + AdamW, bf16) of the sparse mLSTM at hidden 8192
        and >= 90% sparsity against density x the dense step time (target: ratio <= 1.5), with the
        step captured in a CUDA graph (as trainer.cuda_graph=true runs it) and in eager mode. The
        step is the trainer's own (bstrain.train.step.train_step).
    PYTHONPATH=$PWD python scripts/bench/bench_lstm.py pair --out DIR [--tag NAME]
        The CUDA-graphed step of the equal-parameter pair below (sparse hidden 4096 at 3.5% against
        dense hidden 1024; batch 128 x 64), sparse over dense (target, issue 22: <= 1.15), with the
        summed GPU kernel time and the top kernels of one eager step: lstm_pair.json.
    PYTHONPATH=$PWD python scripts/bench/bench_lstm.py curve --which sparse|dense --seconds 450 --out DIR
        Trains one model of an equal-parameter pair for a fixed time through the trainer, on this
        machine's site-packages *.py sources (whole files held out for valid/test); writes
        lstm_curve_<which>.json. Run the two on two GPUs at once (CUDA_VISIBLE_DEVICES).
    PYTHONPATH=$PWD python scripts/bench/bench_lstm.py scaling --out DIR [--nproc 1|2]
        tokens/s of the lstm_enwik8 config (hidden 4096, batch 64 x 128 per GPU, bf16) on one
        process, or under torchrun on two GPUs (DDP): writes lstm_scaling_<nproc>.json.
    python scripts/bench/bench_lstm.py report --out DIR
        lstm.md, lstm.csv and lstm.png from the JSON files in DIR.
    PYTHONPATH=$PWD python scripts/bench/bench_lstm.py eager [--unfused] [--group N]
        Eager vs CUDA-graphed step time of the lstm_enwik8 config and the kernels one eager step
        launches (torch.profiler): one table line (target: eager <= 2x graphed). About a minute.
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

# equal total parameters (+-2%): the sparse model is 4x wider at the density that matches them
PAIR = {
    "sparse": ["model.hidden=4096", "model.density=0.0346"],
    "dense": ["model.hidden=1024", "model.sparse=false"],
}
CURVE_COMMON = ["data.seq_len=64", "data.batch_size=128", "trainer.precision=bf16", "trainer.cuda_graph=true",
                "trainer.eval_every=1000", "trainer.eval_batches=200", "trainer.progress=false",
                "trainer.ckpt_every=0", "trainer.log_every=100", "trainer.max_steps=1000000",
                "optim.lr=1e-3", "optim.warmup_steps=200", "optim.schedule=constant", "model.embed=128",
                "model.block_size=32", "model.depth=2", "model.layout=random"]


def config(*overrides):
    from hydra import compose, initialize_config_module

    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def build(cfg):
    from bstrain.train.trainer import instantiate
    return instantiate(cfg.model, "model")


def recurrent(model) -> tuple[int, int]:
    """(live recurrent weights, dense recurrent weights at this width)."""
    H = model.cfg.hidden
    live = sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(("w_hm", "deep", "w_mg")) and n.endswith("weight"))
    return live, (model.cfg.depth + 4) * H * H


def site_packages_glob() -> str:
    """Every *.py below the site-packages directory that holds torch."""
    return os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "**", "*.py")


def equal_time_curve(cfg, which: str, seconds: float, path: str, **fields) -> dict:
    """Trains ``cfg`` (its trainer.time_limit_s set) and writes the curve to ``path`` as JSON:
    which, steps, seconds, valid bits/byte, the loss and validation histories, the data, the
    device, and ``fields`` (or, callable, ``fields(train's result)``). Returns it."""
    from bstrain.train.trainer import train
    res = train(cfg)
    out = dict(which=which, steps=res["steps"], seconds=seconds, valid_bpb=res["valid_bpb"], history=res["history"],
               valid_history=res["valid_history"], data=res["data"],
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    out.update({k: (v(res) if callable(v) else v) for k, v in fields.items()})
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"{which}: {res['steps']} steps, valid {res['valid_bpb']:.4f} bits/byte", flush=True)
    return out


# --- step time ---------------------------------------------------------------------------------------
def _step_fn(cfg, batch: int, seq: int, group: int, graph: bool, fused: bool = True):
    """(one optimizer step in bf16 on random bytes, the model): the trainer's step, eager or
    replayed from a CUDA graph; fused=False runs the mLSTM's time loop op by op."""
    from bstrain.nn import set_grad_group
    from bstrain.train.graphs import CapturedStep
    from bstrain.train.step import Forward, train_step
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build(cfg).to(dev)
    model.fused = fused
    set_grad_group(model, group)
    opt = make_optimizer(model, cfg.optim, dev, capturable=graph)
    forward, loss_fn, params = Forward(model, torch.bfloat16, dev), ByteLM().loss, list(model.parameters())
    x = torch.randint(0, 256, (batch, seq), device=dev)
    if graph:
        cap = CapturedStep(forward, loss_fn, opt, cfg.optim.grad_clip)

        def fn():
            cap.step(x, x, reset_state=True)
    else:
        def fn():
            train_step(forward, loss_fn, x, x, None, opt, params, cfg.optim.grad_clip)
    return fn, model


def step_time(cfg, batch: int, seq: int, group: int, graph: bool, fused: bool = True) -> tuple[float, float]:
    """(median ms per optimizer step in bf16 on random bytes, recurrent density of the model):
    the trainer's step, eager or replayed from a CUDA graph."""
    import triton
    fn, model = _step_fn(cfg, batch, seq, group, graph, fused)
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=200, rep=1500, return_mode="median")
    live, full = recurrent(model)
    del model, fn
    torch.cuda.empty_cache()
    return ms, live / full


def step_launches(fn) -> tuple[int, int]:
    """(CUDA kernels run, kernel-launch API calls made) by one call of ``fn``, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset")))
    api = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
              and e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"))
    return kernels, api


def cmd_eager(args) -> None:
    """Eager vs CUDA-graphed step of the lstm_enwik8 widths (hidden 4096, embed 256, depth 2, block 32,
    density 0.1 watts_strogatz, batch 64 x seq 128, bf16, trainer.group_size), with the kernel
    launches of one eager step. Target: eager <= 2x graphed. About a minute on an H200, most of it
    compiling kernels."""
    cfg = config("config=lstm_enwik8")
    batch, seq, group = cfg.data.batch_size, cfg.data.seq_len, args.group or cfg.trainer.group_size
    fused = not args.unfused
    fn, model = _step_fn(cfg, batch, seq, group, graph=False, fused=fused)
    for _ in range(2):                                   # compile and load every kernel, build the plans
        fn()
    kernels, api = step_launches(fn)
    if args.host_profile:                                # where the eager step's host time goes, by op
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    import triton
    eager = triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")
    del model, fn
    torch.cuda.empty_cache()
    graphed, _ = step_time(cfg, batch, seq, group, graph=True, fused=fused)
    print("| loop | eager ms | graphed ms | eager / graphed | kernels/step | launch calls/step | kernels/timestep |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {'fused' if fused else 'op by op'} | {eager:.1f} | {graphed:.1f} | {eager / graphed:.2f} | {kernels} | "
          f"{api} | {kernels / seq:.1f} |", flush=True)


def cmd_steptime(args) -> None:
    rows = []
    seq = 32
    ints = lambda v: [int(x) for x in v.split(",")]          # noqa: E731
    dense_cfg = config("model.hidden=8192", "model.sparse=false", "model.embed=256", "model.depth=2")
    for batch in ints(args.batches):
        for graph in [m == "graph" for m in args.modes.split(",")]:
            try:
                td, _ = step_time(dense_cfg, batch, seq, 1, graph)
            except Exception as e:                         # keep the other measurements of this call
                print(f"dense batch {batch} graph {graph}: {type(e).__name__}: {e}", flush=True)
                continue
            for bs in ints(args.block_sizes):
                for dens in [float(x) for x in args.densities.split(",")]:
                    cfg = config("model.hidden=8192", f"model.density={dens}", "model.layout=random",
                                 "model.embed=256", "model.depth=2", f"model.block_size={bs}")
                    try:
                        ts, d = step_time(cfg, batch, seq, 8, graph)
                    except Exception as e:
                        print(f"sparse batch {batch} graph {graph}: {type(e).__name__}: {e}", flush=True)
                        continue
                    rows.append(dict(batch=batch, seq=seq, graph=graph, block=bs, density=round(d, 4),
                                     sparse_ms=round(ts, 2), dense_ms=round(td, 2), ratio=round(ts / (d * td), 2)))
                    print(rows[-1], flush=True)
    path = os.path.join(args.out, "lstm_steptime.json")
    old = json.loads(Path(path).read_text()) if args.append and os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(old + rows, f, indent=1)


def kernel_times(fn, top: int = 8) -> tuple[float, list[tuple[str, float, int]]]:
    """(summed GPU kernel ms of one call of ``fn``, the ``top`` kernels by GPU time: (name, ms, count))."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and not e.key.startswith(("Memcpy", "Memset"))]
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def cmd_pair(args) -> None:
    """The equal-parameter pair of the curve runs (batch 128 x 64, bf16): the CUDA-graphed step of
    each, sparse over dense (target, issue 22: <= 1.15), and the summed GPU kernel time and top
    kernels of one eager step. Appends to lstm_pair.json (tag: --tag, e.g. panels on or off)."""
    out = {}
    for which in ("dense", "sparse"):
        cfg = config(*CURVE_COMMON, *PAIR[which])
        batch, seq, group = cfg.data.batch_size, cfg.data.seq_len, cfg.trainer.group_size
        graphed, density = step_time(cfg, batch, seq, group, graph=True)
        fn, model = _step_fn(cfg, batch, seq, group, graph=False)
        for _ in range(2):
            fn()
        gpu, top = kernel_times(fn)
        out[which] = dict(graphed_ms=round(graphed, 3), eager_gpu_ms=round(gpu, 3), density=round(density, 4),
                          params=sum(p.numel() for p in model.parameters()),
                          top=[(n[:80], round(ms, 3), c) for n, ms, c in top])
        del model, fn
        torch.cuda.empty_cache()
        print(which, out[which], flush=True)
    out.update(tag=args.tag, ratio=round(out["sparse"]["graphed_ms"] / out["dense"]["graphed_ms"], 3),
               panels=os.environ.get("BSTRAIN_BSMM_PANEL", "0") == "1", device=torch.cuda.get_device_name(),
               torch=torch.__version__, date=str(datetime.date.today()))
    path = os.path.join(args.out, "lstm_pair.json")
    old = json.loads(Path(path).read_text()) if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(old + [out], f, indent=1)
    print("| tag | dense graphed ms | sparse graphed ms | sparse / dense | dense GPU ms | sparse GPU ms |")
    print(f"| {args.tag} | {out['dense']['graphed_ms']} | {out['sparse']['graphed_ms']} | {out['ratio']} | "
          f"{out['dense']['eager_gpu_ms']} | {out['sparse']['eager_gpu_ms']} |", flush=True)


def cmd_profile(args) -> None:
    """GPU time per kernel name of one eager sparse step (the same kernels a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    from bstrain.nn import set_grad_group
    from bstrain.train.step import Forward, train_step
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    dev = torch.device("cuda")
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        cfg = config("model.hidden=8192", f"model.density={args.densities.split(',')[0]}", "model.layout=random",
                     "model.embed=256", "model.depth=2", f"model.block_size={bs}")
        model = build(cfg).to(dev)
        set_grad_group(model, 8)
        opt = make_optimizer(model, cfg.optim, dev)
        batch = int(args.batches.split(",")[0])
        x = torch.randint(0, 256, (batch, 32), device=dev)
        forward, params = Forward(model, torch.bfloat16, dev), list(model.parameters())

        def fn():
            train_step(forward, ByteLM().loss, x, x, None, opt, params, cfg.optim.grad_clip)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== block {bs}, batch {batch}, density {args.densities.split(',')[0]}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        del model


# --- learning curves ---------------------------------------------------------------------------------
def cmd_curve(args) -> None:
    corpus = args.corpus or site_packages_glob()
    cfg = config(*CURVE_COMMON, *PAIR[args.which], f"data.path={corpus}", f"trainer.time_limit_s={args.seconds}",
                 f"trainer.run_dir={args.runs}/{args.which}")
    model = build(cfg)
    live, full = recurrent(model)
    equal_time_curve(cfg, args.which, args.seconds, os.path.join(args.out, f"lstm_curve_{args.which}.json"),
                     hidden=cfg.model.hidden, density=live / full, recurrent_params=live,
                     total_params=sum(p.numel() for p in model.parameters()), corpus=corpus,
                     overrides=CURVE_COMMON + PAIR[args.which])


SCALING = ["config=lstm_enwik8", "data.name=bytes", "data.max_bytes=67108864", "trainer.eval_every=0",
           "trainer.ckpt_every=0", "trainer.log_every=10", "trainer.progress=false", "optim.ema=0"]


def torchrun_tokens_per_s(run: Path, nproc: int, overrides: list[str]) -> tuple[float, list[float]]:
    """Trains ``overrides`` under torchrun with nproc processes in a fresh run dir; returns (median
    tokens/s of the logged windows after the first two, which include compilation; every window)."""
    import re
    import shutil
    import subprocess
    shutil.rmtree(run, ignore_errors=True)                 # a fresh run (an old one would refuse to start)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
                    "bstrain", "train", *overrides, f"hydra.run.dir={run}"], check=True)
    rates = [float(v) for v in re.findall(r" step \d+ loss .* tokens/s (\d+)", (run / "train.log").read_text())]
    steady = rates[2:] or rates
    return sorted(steady)[len(steady) // 2], rates


def cmd_scaling(args) -> None:
    """tokens/s of the enwik8-sized config: one process here, or args.nproc processes via torchrun."""
    tps, rates = torchrun_tokens_per_s(Path(args.runs) / f"scaling_{args.nproc}", args.nproc,
                                       [*SCALING, f"data.path={args.corpus or site_packages_glob()}",
                                        f"trainer.max_steps={args.steps}"])
    steady = rates[2:]
    out = dict(nproc=args.nproc, tokens_per_s=tps, windows=rates, overrides=SCALING, steps=args.steps,
               device=torch.cuda.get_device_name())
    with open(os.path.join(args.out, f"lstm_scaling_{args.nproc}.json"), "w") as f:
        json.dump(out, f)
    print(f"{args.nproc} GPU(s): {tps:.0f} tokens/s (median of {len(steady)} windows of 10 steps)", flush=True)


# --- report --------------------------------------------------------------------------------------------
def cmd_report(args) -> None:
    out = Path(args.out)
    curves = {w: json.loads((out / f"lstm_curve_{w}.json").read_text())
              for w in ("sparse", "dense") if (out / f"lstm_curve_{w}.json").exists()}
    steptime = json.loads((out / "lstm_steptime.json").read_text()) if (out / "lstm_steptime.json").exists() else []
    device = next((c["device"] for c in curves.values()), "NVIDIA H200")
    lines = [f"# sparse mLSTM: {device}, {datetime.date.today()}", ""]
    if steptime:
        lines += ["## Step time at hidden 8192 (bf16, depth 2, group 8; fwd + bwd + clip + AdamW)", "",
                  "sparse / (density x dense); target <= 1.5. `graph`: the step replayed from a CUDA graph "
                  "(trainer.cuda_graph=true); `eager`: launched op by op from Python.", "",
                  "| batch x seq | mode | block | density | sparse ms | dense ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} x {r['seq']} | {'graph' if r['graph'] else 'eager'} | {r.get('block', 32)} | "
                  f"{r['density']:.3f} | "
                  f"{r['sparse_ms']:.2f} | {r['dense_ms']:.2f} | {r['ratio']:.2f} |" for r in steptime]
        lines.append("")
    scaling = {n: json.loads((out / f"lstm_scaling_{n}.json").read_text())
               for n in (1, 2) if (out / f"lstm_scaling_{n}.json").exists()}
    if len(scaling) == 2:
        eff = scaling[2]["tokens_per_s"] / (2 * scaling[1]["tokens_per_s"])
        lines += ["## Scaling on two GPUs (DDP, torchrun)", "",
                  f"`lstm_enwik8` (hidden 4096, density 0.1, batch 64 x 128 per GPU, bf16, eager): "
                  f"{scaling[1]['tokens_per_s']:,.0f} tokens/s on one GPU, {scaling[2]['tokens_per_s']:,.0f} on two: "
                  f"efficiency **{eff:.2f}** (target >= 0.9). Medians of 10-step windows after the first two.", ""]
    if curves:
        c0 = next(iter(curves.values()))
        lines += [f"## Equal parameters, {c0['seconds']:.0f} s each, same text", "",
                  f"Text: every `*.py` under the GPU machine's site-packages, whole files held out for valid and "
                  f"test ({c0['data']}). Shared settings: "
                  f"`{' '.join(CURVE_COMMON)}`. Each run on its own H200, at the same time.", "",
                  "| model | hidden | recurrent density | parameters | steps | bytes seen | valid bits/byte |",
                  "|---|---|---|---|---|---|---|"]
        for w, c in curves.items():
            seen = c["steps"] * 64 * 128
            lines.append(f"| {w} | {c['hidden']} | {c['density']:.4f} | {c['total_params']:,} | {c['steps']} | "
                         f"{seen / 2**20:.0f} MiB | {c['valid_bpb']:.4f} |")
        if len(curves) == 2:
            s, d = curves["sparse"]["valid_history"], curves["dense"]["valid_history"]
            common = sorted(set(st for st, _, _ in s) & set(st for st, _, _ in d))
            if common:
                k = common[-1]
                sv = next(b for st, _, b in s if st == k)
                dv = next(b for st, _, b in d if st == k)
                lines += ["", f"At equal steps ({k}): sparse {sv:.4f}, dense {dv:.4f} valid bits/byte."]
            t_end = min(s[-1][1], d[-1][1])
            at = {w: min(h, key=lambda r: abs(r[1] - t_end)) for w, h in (("sparse", s), ("dense", d))}
            lines += [f"At equal wall time (about {t_end:.0f} s): sparse {at['sparse'][2]:.4f} (step "
                      f"{at['sparse'][0]}), dense {at['dense'][2]:.4f} (step {at['dense'][0]}) valid bits/byte."]
        lines.append("")
        import csv
        with open(out / "lstm.csv", "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["model", "kind", "step", "seconds", "value"])
            for w, c in curves.items():
                wr.writerows([w, "train_loss", st, "", v] for st, v in c["history"] if st % 10 == 0)
                wr.writerows([w, "valid_bpb", st, round(sec, 2), v] for st, sec, v in c["valid_history"])
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
            for w, c in curves.items():
                st, l = zip(*c["history"])
                k = 200
                csum = [0.0]
                for v in l:
                    csum.append(csum[-1] + v)
                smooth = [(csum[i + 1] - csum[max(0, i - k)]) / (i + 1 - max(0, i - k)) for i in range(len(l))]
                label = f"{w} H={c['hidden']} d={c['density']:.3f} ({c['total_params'] / 1e6:.1f}M)"
                axes[0].plot(st, [v / 0.6931 for v in smooth], label=label)
                vs, vt, vb = zip(*c["valid_history"])
                axes[1].plot(vs, vb, marker="o", label=f"{label}: {c['valid_bpb']:.3f}")
                axes[2].plot(vt, vb, marker="o", label=f"{label}: {c['valid_bpb']:.3f}")
            axes[0].set(xlabel="step", ylabel="train bits/byte (200-step mean)", ylim=(None, 3.0))
            axes[1].set(xlabel="step", ylabel="valid bits/byte", ylim=(None, 3.0))
            axes[2].set(xlabel="seconds", ylabel="valid bits/byte", ylim=(None, 3.0))
            for ax in axes:
                ax.legend()
                ax.grid(alpha=0.3)
            fig.suptitle(f"sparse vs dense mLSTM at equal parameters, {device}")
            fig.tight_layout()
            fig.savefig(out / "lstm.png", dpi=110)
        except ImportError:
            pass
    notes = out / "lstm_notes.md"                    # hand-written reading of the numbers, if any
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    (out / "lstm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["steptime", "pair", "profile", "curve", "scaling", "report", "eager"])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--tag", default="", help="pair: a name for this row")
    ap.add_argument("--which", choices=sorted(PAIR), default="sparse")
    ap.add_argument("--seconds", type=float, default=450.0)
    ap.add_argument("--corpus", default=None, help="data.path (default: site-packages/**/*.py)")
    ap.add_argument("--nproc", type=int, default=1, help="scaling: processes (GPUs)")
    ap.add_argument("--steps", type=int, default=80, help="scaling: training steps")
    ap.add_argument("--runs", default="/tmp/bstrain-lstm-runs")
    ap.add_argument("--batches", default="64,256", help="steptime/profile: batch sizes")
    ap.add_argument("--block-sizes", default="32", help="steptime/profile: block sizes")
    ap.add_argument("--densities", default="0.05,0.1", help="steptime/profile: layout densities")
    ap.add_argument("--modes", default="graph,eager", help="steptime: graph and/or eager")
    ap.add_argument("--append", action="store_true", help="steptime: add rows to an existing JSON")
    ap.add_argument("--unfused", action="store_true", help="eager: time the mLSTM's op-by-op loop (model.fused=False)")
    ap.add_argument("--host-profile", action="store_true", help="eager: the host time by op of one step")
    ap.add_argument("--group", type=int, default=0, help="eager: gradient group size (default: trainer.group_size)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    {"steptime": cmd_steptime, "pair": cmd_pair, "profile": cmd_profile, "curve": cmd_curve, "scaling": cmd_scaling,
     "report": cmd_report, "eager": cmd_eager}[args.command](args)


if __name__ == "__main__":
    main()
