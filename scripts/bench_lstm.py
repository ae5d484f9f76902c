"""Sparse mLSTM results on the GPU (issue 4), in three sub-commands:

    PYTHONPATH=$PWD python scripts/bench_lstm.py steptime --out DIR
        Step time (forward + backward + clipping + AdamW, bf16) of the sparse mLSTM at hidden 8192
        and >= 90% sparsity against density x the dense step time (target: ratio <= 1.5), with the
        step captured in a CUDA graph (as trainer.cuda_graph=true runs it) and in eager mode.
    PYTHONPATH=$PWD python scripts/bench_lstm.py curve --which sparse|dense --seconds 300 --out DIR
        Trains one model of an equal-parameter pair for a fixed time on the same real text; writes
        lstm_curve_<which>.json. Run the two on two GPUs at once (CUDA_VISIBLE_DEVICES).
    python scripts/bench_lstm.py report --out DIR
        lstm.md, lstm.csv and lstm.png from the JSON files in DIR.

The text is this Python's standard library, every *.py below the stdlib directory in sorted
order, concatenated up to 64 MiB (--corpus): a larger cut of the default corpus (which takes the
top level only, 4 MiB), split 90/5/5.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIR = {   # equal total parameters: sparse is 2x wider at ~1/4 density
    "sparse": ["model.hidden=4096", "model.density=0.25", "model.layout=barabasi_albert"],
    "dense": ["model.hidden=2048", "model.sparse=false"],
}
CURVE_COMMON = ["data.seq_len=64", "data.batch_size=64", "trainer.precision=bf16", "trainer.cuda_graph=true",
                "trainer.eval_every=5000", "trainer.eval_batches=50", "trainer.progress=false",
                "trainer.ckpt_every=0", "trainer.log_every=100", "trainer.max_steps=1000000",
                "optim.lr=1e-3", "optim.warmup_steps=200", "optim.schedule=constant", "model.embed=128",
                "model.block_size=32", "model.depth=2"]


def config(*overrides):
    from hydra import compose, initialize_config_module

    from bstrain.configs.schema import register
    register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def recurrent(model) -> tuple[int, int]:
    """(live recurrent weights, dense recurrent weights at this width)."""
    H = model.cfg.hidden
    live = sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(("w_hm", "deep", "w_mg")) and n.endswith("weight"))
    return live, (model.cfg.depth + 4) * H * H


def build_corpus(path: Path, max_bytes: int = 64 << 20) -> Path:
    from bstrain.data.text import default_corpus
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")        # two runs may build it at once
        tmp.write_bytes(default_corpus(max_bytes, recursive=True))
        os.replace(tmp, path)
    return path


# --- step time ---------------------------------------------------------------------------------------
def eager_step(model, opt, x: torch.Tensor, group: int, grad_clip: float):
    """The eager training step, as the trainer runs it in bf16 (without loss scaling)."""
    from bstrain.train.step import clip_grads, lm_loss
    loss, _ = lm_loss(model, x, x, None, torch.bfloat16, group)
    loss.backward()
    clip_grads(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_time(cfg, batch: int, seq: int, group: int, graph: bool) -> tuple[float, float]:
    """(median ms per optimizer step in bf16 on random bytes, recurrent density of the model)."""
    import triton

    from bstrain.models.lstm import build_model
    from bstrain.train.graphs import CapturedStep
    from bstrain.train.trainer import make_optimizer
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(cfg.model).to(dev)
    opt = make_optimizer(model, cfg.optim, dev, capturable=graph)
    x = torch.randint(0, 256, (batch, seq), device=dev)
    if graph:
        cap = CapturedStep(model, opt, batch, seq, dev, torch.bfloat16, group, cfg.optim.grad_clip)

        def fn():
            cap.step(x, x, reset_state=False)
    else:
        def fn():
            eager_step(model, opt, x, group, cfg.optim.grad_clip)
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=200, rep=1500, return_mode="median")
    live, full = recurrent(model)
    del model, opt, fn
    torch.cuda.empty_cache()
    return ms, live / full


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


def cmd_profile(args) -> None:
    """GPU time per kernel name of one eager sparse step (the same kernels a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    from bstrain.models.lstm import build_model
    from bstrain.train.trainer import make_optimizer
    dev = torch.device("cuda")
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        cfg = config("model.hidden=8192", f"model.density={args.densities.split(',')[0]}", "model.layout=random",
                     "model.embed=256", "model.depth=2", f"model.block_size={bs}")
        model = build_model(cfg.model).to(dev)
        opt = make_optimizer(model, cfg.optim, dev)
        batch = int(args.batches.split(",")[0])
        x = torch.randint(0, 256, (batch, 32), device=dev)

        def fn():
            eager_step(model, opt, x, 8, cfg.optim.grad_clip)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== block {bs}, batch {batch}, density {args.densities.split(',')[0]}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        del model, opt


# --- learning curves ---------------------------------------------------------------------------------
def cmd_curve(args) -> None:
    from bstrain.models.lstm import build_model
    from bstrain.train.trainer import train
    corpus = build_corpus(Path(args.corpus))
    cfg = config(*CURVE_COMMON, *PAIR[args.which], f"data.path={corpus}",
                 f"trainer.time_limit_s={args.seconds}", f"trainer.run_dir={args.runs}/{args.which}")
    model = build_model(cfg.model)
    live, full = recurrent(model)
    res = train(cfg)
    out = dict(which=args.which, hidden=cfg.model.hidden, density=live / full, recurrent_params=live,
               total_params=model.num_params(), steps=res["steps"], seconds=args.seconds,
               valid_bpb=res["valid_bpb"], history=res["history"], valid_history=res["valid_history"],
               corpus_bytes=os.path.getsize(corpus), device=torch.cuda.get_device_name(),
               overrides=CURVE_COMMON + PAIR[args.which])
    with open(os.path.join(args.out, f"lstm_curve_{args.which}.json"), "w") as f:
        json.dump(out, f)
    print(f"{args.which}: {res['steps']} steps, valid {res['valid_bpb']:.4f} bits/byte", flush=True)


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
                  "| batch x seq | mode | block | density | sparse ms | dense ms | ratio |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} x {r['seq']} | {'graph' if r['graph'] else 'eager'} | {r.get('block', 32)} | "
                  f"{r['density']:.3f} | "
                  f"{r['sparse_ms']:.2f} | {r['dense_ms']:.2f} | {r['ratio']:.2f} |" for r in steptime]
        lines.append("")
    if curves:
        c0 = next(iter(curves.values()))
        lines += [f"## Equal parameters, {c0['seconds']:.0f} s each, same text", "",
                  f"Text: stdlib sources ({c0['corpus_bytes'] / 2**20:.0f} MiB, 90/5/5 split). Shared settings: "
                  f"`{' '.join(CURVE_COMMON)}`. Each run on its own H200, at the same time.", "",
                  "| model | hidden | recurrent density | parameters | steps | valid bits/byte |", "|---|---|---|---|---|---|"]
        for w, c in curves.items():
            lines.append(f"| {w} | {c['hidden']} | {c['density']:.3f} | {c['total_params']:,} | {c['steps']} | "
                         f"{c['valid_bpb']:.4f} |")
        if len(curves) == 2:
            s, d = curves["sparse"]["valid_history"], curves["dense"]["valid_history"]
            common = sorted(set(st for st, _, _ in s) & set(st for st, _, _ in d))
            if common:
                k = common[-1]
                sv = next(b for st, _, b in s if st == k)
                dv = next(b for st, _, b in d if st == k)
                lines += ["", f"At equal steps ({k}): sparse {sv:.4f}, dense {dv:.4f} valid bits/byte."]
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
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
            for w, c in curves.items():
                st, l = zip(*c["history"])
                k = 50
                smooth = [sum(l[max(0, i - k):i + 1]) / len(l[max(0, i - k):i + 1]) for i in range(len(l))]
                label = f"{w} H={c['hidden']} d={c['density']:.2f} ({c['total_params'] / 1e6:.1f}M)"
                axes[0].plot(st, [v / 0.6931 for v in smooth], label=label)
                vs, vt, vb = zip(*c["valid_history"])
                axes[1].plot(vt, vb, marker="o", label=f"{label}: {c['valid_bpb']:.3f}")
            axes[0].set(xlabel="step", ylabel="train bits/byte (50-step mean)", ylim=(None, 3.0))
            axes[1].set(xlabel="seconds", ylabel="valid bits/byte")
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
    ap.add_argument("command", choices=["steptime", "profile", "curve", "report"])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--which", choices=sorted(PAIR), default="sparse")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--corpus", default="/tmp/bstrain-stdlib-all.txt")
    ap.add_argument("--runs", default="/tmp/bstrain-lstm-runs")
    ap.add_argument("--batches", default="64,256", help="steptime/profile: batch sizes")
    ap.add_argument("--block-sizes", default="32", help="steptime/profile: block sizes")
    ap.add_argument("--densities", default="0.05,0.1", help="steptime/profile: layout densities")
    ap.add_argument("--modes", default="graph,eager", help="steptime: graph and/or eager")
    ap.add_argument("--append", action="store_true", help="steptime: add rows to an existing JSON")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    {"steptime": cmd_steptime, "profile": cmd_profile, "curve": cmd_curve,
     "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
