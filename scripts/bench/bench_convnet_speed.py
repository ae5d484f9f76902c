"""Training-step time of the sparse ResNet against dense ones on the GPU (issue 12).

    PYTHONPATH=$PWD python scripts/bench/bench_convnet_speed.py [--out benchmarks] [--steps 30]

One optimizer step (forward, backward, AdamW) of SparseResNet on a batch of 128 CIFAR-sized
images (3x32x32, random), bf16 autocast, as the trainer runs it (convnet_cifar10's model:
widths 128,256,512, depth 2, 25% live blocks of 64), against the dense network of the same
widths and the dense one of equal parameters (half the widths). Median ms per step over
--steps steps after warm-up (CUDA events): eager, under torch.compile, and captured in a CUDA
graph (trainer.cuda_graph=true), which takes the host out of the step. Writes convnet_speed.md.
With --profile, instead: the graphed step, the summed GPU kernel time of one eager step and its
top kernels (torch.profiler) per model: convnet_profile.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import kernel_times  # noqa: E402

from bstrain.models.convnet import SparseResNet  # noqa: E402
from scripts._timing import event_times_ms  # noqa: E402


def median_ms(step, steps: int) -> float:
    """Median over ``steps`` calls of step(), each timed alone by CUDA events."""
    import statistics
    return statistics.median(event_times_ms(step, steps))


def eager_step(model, compiled: bool = False):
    """One eager optimizer step (bf16 autocast, AdamW) of ``model`` (compiled or not) on a fixed
    random batch of 128 images."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model) if compiled else model
    x = torch.randn(128, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def step_ms(model, steps: int, compiled: bool) -> float:
    step = eager_step(model, compiled)
    for _ in range(5):
        step()
    return median_ms(step, steps)


def graph_step_ms(model, steps: int) -> float:
    """The same step captured in a CUDA graph (trainer.cuda_graph=true: bstrain.train.graphs)."""
    from bstrain.train.graphs import CapturedStep
    from bstrain.train.step import Forward
    dev = torch.device("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True)
    cap = CapturedStep(Forward(model, torch.bfloat16, dev), lambda out, y: F.cross_entropy(out.float(), y), opt,
                       grad_clip=1.0)
    x = torch.randn(128, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (128,), device=dev)
    for _ in range(3):
        cap.step(x, y, False)
    return median_ms(lambda: cap.step(x, y, False), steps)


def profile_step(model) -> tuple[float, list]:
    """(summed GPU kernel ms of one eager step, its top kernels: (name, ms, calls)) after warm-up."""
    step = eager_step(model)
    for _ in range(3):
        step()
    return kernel_times(step)


def write_profile(models: dict, steps: int, out: str) -> None:
    """convnet_profile.md: per model, the graphed step and where its GPU time goes."""
    lines = [f"# Sparse ResNet step: where the GPU time goes. {torch.cuda.get_device_name()}, {datetime.date.today()}",
             "", f"torch {torch.__version__}; scripts/bench/bench_convnet_speed.py --profile; batch 128 of 3x32x32, bf16 "
             "autocast, AdamW. CUDA graph: median ms per replayed step; GPU: summed kernel time of one eager step "
             "(torch.profiler); then its top kernels.", ""]
    for name, kw in models.items():
        torch.manual_seed(0)
        model = SparseResNet(depth=2, classes=10, **kw).cuda()
        gpu, top = profile_step(model)
        graph = graph_step_ms(model, steps)
        lines += [f"## {name}: CUDA graph {graph:.2f} ms/step, GPU kernels {gpu:.2f} ms", "",
                  "| kernel | ms | calls |", "|---|---|---|"]
        lines += [f"| `{k[:90]}` | {ms:.3f} | {c} |" for k, ms, c in top] + [""]
        print(f"{name}: graph {graph:.2f} ms, GPU {gpu:.2f} ms", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "convnet_profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="write convnet_profile.md (graphed step, top kernels) only")
    args = ap.parse_args()
    models = {"sparse 128,256,512 at 25%, blocks of 64": dict(widths="128,256,512", density=0.25, block_size=64),
              "dense 128,256,512": dict(widths="128,256,512", density=1.0),
              "dense 64,128,256 (about equal parameters)": dict(widths="64,128,256", density=1.0)}
    if args.profile:
        return write_profile(models, args.steps, args.out)
    rows = []
    for name, kw in models.items():
        torch.manual_seed(0)
        model = SparseResNet(depth=2, classes=10, **kw).cuda()
        r = dict(model=name, params=model.num_params())
        for mode in ("eager", "compiled", "graph"):
            try:
                ms = graph_step_ms(model, args.steps) if mode == "graph" else step_ms(model, args.steps,
                                                                                     mode == "compiled")
                r[mode] = round(ms, 2)
            except Exception as exc:                                   # keep the other rows
                r[mode] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        rows.append(r)
        print(r, flush=True)
    lines = [f"# Sparse ResNet training step: {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; scripts/bench/bench_convnet_speed.py; batch 128 of 3x32x32, bf16 autocast, "
             "AdamW; median ms per step (CUDA events).", "",
             "| model | parameters | eager ms/step | torch.compile ms/step | CUDA graph ms/step |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['params']:,} | {r['eager']} | {r['compiled']} | {r['graph']} |" for r in rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convnet_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
