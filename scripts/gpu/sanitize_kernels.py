"""Every Triton kernel once, at small sizes, for compute-sanitizer (memcheck, initcheck, racecheck).

    compute-sanitizer --tool initcheck python3 scripts/gpu/sanitize_kernels.py

Outputs are plain torch.empty here (no NaN poisoning), so initcheck can report any read of
memory that nothing wrote. Each result is checked against a float64 reference; the script
exits 1 on a wrong result.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain.kernels import ew as ew_kernels  # noqa: E402
from bstrain.kernels import matmul as mm  # noqa: E402
from bstrain.kernels import norms as ln  # noqa: E402
from bstrain.kernels.matmul_luts import make_luts  # noqa: E402


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    print(f"case {name}", flush=True)          # places any sanitizer report that follows
    err = (got.double().cpu() - want).abs().max().item() / max(1e-30, want.abs().max().item())
    ok = err <= tol and bool(torch.isfinite(got).all())
    if not ok:
        print(f"WRONG {name}: relative error {err:.3g}")
    return ok


def matmul_cases() -> bool:
    ok = True
    rng = np.random.default_rng(0)
    for bs in (8, 16, 32, 64, 128):
        lay = rng.random((4, 3)) < 0.6
        lay[1, :] = False
        lay[0, 0] = lay[2, 1] = True
        luts = make_luts(lay, bs, "cuda")
        wd_idx = np.nonzero(lay)
        for axis in (0, 1):
            for n in (29, 64, 300):
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    C, K = 4 * bs, 3 * bs
                    x = torch.randn((n, C) if axis else (C, n), device="cuda").to(dtype)
                    dy = torch.randn((n, K) if axis else (K, n), device="cuda").to(dtype)
                    w = (torch.randn(luts.nnz, bs, bs, device="cuda") / bs**0.5).to(dtype)
                    dense = torch.zeros(4, bs, 3, bs, dtype=torch.float64)
                    dense[wd_idx[0], :, wd_idx[1], :] = w.double().cpu()
                    dense = dense.reshape(C, K)
                    xr = (x if axis else x.t()).double().cpu()
                    dyr = (dy if axis else dy.t()).double().cpu()
                    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
                    y = mm.bsmm_forward(x, w, luts, axis)
                    ok &= check(f"fwd bs{bs} axis{axis} n{n} {dtype}", y if axis else y.t(), xr @ dense, tol)
                    dx = mm.bsmm_dx(dy, w, luts, axis)
                    ok &= check(f"dx bs{bs} axis{axis} n{n} {dtype}", dx if axis else dx.t(), dyr @ dense.t(), tol)
                    dw = mm.bsmm_dw(x, dy, luts, axis)
                    full = (xr.t() @ dyr).reshape(4, bs, 3, bs)[wd_idx[0], :, wd_idx[1], :]
                    ok &= check(f"dw bs{bs} axis{axis} n{n} {dtype}", dw, full, tol)
                    nan_out = torch.full_like(dw, float("nan"))          # any unwritten element stays NaN
                    ok &= check(f"dw into NaN bs{bs} axis{axis} n{n} {dtype}",
                                mm.bsmm_dw(x, dy, luts, axis, out=nan_out), full, tol)
    return ok


def norm_and_gate_cases() -> bool:
    from bstrain.ops.ew import fused_lstm_gates_ref
    from bstrain.ops.norms import layer_norm_ref
    ok = True
    for axis, n, c, seg in ((1, 37, 148, 4), (0, 37, 148, 4), (1, 531, 12000, 2), (0, 40, 8000, 1)):
        x = torch.randn((n, c) if axis else (c, n), device="cuda")
        g, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
        for relu in (False, True):
            y, mean, rstd = ln.layer_norm_forward(x, g, b, axis, 1e-6, relu, seg)
            x64, g64, b64 = (t.double().cpu().requires_grad_() for t in (x, g, b))
            pre = layer_norm_ref(x64, g64, b64, axis, 1e-6, False, seg)
            ok &= check(f"ln fwd axis{axis} c{c} relu{relu}", y, pre.clamp_min(0) if relu else pre, 1e-4)
            dy = torch.randn_like(x)
            ((pre * (y.cpu() > 0)) if relu else pre).backward(dy.double().cpu())
            dx, dg, db, _ = ln.layer_norm_backward(dy, x, g, b, mean, rstd, axis, relu, seg)
            ok &= check(f"ln dx axis{axis} c{c} relu{relu}", dx, x64.grad, 1e-4)
            ok &= check(f"ln dg axis{axis} c{c} relu{relu}", dg, g64.grad, 1e-4)
    c, h = torch.randn(7, 33, device="cuda"), torch.randn(7, 132, device="cuda")
    bias = torch.randn(132, device="cuda")
    cn, hn = ew_kernels.lstm_gates_forward(c, *h.chunk(4, 1), bias=bias)
    rc, rh = fused_lstm_gates_ref(c.double().cpu(), *(h + bias).double().cpu().chunk(4, 1))
    ok &= check("lstm new_c", cn, rc, 1e-5) & check("lstm new_h", hn, rh, 1e-5)
    dc, dg = ew_kernels.lstm_gates_backward(c, *h.chunk(4, 1), torch.randn_like(c), torch.randn_like(c), bias=bias)
    ok &= bool(torch.isfinite(dc).all() and torch.isfinite(dg).all())
    return ok


def fused_cases() -> bool:
    """Layer norm with a multiplicative operand, and the fused LSTM cell (a ragged hidden size and
    the lstm_enwik8 width), both backward kernels also adding into a workspace."""
    from bstrain.kernels import lstm_cell as cell
    from bstrain.ops.lstm_cell import fused_lstm_cell_ref
    from bstrain.ops.norms import layer_norm_ref
    ok = True
    x, m = torch.randn(37, 4096, device="cuda"), torch.randn(37, 4096, device="cuda")
    g, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    y, mean, rstd = ln.layer_norm_forward(x, g, b, 1, 1e-6, False, 1, m)
    ok &= check("ln mul fwd", y, layer_norm_ref(*(t.double().cpu() for t in (x, g, b)), 1, 1e-6, False, 1,
                                              m.double().cpu()), 1e-4)
    dy = torch.randn_like(x)
    for workspace in (None, lambda shape: torch.zeros(shape, device="cuda")):
        dx, dg, db, dm = ln.layer_norm_backward(dy, x, g, b, mean, rstd, 1, False, 1, m, workspace)
        ok &= bool(torch.isfinite(dx).all() and torch.isfinite(dm).all())
    for n, H in ((7, 33), (64, 4096)):
        c, z, xg = torch.randn(n, H, device="cuda"), torch.randn(n, 4 * H, device="cuda"), \
            torch.randn(n, 5 * H, device="cuda")[:, H:]
        g, b, bias = (torch.randn(4 * H, device="cuda") for _ in range(3))
        cn, hn, mean, rstd = cell.lstm_cell_forward(c, z, xg, g, b, bias)
        rc, rh = fused_lstm_cell_ref(*(t.double().cpu() for t in (c, z, xg, g, b, bias)))
        ok &= check(f"lstm cell new_c H{H}", cn, rc, 1e-5) & check(f"lstm cell new_h H{H}", hn, rh, 1e-5)
        for workspace in (None, lambda shape: torch.zeros(shape, device="cuda")):
            out = cell.lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, torch.randn_like(c), torch.randn_like(c),
                                          workspace=workspace)
            ok &= bool(all(torch.isfinite(t).all() for t in out if t is not None))
    return ok


if __name__ == "__main__":
    torch.manual_seed(0)
    only = sys.argv[1] if len(sys.argv) > 1 else "all"
    good = (matmul_cases() if only in ("all", "matmul") else True) & \
        (norm_and_gate_cases() if only in ("all", "norms") else True) & \
        (fused_cases() if only in ("all", "fused") else True)
    torch.cuda.synchronize()
    print("all kernel results correct" if good else "WRONG RESULTS")
    sys.exit(0 if good else 1)
