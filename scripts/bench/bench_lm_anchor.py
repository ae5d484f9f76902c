"""bstrain's sparse LM step against what a user would write instead (issue 33), side by side on one GPU.

    bash ../shared/tools/device-wheels.sh          # here, once: hydra's wheels into .whl (carry .whl)
    . scripts/gpu/gpu_env.sh && python3 scripts/bench/bench_lm_anchor.py --out $OUT [--shapes D64,D128]
        [--anchor-mask layers,window] [--flex-block 128,64] [--windows 7 --steps 10 --warmup 5]
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
  layer (``window``, the issue's 1.45M figure), the whole model under ``torch.compile``, fused
  AdamW; the loss inside the compiled forward (as nanoGPT does);
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
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.bench.bench_lstm import config  # noqa: E402

BASE = ["config=transformer_enwik8", "trainer.precision=bf16", "trainer.progress=false", "data.name=bytes"]
SHAPES = {"D64": ["model.d_model=512", "model.n_head=8"], "D128": ["model.d_model=1024", "model.n_head=8"],
          "native": []}                # the --config as shipped (e.g. --config transformer_long --shapes native)
SMOKE = ["model.d_model=64", "model.n_head=2", "model.n_layer=2", "model.context=256", "model.block_size=32",
         "model.window=64", "model.summary=16", "data.seq_len=256", "data.batch_size=2", "trainer.device=cpu"]
TARGET_VS_ANCHOR, TARGET_VS_DENSE, DENSE_TARGET_SHAPE = 1.25, 1.8, "D64"
LOSS_TOLERANCE = 2e-3           # first-step loss, anchor (layers) vs bstrain sparse: beyond bf16 noise


# ================================ ANCHOR: what a user writes instead ================================
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos, sin (T, D/2): rotary positions, the halves turned (bstrain's convention)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class AnchorBlock(nn.Module):
    def __init__(self, d: int, heads: int, ffn_mult: int, mask):
        super().__init__()
        self.heads, self.mask = heads, mask       # a Flex BlockMask, or a (1|H, T, T) bool mask (SDPA, CPU)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn_mult * d), nn.Linear(ffn_mult * d, d)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rope(q, cos, sin), rope(k, cos, sin)                                  # (B, H, T, D)
        if isinstance(self.mask, torch.Tensor):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        else:
            a = flex_attention(q, k, v, block_mask=self.mask)
        h = h + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class AnchorGPT(nn.Module):
    """Byte-level GPT: ``forward(x, y) -> mean cross-entropy``, x and y (B, T) bytes; masks cycle over layers."""

    def __init__(self, d: int, n_layer: int, heads: int, context: int, masks: list, ffn_mult: int = 4):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(AnchorBlock(d, heads, ffn_mult, masks[i % len(masks)]) for i in range(n_layer))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 256)
        half = d // heads // 2
        ang = torch.arange(context, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half).double() / half)
        self.register_buffer("cos", ang.cos().float(), persistent=False)                # (context, D/2)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.02)
            for blk in self.blocks:
                blk.proj.weight.mul_(1 / math.sqrt(2 * n_layer))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, T = self.embed(x), x.shape[1]
        for blk in self.blocks:
            h = blk(h, self.cos[:T], self.sin[:T])
        return F.cross_entropy(self.head(self.norm(h)).view(-1, 256).float(), y.view(-1))


def anchor_train_step(model, params, opt, x, y, grad_clip: float, amp: torch.dtype | None) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf)           # 0: no clipping, as bstrain
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
# ============================================ end of ANCHOR ===========================================


def anchor_masks(m, mode: str, device: torch.device, flex_block: int, reference: bool) -> tuple[list, float]:
    """(one mask per distinct layer entry, mean live-block density over the layers). mode 'layers':
    bstrain's element masks (its pattern_mask of each layer's entry); 'window': a causal window of
    model.window on every layer. reference: (1|H, T, T) bool masks for SDPA instead of BlockMasks."""
    from bstrain import layout as layouts
    from bstrain.models.transformer import pattern_mask
    T = m.context
    entries = [e.strip() for e in m.attention.split(",")] if mode == "layers" else ["window"]
    masks, dens = [], []
    for entry in entries:
        fn = layouts.local_mask(m.window) if entry == "window" else pattern_mask(entry, m.window, m.summary)
        heads = m.n_head if "+" in entry else None
        bm = create_block_mask(fn, None, heads, T, T, device=device, BLOCK_SIZE=flex_block)
        dens.append(1 - bm.sparsity() / 100)
        masks.append(create_mask(fn, 1, heads or 1, T, T, device=device)[0] if reference else bm)
    per_layer = [dens[i % len(dens)] for i in range(m.n_layer)]
    return masks, sum(per_layer) / len(per_layer)


def make_anchor(cfg, mode: str, flex_block: int, device, x, y, compile_mode: str):
    """(step(), info) of the anchor at cfg's model shape, precision and optimizer settings. On the
    CPU its attention is SDPA with the dense mask (Flex has no backward there)."""
    from bstrain.train.trainer import PRECISIONS
    m, o = cfg.model, cfg.optim
    amp = PRECISIONS[getattr(cfg.trainer.precision, "value", cfg.trainer.precision)]
    if amp == torch.float16:
        raise ValueError("the anchor runs bf16 or fp32 (fp16 would need a GradScaler)")
    if m.get("dropout", 0) or m.get("checkpoint", False) or m.get("ffn_density", 1.0) < 1 or m.positions != "rotary":
        raise ValueError("the anchor has rotary positions, a dense FFN, no dropout and no activation checkpointing: "
                         "compare it at those settings")
    cuda = device.type == "cuda"
    masks, density = anchor_masks(m, mode, device, flex_block, reference=not cuda)
    torch.manual_seed(cfg.trainer.seed)
    model = AnchorGPT(m.d_model, m.n_layer, m.n_head, m.context, masks, m.ffn_mult).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True if cuda else None,
                            foreach=None if cuda else True)
    net = torch.compile(model, mode=None if compile_mode == "default" else compile_mode) if compile_mode else model
    params = list(model.parameters())
    what = f"{m.attention} w{m.window} s{m.summary}" if mode == "layers" else f"window {m.window}"
    info = {"model": f"anchor ({mode}, Flex block {flex_block})", "mode": mode,
            "attention": f"Flex, {what}" if cuda else f"SDPA + dense mask, {what} (CPU)", "block_size": flex_block,
            "live_block_density": density, "params": sum(p.numel() for p in params), "module": model,
            "step_mode": f"eager, torch.compile mode={compile_mode}" if compile_mode else "eager, uncompiled"}
    return (lambda: anchor_train_step(net, params, opt, x, y, o.grad_clip, amp)), info


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
        run.step += 1
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
    out = {f"anchor ({mode}, Flex block {blk})": (lambda mode=mode, blk=blk: make_anchor(
        cfg_of("anchor"), mode, blk, device, x, y, args.compile))
        for mode in args.anchor_mask.split(",") if mode for blk in args.flex_block}
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


def report(rows: list[dict], meta: dict, out: str, cpu: bool) -> str:
    """Writes lm_anchor.md (returned) and lm_anchor.json to ``out``."""
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
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    Path(out, "lm_anchor.md").write_text(text)
    with open(os.path.join(out, "lm_anchor.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "ratios": ratios(rows), "checks": checks}, f, indent=1)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--config", default="transformer_enwik8", help="the shipped config the shapes override")
    ap.add_argument("--shapes", default="D64,D128", help="comma-separated names of SHAPES")
    ap.add_argument("--anchor-mask", default="layers",
                    help="comma list of: layers (bstrain's element masks, per layer), window (a causal window of "
                         "model.window on every layer: the issue's 1.45M figure)")
    ap.add_argument("--flex-block", default="128", help="create_block_mask's BLOCK_SIZE, a comma list (Flex: 128)")
    ap.add_argument("--compile", default="default",
                    help="torch.compile mode of the anchor: default, max-autotune-no-cudagraphs, ...; '' for none")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per candidate (compile, capture)")
    ap.add_argument("--windows", type=int, default=7, help="timed windows per candidate (median reported)")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--override", action="append", default=[], help="a Hydra override for all (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, uncompiled: checks the script")
    args = ap.parse_args()
    BASE[0] = f"config={args.config}"
    args.flex_block = [int(b) for b in args.flex_block.split(",") if b]
    if args.cpu_smoke:
        args.compile, args.warmup, args.windows, args.steps, args.flex_block = "", 1, 2, 2, [32]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_lm_anchor: no CUDA device (--cpu-smoke runs the CPU check)")
    from bstrain.train.progress import remove_logging, setup_logging
    handlers = setup_logging(None)                      # the trainer's own lines (graph capture or not)
    meta, rows, text = machine(), [], ""
    shapes = {"smoke": SMOKE} if args.cpu_smoke else {s: SHAPES[s] for s in args.shapes.split(",") if s}
    try:
        with tempfile.TemporaryDirectory(prefix="bstrain-lm-anchor-") as work:
            for shape, overrides in shapes.items():
                print(f"{shape}:", flush=True)
                rows += measure_shape(shape, overrides + args.override, args, Path(work))
                text = report(rows, meta, args.out, args.cpu_smoke)   # after each shape: a timeout keeps it
    finally:
        remove_logging(handlers)
    print(text, flush=True)


if __name__ == "__main__":
    main()
