"""Triton is optional: without it the package imports, its modules train on the CPU, and the CLI
trains the default model. Each check runs in a fresh interpreter whose ``import triton`` fails,
as it does where triton is not installed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


REPO = Path(__file__).parents[1]
NO_TRITON = "import sys; sys.modules['triton'] = None  # import triton now raises ImportError\n"


def run_without_triton(code: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", NO_TRITON + textwrap.dedent(code), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_package_imports_and_trains_without_triton():
    out = run_without_triton("""
        import torch
        import bstrain.layout, bstrain.nn, bstrain.ops as bs
        from bstrain.nn import BlockSparseAttention, BlockSparseLinear, LayerNorm

        linear = BlockSparseLinear(64, 128, block_size=16, density=0.5)
        x = torch.randn(4, 64, requires_grad=True)
        linear(x).square().sum().backward()
        assert x.grad.shape == (4, 64) and linear.weight.grad is not None

        attn = BlockSparseAttention.from_mask(bstrain.layout.causal_mask, context=64, block_size=16, heads=2)
        q = torch.randn(2, 64, 2 * 8, requires_grad=True)
        attn(q, q, q).sum().backward()
        c, h = bs.fused_lstm_gates(torch.zeros(4, 32), LayerNorm(128, segments=4)(torch.randn(4, 128)))
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_conv_module_without_triton():
    out = run_without_triton("""
        import torch
        from bstrain.nn import BlockSparseConv2d

        conv = BlockSparseConv2d(32, 32, 3, padding=1, block_size=16, density=0.5)
        conv(torch.randn(2, 32, 8, 8)).sum().backward()
        assert conv.weight.grad is not None
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_cli_trains_without_triton(tmp_path):
    out = run_without_triton("""
        import runpy
        sys.argv = ["bstrain", *sys.argv[1:]]
        runpy.run_module("bstrain", run_name="__main__", alter_sys=True)
    """, "train", "model.hidden=64", "model.embed=16", "model.block_size=16", "data.seq_len=8",
        "data.batch_size=2", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
        "trainer.progress=false", "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "ckpt" / "step_00000002.pt").is_file()
