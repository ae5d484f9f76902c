"""Shared test helpers: markers, device choice, the tolerance table and the closeness check.

On a machine without CUDA the Triton kernels run in the interpreter on CPU tensors: set
TRITON_INTERPRET=1 before anything imports triton.

Triton is an optional dependency (``pip install 'bstrain[triton]'``). Without it, the tests that
need it skip with that reason: every test under tests/kernels/, every test parametrized with the
value "triton" (a backend), and tests marked ``@pytest.mark.triton``. A test module whose import
fails only because triton is missing skips as a whole; any other import error is an error.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every kernel output and workspace starts as NaN, so an element a kernel fails to write fails
# its test every time (bstrain.kernels.alloc). Set before any kernel module is imported.
os.environ["BSTRAIN_POISON_OUTPUTS"] = "1"
SEED_ENV = "BSTRAIN_TEST_SEED"


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401  (after TRITON_INTERPRET is set above)
    except ModuleNotFoundError as e:
        if e.name != "triton":              # triton is there but broken: say so, don't skip
            raise
        return False
    return True


HAS_TRITON = _triton_installed()
NO_TRITON = "triton is not installed: pip install 'bstrain[triton]'"
KERNEL_TESTS = Path(__file__).parent / "kernels"

# Error floor per dtype, relative to the reference's largest magnitude. The kernel's error may be
# at most 2x the error of the same product done by PyTorch in that dtype, plus this floor.
TOL_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def kernel_device() -> str:
    """Where kernel tests run: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def kernel_dtypes() -> list:
    """bf16 tl.dot is wrong in the interpreter, so bf16 kernel checks run on the GPU only."""
    dts = [torch.float32, torch.float16]
    return dts + [torch.bfloat16] if torch.cuda.is_available() else dts


def assert_close(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype,
                 name: str = "out") -> None:
    """out vs float64 ref; base is PyTorch's own result in ``dtype`` (None: floor only)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), f"{name}: non-finite value at {_worst(~torch.isfinite(out64))}"
    err = (out64 - ref64).abs()
    scale = (ref64.abs().max().item() if ref64.numel() else 0.0) or 1.0
    allowed = TOL_FLOOR[dtype] * scale
    if base is not None:
        allowed += 2.0 * (base.detach().double().cpu() - ref64).abs().max().item() if ref64.numel() else 0.0
    worst = err.max().item() if err.numel() else 0.0
    if worst > allowed:
        i = _worst(err)
        raise AssertionError(f"{name}: max error {worst:.3g} > allowed {allowed:.3g} at index {i}: "
                             f"got {out64[i].item():.6g}, expected {ref64[i].item():.6g}")


def _worst(t: torch.Tensor) -> tuple:
    flat = int(t.double().flatten().argmax())
    return tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), t.shape))


def ragged_layout(cb: int, kb: int, seed: int) -> np.ndarray:
    """Random layout with one empty block-row and one empty block-column."""
    rng = np.random.default_rng(seed)
    lay = rng.random((cb, kb)) < 0.6
    lay[1, :] = False
    lay[:, 2] = False
    lay[0, 0] = lay[2, 1] = True
    return lay


def dense_weight(lay: np.ndarray, w: torch.Tensor) -> torch.Tensor:
    """(C, K) float64 dense equivalent of the (nnz, bs, bs) live blocks."""
    bs = w.shape[-1]
    cb, kb = lay.shape
    dense = torch.zeros(cb, bs, kb, bs, dtype=torch.float64)
    c_idx, k_idx = np.nonzero(lay)
    dense[c_idx, :, k_idx, :] = w.detach().double().cpu()
    return dense.reshape(cb * bs, kb * bs)


def torch_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's own product in ``dtype``: the error baseline of the tolerance rule."""
    return (a.to(dtype) @ b.to(dtype)).double()


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1,
                     help="run every test this many times, each with a fresh seed (stress runs)")


def pytest_generate_tests(metafunc):
    repeat = metafunc.config.getoption("repeat")
    if repeat > 1:
        metafunc.fixturenames.append("repeat_index")
        metafunc.parametrize("repeat_index", range(repeat), ids=lambda i: f"rep{i}")


@pytest.fixture(autouse=True)
def test_seed(request) -> int:
    """Every test draws fresh random inputs from its own seed, reported when it fails.

    ``BSTRAIN_TEST_SEED=<seed> pytest <test id>`` replays a failure exactly.
    """
    seed = int(os.environ.get(SEED_ENV) or np.random.SeedSequence().entropy % (1 << 31))
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    request.node.bstrain_seed = seed
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "bstrain_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"{SEED_ENV}={seed} pytest '{item.nodeid}'  # replays this run"))
    return report


def fresh_seed() -> int:
    """A seed for numpy or a layout builder, drawn from the test's seeded torch generator."""
    return int(torch.randint(0, 1 << 30, ()))


def needs_triton(item) -> bool:
    """Kernel tests, tests run with a "triton" parameter (a backend), and tests marked triton."""
    params = getattr(item, "callspec", None)
    params = params.params.values() if params else ()
    return (item.get_closest_marker("triton") is not None or KERNEL_TESTS in item.path.parents
            or any(isinstance(v, str) and v == "triton" for v in params))


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_triton = pytest.mark.skip(reason=NO_TRITON)
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif not HAS_TRITON and needs_triton(item):
            item.add_marker(no_triton)


def _missing_triton(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "triton":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Module(pytest.Module):
    """A test module that skips, naming triton, when its import fails for want of triton."""

    def collect(self):
        try:
            return super().collect()            # imports the module
        except self.CollectError as e:
            if not HAS_TRITON and _missing_triton(e):
                pytest.skip(f"{NO_TRITON} ({self.path.name} imports it)", allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


class KilledRun(Exception):
    """Raised by :func:`killed_then_resumed`'s checkpoint hook to end a run abruptly."""


def killed_then_resumed(monkeypatch, make_cfg, kill_at: int) -> dict:
    """Trains ``make_cfg(False)``, killed right after its step-``kill_at`` checkpoint is written,
    then ``make_cfg(True)`` (the same run directory, resuming); returns the resumed run's result."""
    from bstrain.train import strategy as strategy_mod      # (the strategy writes the checkpoint files)
    from bstrain.train.trainer import train
    real_save = strategy_mod.save_checkpoint

    def save_then_die(path, state):
        real_save(path, state)
        if state["step"] == kill_at:
            raise KilledRun
    monkeypatch.setattr(strategy_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KilledRun):
        train(make_cfg(False))
    monkeypatch.setattr(strategy_mod, "save_checkpoint", real_save)
    return train(make_cfg(True))
