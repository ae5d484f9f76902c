"""bstrain's sparse LM step against what a user would write instead (issue 33), side by side on one GPU.

    bash ../shared/tools/device-wheels.sh          # here, once: hydra's wheels into .whl (carry .whl)
    . scripts/gpu/gpu_env.sh && python3 scripts/bench/bench_lm_anchor.py --out $OUT [--shapes D64,D128]
        [--anchor-mask layers,window] [--flex-block 128,64] [--flex-backend auto] [--windows 7 --steps 10 --warmup 5]
        [--compile max-autotune-no-cudagraphs --anchor-graph auto --anchor-opt compiled] [--profile] [--name lm_anchor]
    ... --config transformer_long --shapes native      # the 32k config against its dense twin (the anchor
                                                       # refuses activation checkpointing: its row says so)
    PYTHONPATH=$PWD python scripts/bench/bench_lm_anchor.py --cpu-smoke --out /tmp/x     # CI: tiny, on the CPU

Whole training steps of three models on one random byte batch (transformer_enwik8's, 4 x 8192), bf16
autocast, AdamW (lr, betas, eps, weight decay on matrices only, as the trainer's) and global-norm
clipping (optim.grad_clip, 1.0):

- anchor: the plain-PyTorch GPT between the ``ANCHOR`` rulers below (about 60 lines): the same shapes
  as bstrain's transformer (pre-LN blocks with biases, rotary q/k with bstrain's tables, exact GELU
  FFN x4, untied head with bias, the same init), attention through FlexAttention with a
  ``create_block_mask`` of the SAME element masks bstrain's layers use (``--anchor-mask layers``:
  ``local,fixed`` w1024 s64 cycled over the layers) or a causal sliding window of 1024 on every
  layer (``window``, the issue's 1.45M figure); the loss inside the compiled forward (as nanoGPT does).
  By default at its strongest (issue 41; every choice is recorded in each anchor row's ``anchor``):
  the model under ``torch.compile(mode="max-autotune-no-cudagraphs")``, clipping and fused capturable
  AdamW under ``torch.compile`` too, the whole step in one manual CUDA graph (``--compile max-autotune``
  lets torch.compile graph instead), one anchor per Flex BlockMask size of ``--flex-block`` (128, 64)
  and backend (FLASH where flash-attn-4 imports, else Triton; the table says which): the ratios name the
  fastest as the strongest anchor; ``--profile`` splits each step's GPU time into GEMM, attention, glue;
- bstrain: ``python -m bstrain train config=transformer_enwik8`` as the CLI runs it: the trainer's
  own ``build()`` (CUDA graph of the whole step, fused glue, fused capturable AdamW) and
  ``one_step()`` on our batch;
- dense twin: the same with ``model.attention=dense`` (SDPA).

Shapes: D64 (d_model 512, 8 heads) and D128 (d_model 1024, 8 heads); all else from transformer_enwik8.
Each step is warmed up first (compilation and graph capture excluded), then ``--windows`` windows of
``--steps`` whole steps each are timed with CUDA events, round-robin over the three so that clock
drift hits all alike, the device idle before each window. tokens/s: the median window. Ratios:
bstrain / anchor (target 1.25, at equal live-block density: ``layers``; Flex's BLOCK_SIZE is 128
by default, bstrain's block 64, so the same element mask covers more Flex blocks: ``--flex-block
128,64`` times both granularities) and bstrain / dense twin
(target 1.8, for transformer_enwik8 as shipped: D64). Writes lm_anchor.md and lm_anchor.json to --out
after each shape. The anchors start from bstrain sparse's initial weights (loaded strictly: the same
parameters), so on the same masks their step-1 loss must match bstrain's to bf16 noise; the report
flags it where not. --cpu-smoke also checks in fp32 that bstrain's model, the anchor with Flex
(forward) and the anchor with SDPA and a dense mask give the same loss.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench import _flex  # noqa: E402
from scripts.bench._anchor import AnchorGPT, anchor_masks, anchor_name, make_anchor  # noqa: E402
from scripts.bench.bench_lstm import config  # noqa: E402

BASE = ["config=transformer_enwik8", "trainer.precision=bf16", "trainer.progress=false", "data.name=bytes"]
SHAPES = {"D64": ["model.d_model=512", "model.n_head=8"], "D128": ["model.d_model=1024", "model.n_head=8"],
          "native": []}                # the --config as shipped (e.g. --config transformer_long --shapes native)
SMOKE = ["model.d_model=64", "model.n_head=2", "model.n_layer=2", "model.context=256", "model.block_size=32",
         "model.window=64", "model.summary=16", "data.seq_len=256", "data.batch_size=2", "trainer.device=cpu"]
TARGET_VS_ANCHOR, TARGET_VS_DENSE, DENSE_TARGET_SHAPE = 1.25, 1.8, "D64"
LOSS_TOLERANCE = 2e-3           # first-step loss, anchor (layers) vs bstrain sparse: beyond bf16 noise


def make_bstrain(cfg, x, y, dense: bool):
    """(step(), info): bstrain's step as ``python -m bstrain train`` runs it: the trainer's build() and
    one_step() (a CUDA graph of the whole step on a GPU: trainer.cuda_graph=auto), on our batch."""
    from bstrain.train import trainer
    from bstrain.train.distributed import World
    trainer.check_config(cfg)
    trainer.set_threads(cfg.trainer.threads)
    run = trainer.build(cfg, Path(cfg.trainer.run_dir), trainer.resolve_device(cfg.trainer.device), World())

    def step():
        loss = trainer.one_step(run, x, y, False)[0]
        run.state.step += 1
        return loss
    attn = [float(v.mean()) for k, v in run.model.block_sparse_layouts().items() if k.endswith("attn")]
    m = cfg.model
    info = {"model": "bstrain dense twin" if dense else "bstrain sparse",
            "attention": "dense (SDPA)" if dense else f"bstrain, {m.attention} w{m.window} s{m.summary}",
            "block_size": m.block_size, "live_block_density": sum(attn) / len(attn) if attn else None,
            "params": sum(p.numel() for p in run.model.parameters()), "module": run.model, "run": run}
    return step, info


def candidates(shape: str, overrides: list[str], corpus: Path, work: Path, args, device, x, y) -> dict:
    """{name: () -> (step, info)} of one shape, each on a freshly composed config."""
    def cfg_of(name: str, *more: str):
        return config(*BASE, *overrides, f"data.path={corpus}", f"trainer.run_dir={work / (shape + '_' + name)}",
                      *more)
    out = {anchor_name(mode, blk, backend): (lambda mode=mode, blk=blk, backend=backend: make_anchor(
        cfg_of("anchor"), mode, blk, backend, device, x, y, args))
        for mode in args.anchor_mask.split(",") if mode for backend in args.flex_backends for blk in args.flex_block}
    out["bstrain sparse"] = lambda: make_bstrain(cfg_of("sparse"), x, y, dense=False)
    out["bstrain dense twin"] = lambda: make_bstrain(cfg_of("dense", "model.attention=dense"), x, y, dense=True)
    return out


def random_corpus(path: Path, batch: int, seq: int) -> None:
    """Random bytes, enough for the trainer's 90/5/5 split to hold one batch in each part."""
    n = max(1 << 20, 25 * (batch * seq + 1))
    path.write_bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())


def warm_up(steps: dict, warmup: int, device) -> tuple[dict, dict]:
    """Runs each step ``warmup`` times (compilation, graph capture); ({name: loss of its first
    step}, {name: error}); a candidate that fails here is dropped from ``steps``."""
    first, errors = {}, {}
    for name, fn in list(steps.items()):
        t0 = time.perf_counter()
        try:
            first[name] = float(fn())
            for _ in range(warmup - 1):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:                          # one broken candidate does not lose the others
            errors[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            print(f"  {name}: warm-up failed: {errors[name]}", flush=True)
            del steps[name]
            continue
        print(f"  {name}: warm-up {warmup} steps in {time.perf_counter() - t0:.1f} s, first loss {first[name]:.5f}",
              flush=True)
    return first, errors


def timed_windows(steps: dict, windows: int, per_window: int, device) -> dict:
    """{name: [seconds of each window of per_window steps]}, windows round-robin over the
    candidates (clock drift hits all alike), the device idle before each; CUDA events on a GPU."""
    cuda = device.type == "cuda"
    out = {name: [] for name in steps}
    for _ in range(windows):
        for name, fn in steps.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(per_window):
                fn()
            if cuda:
                end.record()
                end.synchronize()
                out[name].append(start.elapsed_time(end) / 1e3)
            else:
                out[name].append(time.perf_counter() - t0)
    return out


def measure_shape(shape: str, overrides: list[str], args, work: Path) -> list[dict]:
    """The rows (one per candidate) of one shape."""
    cfg = config(*BASE, *overrides)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    corpus = work / f"random_{B}x{T}.bin"
    if not corpus.exists():
        random_corpus(corpus, B, T)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, 256, (B, T), generator=g).to(device)             # (B, T) inputs, shared by all
    y = torch.randint(0, 256, (B, T), generator=g).to(device)             # (B, T) targets
    steps, rows, modules, runs = {}, [], {}, {}
    for name, build in candidates(shape, overrides, corpus, work, args, device, x, y).items():
        row = {"shape": shape, "model": name, "d_model": cfg.model.d_model, "n_head": cfg.model.n_head,
               "head_dim": cfg.model.d_model // cfg.model.n_head, "batch": B, "seq_len": T}
        rows.append(row)
        try:
            steps[name], info = build()
        except Exception as exc:                          # one broken candidate does not lose the others
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            print(f"  {name}: {row['error']}", flush=True)
            continue
        modules[name], runs[name] = info.pop("module"), info.pop("run", None)
        row.update(info)
    try:
        same_start(modules, cfg, x, y, check_forward=args.cpu_smoke)
    except (RuntimeError, AssertionError) as exc:         # on the GPU: measured all the same, and said
        if args.cpu_smoke:
            raise
        print(f"  WARNING: the anchors do not start from bstrain's weights: {' '.join(str(exc).split())[:300]}")
    first, errors = warm_up(steps, args.warmup, device)
    seconds = timed_windows(steps, args.windows, args.steps, device)
    for row in rows:
        name = row["model"]
        if name in errors:
            row["error"] = errors[name]
        if name not in seconds:
            continue
        if runs[name] is not None:                        # the trainer's: graph, or eager where it could not capture
            row["step_mode"] = runs[name].step_mode
        elif "anchor" in row:                             # its optimizer may have fallen back to eager
            row["step_mode"] = "; ".join(f"{row['anchor'][k]}" for k in ("compile", "graph", "optimizer"))
        if args.profile and name in steps:
            row["profile"] = whole_step_profile(steps[name], device)
        rates = [args.steps * B * T / t for t in seconds[name]]
        rate = statistics.median(rates)
        row.update(first_loss=first[name], tokens_per_s=rate, tokens_per_s_windows=rates,
                   ms_per_step=B * T / rate * 1e3)
    del steps, modules, runs
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def whole_step_profile(step, device) -> dict:
    """GPU ms per step split into GEMMs, attention and the rest (the glue), with the largest of the
    rest, from torch.profiler over a few warm steps (bench_transformer_step's split); GPU only."""
    if device.type != "cuda":
        return {"skipped": "GPU only"}
    from scripts.bench.bench_transformer_step import kernel_split
    try:
        return kernel_split(step)
    except Exception as exc:                              # a profile that fails loses no timing
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}


def same_start(modules: dict, cfg, x, y, check_forward: bool) -> None:
    """Loads bstrain sparse's initial weights into each anchor (strict: the same parameters, shapes
    and initial values). check_forward (CPU, fp32): the losses of bstrain's model, the anchor with
    Flex (forward only: no Flex backward on the CPU) and the anchor with SDPA and the dense mask agree."""
    sparse = modules.get("bstrain sparse")
    anchors = [m for name, m in modules.items() if name.startswith("anchor")]
    if sparse is None or not anchors:
        return
    weights = {k.replace(".attn.", "."): v for k, v in sparse.state_dict().items()}
    for anchor in anchors:
        anchor.load_state_dict(weights, strict=True)
    if not check_forward:
        return
    m = cfg.model
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # Flex's eager path warns that it is unfused
        losses = {"bstrain": float(F.cross_entropy(sparse(x).view(-1, 256), y.view(-1)))}
        for label, reference in (("anchor Flex", False), ("anchor SDPA+mask", True)):
            masks, _ = anchor_masks(m, "layers", x.device, m.block_size, reference)
            model = AnchorGPT(m.d_model, m.n_layer, m.n_head, m.context, masks, m.ffn_mult).to(x.device)
            model.load_state_dict(weights, strict=True)
            losses[label] = float(model(x, y))
    if max(losses.values()) - min(losses.values()) > 1e-4:
        raise AssertionError(f"anchor: not the same function as bstrain's model: losses {losses}")
    print("  same function, fp32 loss: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()), flush=True)


def ratios(rows: list[dict]) -> list[dict]:
    """Per shape: bstrain sparse / each anchor, and bstrain sparse / dense twin, with the targets."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == shape and r.get("tokens_per_s")]
        by = {r["model"]: r for r in here}
        sparse, dense = by.get("bstrain sparse"), by.get("bstrain dense twin")
        for mode in dict.fromkeys(r["mode"] for r in here if r["model"].startswith("anchor")):
            best = max((r for r in here if r.get("mode") == mode), key=lambda r: r["tokens_per_s"])
            if sparse:
                v = sparse["tokens_per_s"] / best["tokens_per_s"]
                out.append({"shape": shape, "ratio": f"bstrain sparse / strongest anchor ({mode}): {best['model']}",
                            "value": v, "target": TARGET_VS_ANCHOR, "met": v >= TARGET_VS_ANCHOR,
                            "note": "the fastest anchor configuration of this run"})
        for r in here:
            if r["model"].startswith("anchor") and sparse:
                v = sparse["tokens_per_s"] / r["tokens_per_s"]
                out.append({"shape": shape, "ratio": f"bstrain sparse / {r['model']}", "value": v,
                            "target": TARGET_VS_ANCHOR, "met": v >= TARGET_VS_ANCHOR,
                            "note": "same element masks" if r["mode"] == "layers" else "the issue's window anchor"})
        if sparse and dense:
            v, applies = sparse["tokens_per_s"] / dense["tokens_per_s"], shape == DENSE_TARGET_SHAPE
            out.append({"shape": shape, "ratio": "bstrain sparse / dense twin", "value": v,
                        "target": TARGET_VS_DENSE if applies else None,
                        "met": v >= TARGET_VS_DENSE if applies else None,
                        "note": "transformer_enwik8 as shipped" if applies else "no target at this shape"})
    return out


def loss_check(rows: list[dict]) -> list[str]:
    """Warnings where an anchor on bstrain's masks starts from another loss than bstrain sparse: both
    hold the same weights and batch, so beyond bf16's noise (LOSS_TOLERANCE) they differ in function."""
    out = []
    for r in rows:
        sparse = next((s for s in rows if s["shape"] == r["shape"] and s["model"] == "bstrain sparse"), {})
        a, b = r.get("first_loss"), sparse.get("first_loss")
        if r.get("mode") == "layers" and a is not None and b is not None and abs(a - b) > LOSS_TOLERANCE:
            out.append(f"**check {r['shape']}, {r['model']}**: first-step loss {a:.5f}, bstrain sparse's {b:.5f} "
                       f"(apart by more than {LOSS_TOLERANCE}): it may not compute bstrain's function")
    return out


def machine() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "host": platform.node(), "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in sys.argv)}


def report(rows: list[dict], meta: dict, out: str, cpu: bool, name: str = "lm_anchor") -> str:
    """Writes NAME.md (returned) and NAME.json to ``out``."""
    lines = ["# bstrain's sparse LM step against the plain-PyTorch + Flex + compile anchor (issue 33)", "",
             f"{meta['device']} on {meta['host']}, torch {meta['torch']}, triton {meta['triton']}, Python "
             f"{meta['python']}, {meta['date']}. Command: `{meta['command']}`", "",
             "`scripts/bench/bench_lm_anchor.py`: whole training steps (forward, loss, backward, clip, AdamW), bf16 "
             "autocast, one random byte batch for all, transformer_enwik8's settings; tokens/s: median of the timed "
             f"windows ({'perf_counter, CPU' if cpu else 'CUDA events'}) after warm-up (compile, graph capture). Live "
             "blocks: mean over layers of live / all (q, k) blocks at each side's block size (Flex: its BlockMask). "
             "The anchors start from bstrain sparse's weights: on the same masks their step-1 loss should match it "
             "to bf16 noise.", "",
             "| shape | model | attention | block | live blocks | step | loss at step 1 | ms/step | tokens/s "
             "| windows min-max |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['model']} | failed: {r['error'][:160]} | | | | | | | |")
            continue
        dens = "-" if r.get("live_block_density") is None else f"{r['live_block_density']:.3f}"
        w = r.get("tokens_per_s_windows") or [math.nan]
        lines.append(f"| {r['shape']} | {r['model']} | {r['attention']} | {r['block_size']} | {dens} | "
                     f"{r.get('step_mode', '-')} | {r.get('first_loss', math.nan):.4f} | "
                     f"{r.get('ms_per_step', math.nan):.2f} | {r.get('tokens_per_s', math.nan):,.0f} | "
                     f"{min(w):,.0f}-{max(w):,.0f} |")
    lines += ["", "| shape | ratio | value | target | met | note |", "|---|---|---|---|---|---|"]
    for q in ratios(rows):
        met = "-" if q["met"] is None else ("met" if q["met"] else "missed")
        target = "-" if q["target"] is None else f">= {q['target']}"
        lines.append(f"| {q['shape']} | {q['ratio']} | {q['value']:.3f}x | {target} | {met} | {q['note']} |")
    checks = loss_check(rows)
    lines += ([""] + checks) if checks else []
    lines += ["", f"Anchor choices: {meta['anchor']}; Flex backend: {meta['flash']}."] + profile_lines(rows)
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    Path(out, f"{name}.md").write_text(text)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "ratios": ratios(rows), "checks": checks}, f, indent=1)
    return text


def profile_lines(rows: list[dict]) -> list[str]:
    """The whole-step profile table (--profile): GPU ms per step by kind, the largest glue kernels."""
    got = [r for r in rows if isinstance(r.get("profile"), dict) and "gpu_ms" in r["profile"]]
    if not got:
        return []
    lines = ["", "Whole-step GPU time (torch.profiler, ms per step):", "",
             "| shape | model | GEMM | attention | glue | GPU total | largest glue kernels |", "|---|---|---|---|---|---|---|"]
    for r in got:
        p = r["profile"]
        top = "; ".join(f"{n[:40]} {ms}" for n, ms in p["top_other"][:3])
        lines.append(f"| {r['shape']} | {r['model']} | {p['gemm_ms']:.2f} | {p['attention_ms']:.2f} | "
                     f"{p['other_ms']:.2f} | {p['gpu_ms']:.2f} | {top} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--config", default="transformer_enwik8", help="the shipped config the shapes override")
    ap.add_argument("--shapes", default="D64,D128", help="comma-separated names of SHAPES")
    ap.add_argument("--anchor-mask", default="layers",
                    help="comma list of: layers (bstrain's element masks, per layer), window (a causal window of "
                         "model.window on every layer: the issue's 1.45M figure)")
    ap.add_argument("--flex-block", default="128,64",
                    help="create_block_mask's BLOCK_SIZE, a comma list: each is an anchor; the fastest is the "
                         "strongest (a size whose step does not compile is recorded as failed)")
    ap.add_argument("--flex-backend", default="auto",
                    help="auto (FLASH where flash-attn-4 imports, then Triton: each an anchor), flash or triton")
    ap.add_argument("--compile", default="max-autotune-no-cudagraphs",
                    help="torch.compile mode of the anchor's model and update: max-autotune-no-cudagraphs (with "
                         "--anchor-graph: one graph of the whole step), max-autotune (its own CUDA graphs), "
                         "default, ...; '' for none")
    ap.add_argument("--anchor-graph", choices=["auto", "on", "off"], default="auto",
                    help="a manual CUDA graph of the whole step (auto: on a GPU where --compile does not graph)")
    ap.add_argument("--anchor-opt", choices=["compiled", "eager"], default="compiled",
                    help="clipping and AdamW (fused, capturable) under torch.compile, or eager")
    ap.add_argument("--profile", action="store_true", help="GPU time per step of each candidate: GEMM, attention, "
                                                          "glue (torch.profiler)")
    ap.add_argument("--name", default="lm_anchor", help="the report's file name, without extension")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per candidate (compile, capture)")
    ap.add_argument("--windows", type=int, default=7, help="timed windows per candidate (median reported)")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--override", action="append", default=[], help="a Hydra override for all (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, uncompiled: checks the script")
    args = ap.parse_args()
    BASE[0] = f"config={args.config}"
    args.flex_block = [int(b) for b in args.flex_block.split(",") if b]
    args.flex_backends = _flex.backends(args.flex_backend)
    if args.cpu_smoke:                                   # uncompiled: a CPU compile takes minutes
        args.compile, args.warmup, args.windows, args.steps, args.flex_block = "", 1, 2, 2, [32]
        args.flex_backends = ["TRITON"]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_lm_anchor: no CUDA device (--cpu-smoke runs the CPU check)")
    from bstrain.train.progress import remove_logging, setup_logging
    handlers = setup_logging(None)                      # the trainer's own lines (graph capture or not)
    meta, rows, text = machine(), [], ""
    meta["flash"] = _flex.flash_status()[1]
    meta["anchor"] = {"compile": args.compile or "none", "graph": args.anchor_graph, "optimizer": args.anchor_opt,
                      "flex_blocks": args.flex_block, "flex_backends": args.flex_backends}
    shapes = {"smoke": SMOKE} if args.cpu_smoke else {s: SHAPES[s] for s in args.shapes.split(",") if s}
    try:
        with tempfile.TemporaryDirectory(prefix="bstrain-lm-anchor-") as work:
            for shape, overrides in shapes.items():
                print(f"{shape}:", flush=True)
                rows += measure_shape(shape, overrides + args.override, args, Path(work))
                text = report(rows, meta, args.out, args.cpu_smoke, args.name)   # a timeout keeps each shape
    finally:
        remove_logging(handlers)
    print(text, flush=True)


if __name__ == "__main__":
    main()
