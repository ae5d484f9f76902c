"""Block-sparse attention against dense SDPA (causal) and FlexAttention on the same block mask,
in one run (issue 11).

    PYTHONPATH=$PWD python scripts/bench_attention.py [--out DIR] [--seq 4096,8192,16384] [--dims 64,128]
                                                      [--cpu-smoke]

For each layout (causal, local, strided, fixed), context S and head dim D (B=4, H=16, bf16):
forward and forward+backward times (medians of triton.testing.do_bench) of
  bstrain        BlocksparseTransformer(backend="triton").attention
  sdpa           F.scaled_dot_product_attention(is_causal=True), dense causal
  flex           torch.compile(flex_attention) with create_block_mask of the same mask function
and the ideal speedup over dense causal: causal live blocks / the layout's live blocks, at 128-blocks.
Writes attention.md, attention.json (and attention.png when matplotlib is there) to --out.
--cpu-smoke runs tiny sizes on the CPU (fp32, bstrain's PyTorch path, no Flex) to check the script.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bstrain import layout as L  # noqa: E402
from bstrain.ops.transformer import BlocksparseTransformer  # noqa: E402


def masks(S: int):
    w = max(128, S // 32)                       # window / stride: 1/32 of the context, at least one block
    return {"causal": L.causal_mask, "local": L.local_mask(4 * w), "strided": L.strided_mask(w),
            "fixed": L.fixed_mask(w, summary=w // 8)}


def bench(fn, smoke: bool) -> float:
    """Median ms of fn (do_bench on CUDA; a few timed calls on CPU)."""
    if smoke:
        import time
        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


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


def measure(args) -> list[dict]:
    smoke = args.cpu_smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    B, H = args.batch, args.heads
    from bstrain.kernels import attention as K
    flex_broken = {}                                            # block size -> Flex's error there
    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    rows = []
    for S in args.seq:
        for D in args.dims:
            (q, k, v, g), (qh, kh, vh, gh) = inputs(B, S, H, D, dev, dt)
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)   # noqa: E731
            dense = {"fwd": bench(lambda: sdpa(qh, kh, vh), smoke),
                     "fb": bench(fwd_bwd(sdpa, qh, kh, vh, gh), smoke)}
            for bs in args.block:
                rows += _layouts(args, S, D, bs, q, k, v, g, qh, kh, vh, gh, dense, smoke, dev, K, flex_broken)
    return rows


def _layouts(args, S, D, bs, q, k, v, g, qh, kh, vh, gh, dense, smoke, dev, K, flex_broken) -> list[dict]:
    """The rows of one (S, D, block size): each layout against the dense causal times `dense`."""
    B, H = args.batch, args.heads
    rows = []
    causal_blocks = None
    for name, mask in masks(S).items():
        if name not in args.layouts.split(",") and name != "causal":
            continue
        lay, cb = L.attention_layout(mask, S, S, bs)
        live = int(lay.sum())
        causal_blocks = causal_blocks or live                   # causal comes first
        op = BlocksparseTransformer(lay, bs, heads=H, mask_callback=cb,
                                    backend="torch" if smoke else "triton")
        row = dict(layout=name, S=S, D=D, B=B, H=H, block=bs, live_frac=round(live / lay.size, 4),
                   ideal=round(causal_blocks / live, 2), sdpa_fwd_ms=round(dense["fwd"], 3),
                   sdpa_fb_ms=round(dense["fb"], 3))
        attn = lambda a, b, c: op.attention(a, b, c)            # noqa: E731
        row["ours_fwd_ms"] = round(bench(lambda: op.attention(q, k, v), smoke), 3)
        for i, mode in enumerate(args.backward.split(",")):
            K.BACKWARD = mode                                    # read at every backward call
            ms = round(bench(fwd_bwd(attn, q, k, v, g), smoke), 3)
            row["ours_fb_ms" if i == 0 else f"ours_fb_ms_{mode}"] = ms
        K.BACKWARD = args.backward.split(",")[0]
        if bs in flex_broken:
            row["flex_error"] = flex_broken[bs]
        elif not smoke:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                bm = create_block_mask(mask, B=None, H=None, Q_LEN=S, KV_LEN=S, BLOCK_SIZE=bs, device=dev)
                flex = torch.compile(flex_attention)
                fl = lambda a, b, c: flex(a, b, c, block_mask=bm)   # noqa: E731
                row["flex_fwd_ms"] = round(bench(lambda: fl(qh, kh, vh), smoke), 3)
                row["flex_fb_ms"] = round(bench(fwd_bwd(fl, qh, kh, vh, gh), smoke), 3)
            except Exception as exc:                            # a failure is a result too
                row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                if "divisible" in row["flex_error"]:            # the same at every size: try once
                    flex_broken[bs] = row["flex_error"]
        for pas in ("fwd", "fb"):
            ours = row[f"ours_{pas}_ms"]
            row[f"speedup_{pas}"] = round(row[f"sdpa_{pas}_ms"] / ours, 2)
            row[f"frac_ideal_{pas}"] = round(row[f"speedup_{pas}"] / row["ideal"], 2)
            if row.get(f"flex_{pas}_ms"):
                row[f"vs_flex_{pas}"] = round(row[f"flex_{pas}_ms"] / ours, 2)
                row[f"flex_frac_ideal_{pas}"] = round(row[f"sdpa_{pas}_ms"] / row[f"flex_{pas}_ms"] / row["ideal"], 2)
        for mode in args.backward.split(",")[1:]:
            row[f"frac_ideal_fb_{mode}"] = round(row["sdpa_fb_ms"] / row[f"ours_fb_ms_{mode}"] / row["ideal"], 2)
        if name in args.layouts.split(","):
            rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], extra: dict, out: str) -> None:
    more = [m for m in extra.get("backward", "split").split(",")[1:]]     # other backward forms timed
    first = extra.get("backward", "split").split(",")[0]
    blocks = ",".join(str(b) for b in sorted({r["block"] for r in rows}))
    lines = [f"# Block-sparse attention: {extra['device']}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; scripts/bench_attention.py; B={rows[0]['B']}, H={rows[0]['H']}, blocks "
             f"{blocks}; medians of triton.testing.do_bench. ideal = causal live blocks / live blocks; "
             "frac ideal = (SDPA causal time / ours) / ideal; vs flex = Flex time / ours (targets: frac ideal "
             f">= 0.85, vs flex >= 1.3, causal >= 0.9 of SDPA). f+b columns: the `{first}` backward"
             + "".join(f"; `{m}` f+b: the `{m}` backward" for m in more) + ".", "",
             "| layout | S | D | block | live | ideal | ours fwd ms | ours f+b ms | "
             + "".join(f"{m} f+b ms | " for m in more)
             + "SDPA f+b ms | Flex f+b ms | frac ideal f+b | " + "".join(f"{m} frac ideal f+b | " for m in more)
             + "Flex frac ideal f+b | frac ideal fwd | vs flex f+b | vs flex fwd |",
             "|" + "---|" * (15 + 2 * len(more))]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['S']} | {r['D']} | {r['block']} | {r['live_frac']} | {r['ideal']} | "
                     f"{r['ours_fwd_ms']} | {r['ours_fb_ms']} | "
                     + "".join(f"{r[f'ours_fb_ms_{m}']} | " for m in more)
                     + f"{r['sdpa_fb_ms']} | {r.get('flex_fb_ms', '-')} | {r['frac_ideal_fb']} | "
                     + "".join(f"{r[f'frac_ideal_fb_{m}']} | " for m in more)
                     + f"{r.get('flex_frac_ideal_fb', '-')} | {r['frac_ideal_fwd']} | "
                     f"{r.get('vs_flex_fb', '-')} | {r.get('vs_flex_fwd', '-')} |")
    errors = sorted({r["flex_error"] for r in rows if r.get("flex_error")})
    if errors:
        lines += ["", "FlexAttention errors:", *[f"- `{e}`" for e in errors]]
    with open(os.path.join(out, "attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "attention.json"), "w") as f:
        json.dump({"rows": rows, **extra}, f, indent=1)
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("frac_ideal_fb", "bstrain"), ("flex_frac", "FlexAttention")):
        pts = [(f"{r['layout']}\nS{r['S'] // 1024}k D{r['D']}",
                r[key] if key != "flex_frac" else r.get("flex_frac_ideal_fb")) for r in rows]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=label)
    ax.axhline(0.8, ls="--", c="grey", lw=1)
    ax.set_ylabel("fraction of the ideal speedup over dense causal (fwd+bwd)")
    ax.tick_params(axis="x", labelsize=6, rotation=90)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "attention.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(v) for v in s.split(",")]             # noqa: E731
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--seq", type=ints, default=[4096, 8192, 16384])
    ap.add_argument("--dims", type=ints, default=[64, 128])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block", type=ints, default=[128], help="layout block sizes, e.g. 64,128")
    ap.add_argument("--backward", default="split",
                    help="attention backward forms to time, the first one in the main columns (split,fused)")
    ap.add_argument("--layouts", default="causal,local,strided,fixed")
    ap.add_argument("--tiles", help="a tune_attention.json whose best tiles to use")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.tiles:
        from tune_attention import apply
        apply(args.tiles)
    from bstrain.kernels import attention as K
    forms = args.backward.split(",")
    if any(f != "split" for f in forms) and not hasattr(K, "BACKWARD"):
        raise SystemExit(f"--backward {args.backward}: this checkout has only the split attention backward")
    if args.cpu_smoke:
        args.seq, args.dims, args.batch, args.heads, args.block = [256], [16], 1, 2, [32]
    os.makedirs(args.out, exist_ok=True)
    extra = {"device": "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
             "date": str(datetime.date.today()), "backward": args.backward}
    report(measure(args), extra, args.out)


if __name__ == "__main__":
    main()
