"""The CPU side of issues 41 and 44's GPU figures: the strongest-Flex and anchor choices, the 4k
layouts, the glue bench, the flash-attn-4 halves, gpu_check.sh's issue modes and the multi-GPU parser.
The GPU-only parts (Flex, cuDNN, CUDA graphs, NCCL) skip here; their commands are checked as text."""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import _flex

REPO = Path(__file__).parents[2]


def test_the_4k_layouts_are_not_all_causal():
    """At S=4k with blocks of 128 a window/stride of S/32 is one block: strided and fixed kept every
    causal block, so the 4k grid timed causal attention under their names."""
    from bstrain import layout as L
    from scripts.bench.bench_attention import masks
    causal = int(L.attention_layout(L.causal_mask, 4096, 4096, 128)[0].sum())
    for name, mask in masks(4096, 128).items():
        if name in ("local", "strided", "fixed"):
            assert int(L.attention_layout(mask, 4096, 4096, 128)[0].sum()) < causal, name


def test_flex_choices():
    assert _flex.backends("triton") == ["TRITON"] and _flex.backends("FLASH") == ["FLASH"]
    with pytest.raises(ValueError, match=r"--flex-backend: expected auto, flash or triton, got 'cute'"):
        _flex.backends("cute")
    assert _flex.kernel_options(128, "TRITON") is None
    assert _flex.kernel_options(128, "FLASH") == {"BACKEND": "FLASH"}
    assert _flex.kernel_options(64, "TRITON")["BLOCK_N2"] == 64
    usable, what = _flex.flash_status()
    if not usable:                                     # this machine: no flash-attn-4
        assert what.startswith("FLASH absent") and _flex.backends("auto") == ["TRITON"]


def _args(**kw):
    base = dict(compile="max-autotune-no-cudagraphs", anchor_graph="auto", anchor_opt="compiled")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, graph, optimizer", [
    ({}, "manual CUDA graph of the whole step", "torch.compile(clip + AdamW fused, capturable)"),
    ({"compile": "max-autotune"}, "torch.compile's CUDA graphs", "torch.compile(clip + AdamW fused, capturable)"),
    ({"anchor_graph": "off", "anchor_opt": "eager"}, "no graph (off)", "eager clip + AdamW fused, capturable"),
    ({"compile": ""}, "manual CUDA graph of the whole step", "eager clip + AdamW fused, capturable"),
], ids=["no-cudagraphs+graph", "max-autotune", "off-eager", "uncompiled"])
def test_anchor_choices_on_a_gpu(kw, graph, optimizer):
    from scripts.bench._anchor import anchor_choices
    got = anchor_choices(_args(**kw), torch.device("cuda"))
    assert (got["graph"], got["optimizer"]) == (graph, optimizer)


def test_anchor_graph_on_refuses_a_self_graphing_compile_and_is_off_on_the_cpu():
    from scripts.bench._anchor import anchor_choices
    with pytest.raises(ValueError, match=r"--anchor-graph on: --compile max-autotune CUDA-graphs by itself"):
        anchor_choices(_args(compile="max-autotune", anchor_graph="on"), torch.device("cuda"))
    assert anchor_choices(_args(anchor_graph="on"), torch.device("cpu"))["graph"] == "no graph (off (CPU))"


def test_anchor_update_falls_back_to_eager_where_it_does_not_compile_and_says_so():
    from scripts.bench._anchor import CompiledOrEager
    calls, choices = [], {"optimizer": "torch.compile(clip + AdamW fused, capturable)"}
    update = CompiledOrEager(lambda: calls.append("eager"), "max-autotune-no-cudagraphs", choices)

    def refuses():
        raise RuntimeError("Unsupported: fused optimizer")
    update.compiled = refuses
    update()
    update()
    assert calls == ["eager", "eager"]
    assert choices["optimizer"] == ("torch.compile(clip + AdamW fused, capturable) -> eager: compile failed "
                                    "(RuntimeError: Unsupported: fused optimizer)")


def test_bench_attention_cpu_smoke_has_the_new_columns(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--cpu-smoke", "--layouts", "causal,strided",
                                      "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "bench" / "bench_attention.py"), run_name="__main__")
    table = (tmp_path / "attention.md").read_text()
    assert "| strong Flex | strong Flex f+b ms |" in table and "| cuDNN f+b ms | vs cuDNN f+b |" in table
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["strong_flex"].startswith("skipped (CPU smoke")
    assert [r["window"] for r in data["rows"]] == [64, 64]                    # two blocks of 32 at S=256


def test_bench_ops_glue_cpu_smoke(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_ops.py", "--cpu-smoke", "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "bench" / "bench_ops.py"), run_name="__main__")
    rows = json.loads((tmp_path / "ops_glue.json").read_text())["rows"]
    got = {(r["op"], r["pass"]): r["bytes"] for r in rows}
    N, C, e = 128, 32, 4                                                       # the smoke's tokens, width, fp32
    assert got[("add_layer_norm C=32", "fwd")] == 4 * N * C * e
    assert got[("bias_gelu C=128", "bwd")] == 3 * N * 4 * C * e
    assert got[("apply_rotary qkv C=96 D=16", "fwd")] == 2 * N * 3 * C * e
    assert got[("cross_entropy V=256", "bwd")] == 2 * N * 256 * e + 4 * N
    assert len(rows) == 8 and all(r["ours_hbm_pct"] is None for r in rows)    # no bandwidth on the CPU


def _sh(script: str, *args, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu" / script), *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, **env})


def test_flash_attn_wheels_travel_in_two_halves_and_join(tmp_path):
    wheels, repo, parts = tmp_path / "wheels", tmp_path / "repo", tmp_path / "parts"
    wheels.mkdir()
    repo.mkdir()
    (repo / ".gitignore").write_text("/.fa4/\n")
    blobs = {"a-1-py3-none-any.whl": os.urandom(3000), "b-2-cp312-cp312-manylinux_2_28_x86_64.whl": os.urandom(5001)}
    for name, blob in blobs.items():
        (wheels / name).write_bytes(blob)
    out = _sh("fetch_fa4.sh", cwd=repo, FA4_WHEELS=str(wheels))
    assert out.returncode == 0, out.stderr
    half_b = _sh("stage_fa4.sh", "b", cwd=repo, FA4_PARTS=str(parts), FA4_NO_INSTALL="1")
    assert half_b.returncode == 1 and "did not run stage_fa4.sh a" in half_b.stderr     # call 1 lost
    shutil.rmtree(parts)
    for half in ("a", "b"):
        out = _sh("stage_fa4.sh", half, cwd=repo, FA4_PARTS=str(parts), FA4_NO_INSTALL="1")
        assert out.returncode == 0, out.stderr
    assert {p.name: p.read_bytes() for p in (parts / "wheels").glob("*.whl")} == blobs


MODES = ["40 transformer wide", "40 lstm dense 300", "41 suite", "41 attention 4096", "41 glue", "41 anchor D128", "44 suite", "44 scaling convnet_cifar10",
         "44 fsdp", "44 resume", "44 rigl"]


@pytest.mark.parametrize("mode", MODES, ids=[m.replace(" ", "-") for m in MODES])
def test_gpu_check_issue_modes_name_real_scripts_and_flags(mode, tmp_path):
    out = _sh("gpu_check.sh", *mode.split(), cwd=REPO, DRY_RUN="1", NGPU="4", OUT=str(tmp_path))
    assert out.returncode == 0, out.stderr
    commands = [line[2:].split() for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert commands
    for cmd in commands:
        scripts = [a for a in cmd if a.startswith("scripts/")]
        for script in scripts:
            source = (REPO / script).read_text()
            flags = {a for a in cmd if a.startswith("--")}
            missing = sorted(f for f in flags if f'"{f}"' not in source)
            assert not missing, (script, missing)


def test_gpu_check_issue_mode_refuses_an_unknown_part(tmp_path):
    out = _sh("gpu_check.sh", "44", "ddp", cwd=REPO, DRY_RUN="1", NGPU="2", OUT=str(tmp_path))
    assert out.returncode == 2 and "gpu_check.sh 44: expected suite, scaling CONFIG, fsdp, resume or rigl, " \
                                   "got 'ddp'" in out.stderr


def test_multigpu_parses_a_train_log():
    from scripts.bench.bench_multigpu import parse
    log = ("2026 INFO run dir r | device cuda:0 x 2 | fsdp | precision bf16 | TransformerLM | 1,234 parameters (x) | y\n"
           "2026 INFO step: one CUDA graph per step (trainer.cuda_graph=auto)\n"
           + "".join(f"2026 INFO step {s} loss {5 - s / 10:.4f} (avg1) lr 1.00e-03 grad_norm 1.000 tokens/s {r}\n"
                     for s, r in ((1, 10), (2, 20), (3, 300), (4, 100), (5, 200))))
    got = parse(log, "noise\npeak_mem_gib rank 1 3.250\npeak_mem_gib rank 0 3.5\n")
    assert got["rate"] == 200 and got["unit"] == "tokens" and got["windows"] == [10, 20, 300, 100, 200]
    assert got["params"] == 1234 and got["peak_mem_gib"] == {0: 3.5, 1: 3.25}
    assert got["step_mode"] == "step: one CUDA graph per step (trainer.cuda_graph=auto)"
    assert got["losses"]["3"] == "4.7000" and len(got["losses"]) == 5


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="checks the refusal on a machine without 4 GPUs")
def test_multigpu_refuses_too_few_gpus_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_multigpu.py", "fsdp", "--nproc", "4", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=re.escape(f"bench_multigpu fsdp: needs 4 GPUs, found "
                                                   f"{torch.cuda.device_count()}")):
        runpy.run_path(str(REPO / "scripts" / "bench" / "bench_multigpu.py"), run_name="__main__")
    assert not list(tmp_path.iterdir())
