"""Block-sparse attention against dense SDPA (causal) and FlexAttention on the same block mask,
in one run.

    PYTHONPATH=$PWD python scripts/bench/bench_attention.py [--out DIR] [--name attention] [--seq 4096,16384,65536]
        [--dims 64,128] [--block 64,128] [--tokens 65536 | --batch B] [--layouts causal,local,...] [--cpu-smoke]
        [--flex-blocks 128,64] [--flex-backend auto|flash|triton] [--flex-compile max-autotune] [--no-strong-flex]

For each layout (causal, local, strided, fixed, bigbird; longglobal: a 1024 window and 256 global
positions, for long contexts), context S, head dim D and block size (B = tokens / S, H=16, bf16):
forward and forward+backward times (medians of triton.testing.do_bench) of
  bstrain        BlocksparseTransformer(backend="triton").attention
  sdpa           F.scaled_dot_product_attention(is_causal=True), dense causal, torch's default choice
  sdpa_cudnn     the same with the cuDNN backend forced (sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
  flex           torch.compile(flex_attention) with create_block_mask of the same mask function
                 (64-blocks: Flex's tiles set to 64 and below, which its kernels need)
  flex_strong    Flex at its strongest (issue 41): compiled with --flex-compile (max-autotune), each
                 BlockMask size of --flex-blocks and each backend (FLASH where flash-attn-4 imports,
                 then Triton) tried, the fastest forward+backward kept; the row records which, and
                 every configuration tried with its time or error
the ideal speedup over dense causal (causal live blocks / the layout's live blocks), effective
TFLOP/s over the live pairs, and the peak memory of one forward+backward. Windows and strides are
S/32 and at least two blocks (at S=4k with blocks of 128 a one-block stride is all causal). Writes
NAME.md and NAME.json to --out, rewritten after every row (a cut-off run keeps what it measured).
--cpu-smoke runs tiny sizes on the CPU (fp32, bstrain's PyTorch path, no Flex, no cuDNN) to check the script.
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
from scripts.bench import _flex  # noqa: E402


def window(S: int, bs: int) -> int:
    """The window / stride of the layouts: 1/32 of the context, at least two blocks (one block of
    stride keeps every causal block: a strided layout that is all causal measures nothing)."""
    return max(2 * bs, S // 32)


def masks(S: int, bs: int):
    """The layouts' element masks at context S for blocks of bs (BigBird's random blocks are drawn
    at that granularity, seed 0)."""
    w = window(S, bs)
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
                     "fb": bench(fwd_bwd(sdpa, qh, kh, vh, gh), smoke), **cudnn_times(qh, kh, vh, gh, smoke)}
            for bs in args.block:
                for row in _layouts(args, S, B, D, bs, q, k, v, g, qh, kh, vh, gh, dense, smoke, dev):
                    rows.append(row)
                    emit(rows)
            del q, k, v, g, qh, kh, vh, gh
            if not smoke:
                torch.cuda.empty_cache()
    return rows


def cudnn_times(qh, kh, vh, gh, smoke: bool) -> dict:
    """{"cudnn_fwd", "cudnn_fb"} ms of dense causal SDPA with the cuDNN backend forced, or
    {"cudnn_error"} where it cannot run (and {} on the CPU, which has no cuDNN attention)."""
    if smoke:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)
    try:
        return {"cudnn_fwd": bench(lambda: sdpa(qh, kh, vh)), "cudnn_fb": bench(fwd_bwd(sdpa, qh, kh, vh, gh))}
    except Exception as exc:                                    # a failure is a result too
        return {"cudnn_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def flex_call(mask, S: int, B: int, block: int, backend: str, compile_mode: str | None, dev):
    """(attention(q, k, v), the record of its configuration): Flex on ``mask`` at BlockMask size
    ``block``, compiled with ``compile_mode`` (None: torch.compile's default)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # _compile: the mask is built block by block, not as an S x S tensor (128 GiB at S=128k)
    bm = create_block_mask(mask, B=None, H=None, Q_LEN=S, KV_LEN=S, BLOCK_SIZE=block, device=dev, _compile=True)
    flex = torch.compile(flex_attention, mode=compile_mode)
    opts = _flex.kernel_options(block, backend)
    return (lambda a, b, c: flex(a, b, c, block_mask=bm, kernel_options=opts)), _flex.describe(block, backend,
                                                                                                  compile_mode)


def plain_flex(mask, S, B, bs, dev, qh, kh, vh, gh) -> dict:
    """Flex as the issue-33 rows ran it: default compile, Triton, the layout's block size."""
    try:
        fl, _ = flex_call(mask, S, B, bs, "TRITON", None, dev)
        return {"flex_fwd_ms": round(bench(lambda: fl(qh, kh, vh)), 3),
                "flex_fb_ms": round(bench(fwd_bwd(fl, qh, kh, vh, gh)), 3),
                "flex_peak_mib": peak_mib(fwd_bwd(fl, qh, kh, vh, gh), False)}
    except Exception as exc:                                    # a failure is a result too
        return {"flex_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def strong_flex(args, mask, S, B, dev, qh, kh, vh, gh) -> dict:
    """The fastest forward+backward over --flex-backend's backends and --flex-blocks, compiled with
    --flex-compile; every configuration tried is recorded with its ms or its error."""
    tried, best = {}, None
    for backend in _flex.backends(args.flex_backend):
        for block in args.flex_blocks:
            key = f"{backend} {block}"
            try:
                fl, info = flex_call(mask, S, B, block, backend, args.flex_compile or None, dev)
                fb = bench(fwd_bwd(fl, qh, kh, vh, gh))
            except Exception as exc:                            # e.g. no backward at 64, FLASH refusing a mask
                tried[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                continue
            tried[key] = round(fb, 3)
            if best is None or fb < best[0]:
                best = (fb, fl, info)
    out = {"flex_strong_tried": tried, "flex_strong_flash": _flex.flash_status()[1]}
    if best is None:
        return out
    fb, fl, info = best
    out.update(flex_strong_fwd_ms=round(bench(lambda: fl(qh, kh, vh)), 3), flex_strong_fb_ms=round(fb, 3),
               flex_strong=f"{info['flex_backend']} {info['flex_block']}", flex_strong_config=info)
    return out


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
        row = dict(layout=name, S=S, D=D, B=B, H=H, block=bs, window=window(S, bs), live_frac=round(live / lay.size, 4),
                   ideal=round(causal_blocks / live, 2), sdpa_fwd_ms=round(dense["fwd"], 3),
                   sdpa_fb_ms=round(dense["fb"], 3))
        attn = lambda a, b, c: op.attention(a, b, c)            # noqa: E731
        row["ours_fwd_ms"] = round(bench(lambda: op.attention(q, k, v), smoke), 3)
        row["ours_fb_ms"] = round(bench(fwd_bwd(attn, q, k, v, g), smoke), 3)
        row["ours_peak_mib"] = peak_mib(fwd_bwd(attn, q, k, v, g), smoke)
        if not smoke:
            if args.plain_flex:
                row.update(plain_flex(mask, S, B, bs, dev, qh, kh, vh, gh))
            if args.strong_flex:
                row.update(strong_flex(args, mask, S, B, dev, qh, kh, vh, gh))
        for pas in ("fwd", "fb"):
            ours = row[f"ours_{pas}_ms"]
            row[f"speedup_{pas}"] = round(row[f"sdpa_{pas}_ms"] / ours, 2)
            row[f"frac_ideal_{pas}"] = round(row[f"speedup_{pas}"] / row["ideal"], 2)
            if row.get(f"flex_{pas}_ms"):
                row[f"vs_flex_{pas}"] = round(row[f"flex_{pas}_ms"] / ours, 2)
                row[f"flex_frac_ideal_{pas}"] = round(row[f"sdpa_{pas}_ms"] / row[f"flex_{pas}_ms"] / row["ideal"], 2)
            if row.get(f"flex_strong_{pas}_ms"):
                row[f"vs_flex_strong_{pas}"] = round(row[f"flex_strong_{pas}_ms"] / ours, 2)
            if dense.get(f"cudnn_{pas}") and name == "causal":       # dense causal against cuDNN's kernel
                row[f"sdpa_cudnn_{pas}_ms"] = round(dense[f"cudnn_{pas}"], 3)
                row[f"vs_cudnn_{pas}"] = round(dense[f"cudnn_{pas}"] / ours, 2)
        if dense.get("cudnn_error") and name == "causal":
            row["cudnn_error"] = dense["cudnn_error"]
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
           ("strong Flex", "flex_strong"), ("strong Flex f+b ms", "flex_strong_fb_ms"),
           ("vs strong Flex f+b", "vs_flex_strong_fb"), ("cuDNN f+b ms", "sdpa_cudnn_fb_ms"),
           ("vs cuDNN f+b", "vs_cudnn_fb"),
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
    lines += ["", f"strong Flex: {extra['strong_flex']}"]
    failed = sorted({f"{k}: {v}" for r in rows for k, v in r.get("flex_strong_tried", {}).items() if isinstance(v, str)})
    lines += [f"- not run: `{e}`" for e in failed]
    cudnn = sorted({r["cudnn_error"] for r in rows if r.get("cudnn_error")})
    lines += [f"- cuDNN SDPA failed: `{e}`" for e in cudnn]
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
    ap.add_argument("--flex-blocks", type=ints, default=[128, 64], help="strong Flex: BlockMask sizes to try")
    ap.add_argument("--flex-backend", default="auto", help="strong Flex: auto (FLASH if it imports, then Triton), "
                                                           "flash or triton")
    ap.add_argument("--flex-compile", default="max-autotune", help="strong Flex: torch.compile mode ('': default)")
    ap.add_argument("--no-strong-flex", dest="strong_flex", action="store_false", help="skip the strong Flex column")
    ap.add_argument("--no-plain-flex", dest="plain_flex", action="store_false",
                    help="skip the plain Flex column (default compile, Triton, the layout's block)")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.tiles:
        from scripts.tune.tune_attention import apply
        apply(args.tiles)
    if args.cpu_smoke:
        args.seq, args.dims, args.batch, args.heads, args.block = [256], [16], 1, 2, [32]
    os.makedirs(args.out, exist_ok=True)
    _flex.backends(args.flex_backend)                           # a bad choice fails before anything runs
    strong = ("skipped (CPU smoke: no Flex, no cuDNN)" if args.cpu_smoke else
              "off (--no-strong-flex)" if not args.strong_flex else
              f"torch.compile mode={args.flex_compile or 'default'}, BlockMask sizes {args.flex_blocks}, backends "
              f"{_flex.backends(args.flex_backend)}; {_flex.flash_status()[1]}")
    extra = {**environment(args.cpu_smoke, triton=True), "strong_flex": strong,
             "command": "python scripts/bench/bench_attention.py " + " ".join(sys.argv[1:])}
    rows = measure(args, lambda rows: report(rows, extra, args.out, args.name, quiet=True))
    report(rows, extra, args.out, args.name)


if __name__ == "__main__":
    main()
