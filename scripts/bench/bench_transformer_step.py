"""One training step of the 8k transformer LM, sparse patterns against the dense twin, on the GPU (issue 21).

    PYTHONPATH=$PWD python scripts/bench/bench_transformer_step.py --out benchmarks [--variants a,b] [--eager]

Every variant is transformer_enwik8's model (d_model 512, 8 layers, 8 heads, rotary, batch 4 x 8192,
bf16) with overrides: the attention pattern, its block size, and ``model.fused`` (the fused glue;
false: the plain PyTorch modules the model used before). One step is the trainer's: forward, the
LM loss, backward, clipping and fused AdamW, replayed from a CUDA graph (the default mode,
``bstrain.train.graphs.CapturedStep``); ``--eager`` also times it eagerly.

Per variant: ms per step (median of triton.testing.do_bench), tokens/s, and the GPU kernel time of one
eager step from torch.profiler split into GEMMs (cuBLAS/CUTLASS), attention (ours or SDPA's) and
everything else (the glue), with the largest glue kernels. Ratios against the dense twin with the
same glue come from this one run. Writes transformer_step.md and .json to --out.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import build, config  # noqa: E402

BASE = ["config=transformer_enwik8", "data.path=unused", "trainer.precision=bf16"]
VARIANTS = {
    "dense, plain glue": ["model.attention=dense", "model.fused=false"],
    "dense": ["model.attention=dense"],
    "strided,fixed w128 bs64, plain glue": ["model.attention='strided,fixed'", "model.window=128",
                                            "model.summary=16", "model.block_size=64", "model.fused=false"],
    "strided,fixed w128 bs64": ["model.attention='strided,fixed'", "model.window=128", "model.summary=16",
                                "model.block_size=64"],
    "fixed w1024 s64 bs64": ["model.attention=fixed", "model.window=1024", "model.summary=64", "model.block_size=64"],
    "local,fixed w1024 s64 bs64": ["model.attention='local,fixed'", "model.window=1024", "model.summary=64",
                                   "model.block_size=64"],
    "local+fixed w512 s64 bs64": ["model.attention=local+fixed", "model.window=512", "model.summary=64",
                                  "model.block_size=64"],
    "local+fixed w256 s32 bs64": ["model.attention=local+fixed", "model.window=256", "model.summary=32",
                                  "model.block_size=64"],
    "fixed w1024 s128 bs128": ["model.attention=fixed", "model.window=1024", "model.summary=128",
                               "model.block_size=128"],
    "local,fixed w1024 s128 bs128": ["model.attention='local,fixed'", "model.window=1024", "model.summary=128",
                                     "model.block_size=128"],
    "causal bs128": ["model.attention=causal", "model.block_size=128"],
}

GEMM = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "splitk")
ATTENTION = ("_attn_", "flash", "fmha", "attention", "sdpa")


def category(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in GEMM):
        return "gemm"
    return "other"


def make_step(overrides: list[str], graph: bool):
    from bstrain.train.graphs import CapturedStep
    from bstrain.train.step import Forward, train_step
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    cfg = config(*BASE, *overrides)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build(cfg).to(dev)
    opt = make_optimizer(model, cfg.optim, dev, capturable=graph)
    forward, loss_fn = Forward(model, torch.bfloat16, dev), ByteLM().loss
    x = torch.randint(0, 256, (cfg.data.batch_size, cfg.data.seq_len), device=dev)
    y = torch.randint(0, 256, x.shape, device=dev)
    if graph:
        cap = CapturedStep(forward, loss_fn, opt, cfg.optim.grad_clip)
        return (lambda: cap.step(x, y, reset_state=True)), x.numel(), model
    params = list(model.parameters())
    return (lambda: train_step(forward, loss_fn, x, y, None, opt, params, cfg.optim.grad_clip)), x.numel(), model


def kernel_split(fn, steps: int = 3) -> dict:
    """GPU ms per step by category, and the top 'other' kernels, of ``fn`` (warm) from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    split, other = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        cat = category(e.name)
        split[cat] += e.device_time / 1e3 / steps
        if cat == "other":
            other[e.name[:90]] += e.device_time / 1e3 / steps
    return {"gemm_ms": split["gemm"], "attention_ms": split["attention"], "other_ms": split["other"],
            "gpu_ms": sum(split.values()), "top_other": [(n, round(ms, 3)) for n, ms in other.most_common(8)]}


def measure(name: str, overrides: list[str], eager: bool) -> dict:
    import triton
    row = {"variant": name, "overrides": overrides}
    fn, tokens, model = make_step(overrides, graph=True)
    fn()
    torch.cuda.synchronize()
    row["graph_ms"] = triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")
    row["tokens_per_s"] = tokens / row["graph_ms"] * 1e3
    layouts = model.block_sparse_layouts()
    row["attention_density"] = (sum(float(v.mean()) for k, v in layouts.items() if k.endswith("attn"))
                                / max(1, sum(1 for k in layouts if k.endswith("attn")))) if layouts else None
    del fn, model
    torch.cuda.empty_cache()
    fn, _, _ = make_step(overrides, graph=False)
    row.update(kernel_split(fn))
    if eager:
        row["eager_ms"] = triton.testing.do_bench(fn, warmup=20, rep=400, return_mode="median")
    del fn
    torch.cuda.empty_cache()
    return row


def smoke(names: list[str]) -> None:
    """Each variant's model and eager step at a tiny size on the CPU (checks the overrides and the script)."""
    from bstrain.train.step import Forward, train_step
    from bstrain.train.tasks.lm import ByteLM
    from bstrain.train.trainer import make_optimizer
    for name in names:
        small = [o for o in VARIANTS[name] if not o.startswith(("model.window", "model.summary"))]
        cfg = config(*BASE, *small, "model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.context=256",
                     "model.window=64", "model.summary=16", "data.seq_len=256", "data.batch_size=2")
        model = build(cfg)
        opt = make_optimizer(model, cfg.optim, torch.device("cpu"), capturable=False)
        x = torch.randint(0, 256, (2, 256))
        loss = train_step(Forward(model, None, torch.device("cpu")), ByteLM().loss, x, x, None, opt,
                          list(model.parameters()), cfg.optim.grad_clip)
        print(name, "ok", loss if not isinstance(loss, tuple) else loss[0], flush=True)


def report(rows: list[dict], out: str) -> None:
    by = {r["variant"]: r for r in rows}
    dense = by.get("dense")
    lines = [f"# The 8k transformer step, sparse against the dense twin ({torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {datetime.date.today()})", "",
             "`scripts/bench/bench_transformer_step.py`: transformer_enwik8's model (d_model 512, 8 layers, 8 heads, "
             "rotary, batch 4 x 8192, bf16), one trainer step (forward, loss, backward, clip, fused AdamW) "
             "replayed from a CUDA graph (the default mode): median of `triton.testing.do_bench`. GPU split: "
             "kernel time of one eager step (torch.profiler): GEMMs, attention kernels, everything else (glue). "
             "'plain glue': `model.fused=false`, the modules before issue 21.", "",
             "| variant | live blocks / dense | step ms (graph) | tokens/s | vs dense | GPU ms | GEMM | attention "
             "| other | eager ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{dense['graph_ms'] / r['graph_ms']:.2f}x" if dense else "-"
        dens = "-" if r.get("attention_density") is None else f"{r['attention_density']:.3f}"
        lines.append(f"| {r['variant']} | {dens} | {r['graph_ms']:.2f} | {r['tokens_per_s']:,.0f} | {vs} | "
                     f"{r['gpu_ms']:.2f} | {r['gemm_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms']:.2f} | "
                     f"{r.get('eager_ms', float('nan')):.2f} |")
    lines += ["", "Largest glue ('other') kernels per step, ms:", ""]
    for r in rows:
        lines.append(f"- {r['variant']}: " + "; ".join(f"`{n[:60]}` {ms}" for n, ms in r["top_other"][:5]))
    (open(os.path.join(out, "transformer_step.md"), "w")).write("\n".join(lines) + "\n")
    with open(os.path.join(out, "transformer_step.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names of VARIANTS, separated by ';'")
    ap.add_argument("--eager", action="store_true", help="also time the eager step")
    ap.add_argument("--smoke", action="store_true", help="CPU: build and run each variant's eager step, tiny")
    args = ap.parse_args()
    names = [n for n in args.variants.split(";") if n]
    if args.smoke:
        smoke(names)
        return
    rows = []
    for name in names:
        try:
            rows.append(measure(name, VARIANTS[name], args.eager))
            r = rows[-1]
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                              if k != "top_other"}), flush=True)
        except Exception as exc:                        # one broken variant does not lose the others
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
