"""Whole training steps on the GPU: wall time against the GPU's kernel time, per execution mode.

    PYTHONPATH=$PWD python scripts/bench/bench_step.py --parts mlp,configs --out DIR [--profile]

Part ``mlp``: 4 x BlockSparseLinear(4096, 4096) at 10% density, blocks of 64, GELU between, M=4096,
bf16 autocast, forward + backward; and its dense twin (nn.Linear). Modes:
  eager           the module called from Python
  compile         torch.compile(model) (default mode)
  reduce-overhead torch.compile(model, mode="reduce-overhead") (inductor's CUDA graphs)
  graph           bstrain.graphed(step, x): the eager step captured by hand in one CUDA graph
Wall: mean of back-to-back calls ended by one synchronize, median of 5 loops. GPU: the summed
kernel time of one step (torch.profiler). Launches: CUDA kernel launches per step.

Part ``configs``: each built-in GPU config (lstm_enwik8, transformer_enwik8, convnet_cifar10) trained
through ``bstrain.train.trainer.train`` for a few windows, in each trainer mode: the default
(trainer.cuda_graph=auto), eager (cuda_graph=false), compiled (trainer.compile=true, cuda_graph=false),
compiled + graph (compile=true, cuda_graph=true). Units/s: median of the logged windows after the
first (which holds warm-up, capture and compilation). Text data: this machine's site-packages *.py
files; images: the synthetic set.

Writes step.md and step.json to --out; --profile also prints the top host functions (cProfile) of
the MLP's eager and compiled steps.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts._timing import wall_per_call  # noqa: E402


def per_call_ms(fn, calls: int = 20, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` back-to-back calls, in ms."""
    return wall_per_call(fn, torch.device("cuda"), calls, repeats, warmup=3) * 1e3


def gpu_profile(fn, steps: int = 5) -> tuple[float, float]:
    """(summed CUDA kernel ms per step, kernel launches per step) of ``fn`` (warm)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total_us = sum(e.device_time for e in kernels)
    return total_us / steps / 1e3, len(kernels) / steps


class MLP(torch.nn.Module):
    def __init__(self, sparse: bool, width: int = 4096, layers: int = 4, density: float = 0.1, block: int = 64):
        super().__init__()
        from bstrain.nn import BlockSparseLinear
        self.layers = torch.nn.ModuleList(
            BlockSparseLinear(width, width, block_size=block, density=density, seed=i) if sparse
            else torch.nn.Linear(width, width) for i in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x


impl_time = [0.0, 0]


def lean_kernels(acc):
    """Registers bsmm, bsmm_dx and bsmm_dw's Python bodies as their CUDA kernels (below the
    custom-op wrapper's own layers), timing the time spent inside them into ``acc``."""
    import bstrain.ops.matmul as M
    lib = torch.library.Library("bstrain", "IMPL")
    for name in ("bsmm", "bsmm_dx", "bsmm_dw"):
        body = getattr(M, name)._init_fn

        def timed(*args, _body=body):
            t = time.perf_counter()
            out = _body(*args)
            acc[0] += time.perf_counter() - t
            acc[1] += 1
            return out
        lib.impl(name, timed, "CUDA")
    lean_kernels.lib = lib                      # kept alive: the registrations live as long as it does
    return lean_kernels.model


def mlp_step(model, x, grad):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.backward(grad)
        return y
    return step


def measure_mlp(args) -> list[dict]:
    import bstrain
    dev = torch.device("cuda")
    rows = []
    x = torch.randn(args.m, 4096, device=dev, requires_grad=True)
    grad = torch.randn(args.m, 4096, device=dev, dtype=torch.bfloat16)
    for sparse in (True, False):
        base = MLP(sparse).to(dev)
        lean_kernels.model = base
        for mode in ("eager", "compile", "compile-lean", "reduce-overhead", "graph"):
            if mode == "compile-lean" and not (sparse and args.lean):
                continue
            row = {"model": "sparse" if sparse else "dense", "mode": mode}
            try:
                if mode == "eager":
                    step = mlp_step(base, x, grad)
                elif mode == "compile":
                    step = mlp_step(torch.compile(base), x, grad)
                elif mode == "compile-lean":          # diagnosis: the kernels registered for CUDA directly
                    step = mlp_step(torch.compile(lean_kernels(impl_time)), x, grad)
                elif mode == "reduce-overhead":
                    step = mlp_step(torch.compile(base, mode="reduce-overhead"), x, grad)
                else:
                    step = bstrain.graphed(mlp_step(base, x, grad))
                row["wall_ms"] = round(per_call_ms(step), 3)
                if sparse:                  # launches through the JIT (slow) rather than a cached plan
                    from bstrain.kernels import launch
                    launch.stats.update(direct=0, jit=0)
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                    row["jit_per_step"] = launch.stats["jit"] / 5
                    row["direct_per_step"] = launch.stats["direct"] / 5
                    if mode == "compile-lean":
                        impl_time[:] = [0.0, 0]
                        for _ in range(10):
                            step()
                        torch.cuda.synchronize()
                        row["in_kernel_bodies_ms"] = round(impl_time[0] / 10 * 1e3, 3)
                        row["custom_op_calls"] = impl_time[1] / 10
                row["gpu_ms"], row["launches"] = (round(v, 3) for v in gpu_profile(step))
                if args.profile and mode in ("eager", "compile") and sparse:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(10):
                            step()
                        torch.cuda.synchronize()
                    print(f"--- host profile: sparse MLP, {mode}, 10 steps")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows,
                                                    max_name_column_width=70))
            except Exception as exc:            # a failure is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.compiler.reset()
    return rows


def measure_dispatch(args) -> list[dict]:
    """Host µs per call of the block-sparse forward through each layer of the custom-op path
    (M=64, 4096 x 4096 at 10%, blocks of 64, bf16; the GPU work is a few µs)."""
    from bstrain.kernels.matmul import bsmm_forward
    from bstrain.nn import BlockSparseLinear
    from bstrain.ops.tables import lookup
    dev = torch.device("cuda")
    layer = BlockSparseLinear(4096, 4096, block_size=64, density=0.1, seed=0, device=dev, dtype=torch.bfloat16)
    op, w = layer.op, layer.weight.detach()
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    luts = lookup(op.key).on(dev).luts
    lib = torch.library.Library("bstrain_bench", "FRAGMENT")
    lib.define("lean(Tensor x, Tensor w, str layout, int axis) -> Tensor")
    lib.impl("lean", lambda x, w, layout, axis: bsmm_forward(x, w, lookup(layout).on(x.device).luts, axis), "CUDA")
    bsmm = torch.ops.bstrain.bsmm.default
    cases = {
        "launcher (bsmm_forward)": lambda: bsmm_forward(x, w, luts, 1),
        "eager op(x, w)": lambda: op(x, w),
        "torch.ops.bstrain.bsmm, no grad": lambda: bsmm(x, w, op.key, 1, torch.bfloat16),
        "torch.ops.bstrain.bsmm, x requires grad": lambda: bsmm(xg, w, op.key, 1, torch.bfloat16),
        "Library.impl CUDA kernel, no autograd": lambda: torch.ops.bstrain_bench.lean.default(x, w, op.key, 1),
        "empty torch op (x.view)": lambda: x.view(-1),
    }
    rows = []
    for name, fn in cases.items():
        with torch.no_grad() if "no grad" in name else contextlib.nullcontext():
            us = per_call_ms(fn, calls=500) * 1e3
        rows.append({"call": name, "host_us": round(us, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


CONFIGS = {
    "lstm_enwik8": ["trainer.log_every=10", "trainer.max_steps=60"],
    "transformer_enwik8": ["trainer.log_every=5", "trainer.max_steps=30"],
    "convnet_cifar10": ["data.path=null", "trainer.log_every=20", "trainer.max_steps=160"],
}
MODES = {
    "default": [],
    "eager": ["trainer.cuda_graph=false"],
    "compile": ["trainer.compile=true", "trainer.cuda_graph=false"],
    "compile+graph": ["trainer.compile=true", "trainer.cuda_graph=true"],
    "graph": ["trainer.cuda_graph=true"],
}


def measure_configs(args) -> list[dict]:
    from scripts.bench.bench_lstm import config, site_packages_glob
    from bstrain.train.trainer import train
    rows = []
    for name in args.configs:
        for mode in args.modes:
            if name == "lstm_enwik8" and "compile" in mode and not args.lstm_compile:
                continue                    # dynamo unrolls the 128-step time loop: minutes of compiling
            over = [f"config={name}", *CONFIGS[name], *MODES[mode], "trainer.eval_every=0", "trainer.ckpt_every=0",
                    "trainer.progress=false", f"trainer.run_dir={args.runs}/{name}_{mode}"]
            if "data.path=null" not in over:
                over.append(f"data.path={args.corpus or site_packages_glob()}")
            row = {"config": name, "mode": mode}
            try:
                import shutil
                shutil.rmtree(f"{args.runs}/{name}_{mode}", ignore_errors=True)
                res = train(config(*over))
                rates = res["throughput"][1:]
                row.update(units_per_s=round(statistics.median(rates)), unit=res["unit"],
                           step_mode=res.get("step_mode"), windows=[round(r) for r in res["throughput"]])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.compiler.reset()
    return rows


def report(mlp: list[dict], configs: list[dict], out: str, dispatch=()) -> None:
    lines = [f"# Whole steps: wall against GPU time ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{datetime.date.today()})", "", "Script: `scripts/bench/bench_step.py`.", ""]
    if dispatch:
        lines += ["## Host cost of one block-sparse forward call, by path", "", "| call | host µs |", "|---|---|"]
        lines += [f"| {r['call']} | {r['host_us']} |" for r in dispatch] + [""]
    if mlp:
        eager = {r["model"]: r.get("wall_ms") for r in mlp if r["mode"] == "eager"}
        lines += ["## 4 x 4096 MLP, M=4096, bf16, forward + backward", "",
                  "| model | mode | wall ms | GPU kernel ms | launches | wall / eager |", "|---|---|---|---|---|---|"]
        for r in mlp:
            ratio = round(r["wall_ms"] / eager[r["model"]], 2) if r.get("wall_ms") and eager.get(r["model"]) else "-"
            lines.append(f"| {r['model']} | {r['mode']} | {r.get('wall_ms', r.get('error', '-'))} | {r.get('gpu_ms', '-')} | "
                         f"{r.get('launches', '-')} | {ratio} |")
        lines.append("")
    if configs:
        lines += ["## Built-in configs through the trainer (one GPU)", "",
                  "| config | mode | step mode | units/s | / graph |", "|---|---|---|---|---|"]
        graph = {r["config"]: r.get("units_per_s") for r in configs if r["mode"] == "graph"}
        for r in configs:
            ratio = round(r["units_per_s"] / graph[r["config"]], 2) if r.get("units_per_s") and graph.get(r["config"]) else "-"
            lines.append(f"| {r['config']} | {r['mode']} | {r.get('step_mode', '-')} | "
                         f"{r.get('units_per_s', r.get('error', '-'))} {r.get('unit', '')} | {ratio} |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "step.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "step.json"), "w") as f:
        json.dump({"mlp": mlp, "configs": configs, "dispatch": list(dispatch)}, f, indent=1)
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="mlp,configs")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--runs", default="/tmp/bench_step_runs")
    ap.add_argument("--lstm-compile", action="store_true", help="configs: also compile lstm_enwik8")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--lean", action="store_true", help="mlp: also compile with the matmul kernels registered for "
                                                           "CUDA directly (diagnosis)")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    args.configs, args.modes = args.configs.split(","), args.modes.split(",")
    parts = args.parts.split(",")
    dispatch = measure_dispatch(args) if "dispatch" in parts else []
    mlp = measure_mlp(args) if "mlp" in parts else []
    configs = measure_configs(args) if "configs" in parts else []
    report(mlp, configs, args.out, dispatch)


if __name__ == "__main__":
    main()
