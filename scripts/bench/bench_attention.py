"""Block-sparse attention against dense SDPA (causal) and FlexAttention on the same block mask,
in one run.

    PYTHONPATH=$PWD python scripts/bench/bench_attention.py [--out DIR] [--name attention] [--seq 4096,16384,65536]
        [--dims 64,128] [--block 64,128] [--tokens 65536 | --batch B] [--layouts causal,local,...] [--cpu-smoke]

For each layout (causal, local, strided, fixed, bigbird; longglobal: a 1024 window and 256 global
positions, for long contexts), context S, head dim D and block size (B = tokens / S, H=16, bf16):
forward and forward+backward times (medians of triton.testing.do_bench) of
  bstrain        BlocksparseTransformer(backend="triton").attention
  sdpa           F.scaled_dot_product_attention(is_causal=True), dense causal
  flex           torch.compile(flex_attention) with create_block_mask of the same mask function
                 (64-blocks: Flex's tiles set to 64 and below, which its kernels need)
the ideal speedup over dense causal (causal live blocks / the layout's live blocks), effective
TFLOP/s over the live pairs, and the peak memory of one forward+backward. Writes NAME.md and
NAME.json to --out, rewritten after every row (a cut-off run keeps what it measured).
--cpu-smoke runs tiny sizes on the CPU (fp32, bstrain's PyTorch path, no Flex) to check the script.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as L  # noqa: E402
from bstrain.ops.transformer import BlocksparseTransformer  # noqa: E402
from scripts._timing import bench, environment, write_report  # noqa: E402


def masks(S: int, bs: int):
    """The layouts' element masks at context S for blocks of bs (BigBird's random blocks are drawn
    at that granularity, seed 0)."""
    w = max(128, S // 32)                       # window / stride: 1/32 of the context, at least one block
    n = S // bs
    return {"causal": L.causal_mask, "local": L.local_mask(4 * w), "strided": L.strided_mask(w),
            "fixed": L.fixed_mask(w, summary=w // 8),
            "bigbird": L.bigbird_mask(bs, 3, 2, 3, n, n, seed=0, causal=True),
            "longglobal": L.longformer_mask(1024, 256, causal=True)}        # a 1024 window + 256 global positions


def inputs(B: int, S: int, H: int, D: int, dev, dt):
    """(q, k, v, g) as (B, S, H·D) for bstrain, and (qh, kh, vh, gh) as (B, H, S, D) copies for SDPA/Flex."""
    q, k, v = (torch.randn(B, S, H * D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(B, S, H * D, device=dev, dtype=dt)
    qh, kh, vh = (t.detach().view(B, S, H, D).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    gh = g.view(B, S, H, D).transpose(1, 2).contiguous()
    return (q, k, v, g), (qh, kh, vh, gh)


def fwd_bwd(attn, q, k, v, g):
    def step():
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), g)
    return step


def peak_mib(fn, smoke: bool) -> float | None:
    """Peak memory allocated by one call of fn over what was allocated before it, in MiB."""
    if smoke:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


def live_pairs(op) -> int:
    """(query, key) pairs the layout keeps, summed over its heads: full blocks count bs², partial
    ones their element masks."""
    t = op._tables.host
    return int(t.tiles.sum((1, 2))[t.tile_of].sum())


FLEX_TILES = {64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64)}
PEAK = 989.0            # H200 dense bf16 TFLOP/s, the datasheet's (the ceiling the TFLOP/s columns are read against)


def measure(args, emit) -> list[dict]:
    smoke = args.cpu_smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    H = args.heads
    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    rows = []
    for S in args.seq:
        B = args.batch or max(1, args.tokens // S)
        for D in args.dims:
            (q, k, v, g), (qh, kh, vh, gh) = inputs(B, S, H, D, dev, dt)
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)   # noqa: E731
            dense = {"fwd": bench(lambda: sdpa(qh, kh, vh), smoke),
                     "fb": bench(fwd_bwd(sdpa, qh, kh, vh, gh), smoke)}
            for bs in args.block:
                for row in _layouts(args, S, B, D, bs, q, k, v, g, qh, kh, vh, gh, dense, smoke, dev):
                    rows.append(row)
                    emit(rows)
            del q, k, v, g, qh, kh, vh, gh
            if not smoke:
                torch.cuda.empty_cache()
    return rows


def _layouts(args, S, B, D, bs, q, k, v, g, qh, kh, vh, gh, dense, smoke, dev):
    """The rows of one (S, D, block size): each layout against the dense causal times `dense`."""
    H = args.heads
    n = S // bs
    causal_blocks = n * (n + 1) // 2                           # a causal layout's live blocks
    for name, mask in masks(S, bs).items():
        if name not in args.layouts.split(","):
            continue
        lay, cb = L.attention_layout(mask, S, S, bs)
        live = int(lay.sum())
        op = BlocksparseTransformer(lay, bs, heads=H, mask_callback=cb, backend="torch" if smoke else "triton")
        flops = 4.0 * B * live_pairs(op) * D                    # forward: two products over the live pairs
        row = dict(layout=name, S=S, D=D, B=B, H=H, block=bs, live_frac=round(live / lay.size, 4),
                   ideal=round(causal_blocks / live, 2), sdpa_fwd_ms=round(dense["fwd"], 3),
                   sdpa_fb_ms=round(dense["fb"], 3))
        attn = lambda a, b, c: op.attention(a, b, c)            # noqa: E731
        row["ours_fwd_ms"] = round(bench(lambda: op.attention(q, k, v), smoke), 3)
        row["ours_fb_ms"] = round(bench(fwd_bwd(attn, q, k, v, g), smoke), 3)
        row["ours_peak_mib"] = peak_mib(fwd_bwd(attn, q, k, v, g), smoke)
        if not smoke:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                # _compile: the mask is built block by block, not as an S x S tensor (128 GiB at S=128k)
                bm = create_block_mask(mask, B=None, H=None, Q_LEN=S, KV_LEN=S, BLOCK_SIZE=bs, device=dev,
                                       _compile=True)
                flex = torch.compile(flex_attention)
                opts = FLEX_TILES.get(bs)
                fl = lambda a, b, c: flex(a, b, c, block_mask=bm, kernel_options=opts)   # noqa: E731
                row["flex_fwd_ms"] = round(bench(lambda: fl(qh, kh, vh), smoke), 3)
                row["flex_fb_ms"] = round(bench(fwd_bwd(fl, qh, kh, vh, gh), smoke), 3)
                row["flex_peak_mib"] = peak_mib(fwd_bwd(fl, qh, kh, vh, gh), smoke)
            except Exception as exc:                            # a failure is a result too
                row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        for pas in ("fwd", "fb"):
            ours = row[f"ours_{pas}_ms"]
            row[f"speedup_{pas}"] = round(row[f"sdpa_{pas}_ms"] / ours, 2)
            row[f"frac_ideal_{pas}"] = round(row[f"speedup_{pas}"] / row["ideal"], 2)
            if row.get(f"flex_{pas}_ms"):
                row[f"vs_flex_{pas}"] = round(row[f"flex_{pas}_ms"] / ours, 2)
                row[f"flex_frac_ideal_{pas}"] = round(row[f"sdpa_{pas}_ms"] / row[f"flex_{pas}_ms"] / row["ideal"], 2)
        # effective TFLOP/s on the live pairs: forward 2 products, backward 5
        row["tflops_fwd"] = round(flops / row["ours_fwd_ms"] / 1e9, 1)
        bwd_ms = row["ours_fb_ms"] - row["ours_fwd_ms"]
        row["tflops_bwd"] = round(2.5 * flops / bwd_ms / 1e9, 1) if bwd_ms > 0 else None
        if row.get("flex_fwd_ms"):
            row["flex_tflops_fwd"] = round(flops / row["flex_fwd_ms"] / 1e9, 1)
        yield row
        print(row, flush=True)


COLUMNS = [("layout", "layout"), ("S", "S"), ("D", "D"), ("block", "block"), ("B", "B"), ("live", "live_frac"),
           ("ideal", "ideal"), ("ours fwd ms", "ours_fwd_ms"), ("ours f+b ms", "ours_fb_ms"),
           ("SDPA fwd ms", "sdpa_fwd_ms"), ("SDPA f+b ms", "sdpa_fb_ms"), ("Flex fwd ms", "flex_fwd_ms"),
           ("Flex f+b ms", "flex_fb_ms"), ("vs Flex fwd", "vs_flex_fwd"), ("vs Flex f+b", "vs_flex_fb"),
           ("frac ideal fwd", "frac_ideal_fwd"), ("frac ideal f+b", "frac_ideal_fb"),
           ("Flex frac ideal f+b", "flex_frac_ideal_fb"), ("TFLOP/s fwd", "tflops_fwd"), ("TFLOP/s bwd", "tflops_bwd"),
           ("Flex TFLOP/s fwd", "flex_tflops_fwd"), ("peak MiB", "ours_peak_mib"), ("Flex peak MiB", "flex_peak_mib")]


def report(rows: list[dict], extra: dict, out: str, name: str, quiet: bool = False) -> None:
    blocks = ",".join(str(b) for b in sorted({r["block"] for r in rows}))
    lines = [f"# Block-sparse attention: {extra['device']}, {extra['date']}", "",
             f"torch {extra['torch']}, triton {extra.get('triton', '-')}; `{extra['command']}`; H={rows[0]['H']}, "
             f"blocks {blocks}, bf16; medians of triton.testing.do_bench. ideal = causal live blocks / live blocks; "
             "frac ideal = (SDPA causal time / ours) / ideal; vs Flex = Flex time / ours (same block mask, "
             "torch.compile(flex_attention)). TFLOP/s: the products over the live (query, key) pairs only "
             f"(forward 2, backward 5), against the dense bf16 peak of {PEAK:.0f}. peak MiB: memory allocated "
             "by one forward+backward over the inputs.", "",
             "| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(key, "-")) for _, key in COLUMNS) + " |")
    errors = sorted({r["flex_error"] for r in rows if r.get("flex_error")})
    if errors:
        lines += ["", "FlexAttention errors:", *[f"- `{e}`" for e in errors]]
    write_report(out, name, lines, {"rows": rows, **extra}, quiet)


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--name", default="attention", help="the report's file name, without extension")
    ap.add_argument("--seq", type=ints, default=[4096, 16384, 65536])
    ap.add_argument("--dims", type=ints, default=[64, 128])
    ap.add_argument("--tokens", type=int, default=65536, help="batch = tokens / S (at least 1)")
    ap.add_argument("--batch", type=int, default=0, help="a fixed batch instead of --tokens")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block", type=ints, default=[128], help="layout block sizes, e.g. 64,128")
    ap.add_argument("--layouts", default="causal,local,strided,fixed,bigbird")
    ap.add_argument("--tiles", help="a tune_attention.json whose best tiles to use")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.tiles:
        from scripts.tune.tune_attention import apply
        apply(args.tiles)
    if args.cpu_smoke:
        args.seq, args.dims, args.batch, args.heads, args.block = [256], [16], 1, 2, [32]
    os.makedirs(args.out, exist_ok=True)
    extra = {**environment(args.cpu_smoke, triton=True),
             "command": "python scripts/bench/bench_attention.py " + " ".join(sys.argv[1:])}
    rows = measure(args, lambda rows: report(rows, extra, args.out, args.name, quiet=True))
    report(rows, extra, args.out, args.name)


if __name__ == "__main__":
    main()
