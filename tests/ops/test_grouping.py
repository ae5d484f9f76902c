"""bstrain.ops.grouping: per-timestep parameter gradients summed in the kernels' workspace equal
autograd's per-step sums, per backward pass."""
from __future__ import annotations

import pytest
import torch

from bstrain.ops import norms
from bstrain.ops.grouping import param_grad_group
from bstrain.ops.lstm_cell import fused_lstm_cell
from tests.conftest import kernel_device

pytestmark = pytest.mark.triton
STEPS = 3


def _leaves(H: int, dev: str) -> list[torch.Tensor]:
    """(g, b) of an H-wide layer norm, then (g, b, bias) of a cell of H."""
    sizes = (H, H, 4 * H, 4 * H, 4 * H)
    return [(torch.randn(n, device=dev) * 0.3 + (1.0 if i in (0, 2) else 0.0)).requires_grad_()
            for i, n in enumerate(sizes)]


def _recurrence(leaves, xs, group: bool):
    """STEPS steps of m = LN(h)·x (mul), m = ReLU(LN(m)), then the fused cell on m tiled four
    times: every kernel with grouped parameter gradients when asked."""
    g_h, b_h, g, b, bias = leaves
    H = xs.shape[-1] // 4
    grp_ln = param_grad_group(g_h, b_h) if group else None
    grp_cell = param_grad_group(g, b, bias, rows=(0, 1, 1)) if group else None
    c = torch.zeros(xs.shape[1], H, device=xs.device)
    h = torch.ones_like(c)
    out = 0.0
    for t in range(STEPS):
        m = norms.layer_norm(h, g_h, b_h, mul=xs[t, :, :H], grad_group=grp_ln, backend="triton")
        m = norms.layer_norm(m, g_h, b_h, relu=True, grad_group=grp_ln, backend="triton")
        c, h = fused_lstm_cell(c, m.repeat(1, 4), xs[t], g, b, bias, grad_group=grp_cell, backend="triton")
        out = out + (h * xs[t, :, :H]).sum()
    return out


def test_grouped_gradients_equal_autograd_sums(monkeypatch):
    """Also: a second pass over the same graph (retain_graph) starts from zero, and a pass that
    stops short of the parameters (gradients w.r.t. inputs only) leaves the next pass exact."""
    from bstrain.ops import grouping
    asked = []
    real = grouping._Workspaces.get_or_zero
    monkeypatch.setattr(grouping._Workspaces, "get_or_zero", lambda self, *a: asked.append(1) or real(self, *a))
    dev = kernel_device()
    H, B = 8, 3
    leaves = _leaves(H, dev)
    xs = torch.randn(STEPS, B, 4 * H, device=dev, requires_grad=True)
    want_out = _recurrence(leaves, xs, group=False)
    want = torch.autograd.grad(want_out, leaves + [xs])
    got_out = _recurrence(leaves, xs, group=True)
    torch.testing.assert_close(got_out, want_out)
    torch.autograd.grad(got_out, xs, retain_graph=True)                       # inputs only
    for _ in range(2):
        got = torch.autograd.grad(got_out, leaves + [xs], retain_graph=True)
        for i, (a, r) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"gradient {i}: {m}")
    assert len(asked) == 3 * STEPS * 3, "every step's backward kernel adds into its group, in each of 3 passes"


def test_nothing_to_group():
    g = torch.ones(4, requires_grad=True)
    assert param_grad_group(torch.ones(4), torch.zeros(4)) is None          # no parameter needs a gradient
    with torch.no_grad():
        assert param_grad_group(g) is None
    group = param_grad_group(g, g, rows=(0, 0))
    assert group.matches((g, g), (0, 0)) and not group.matches((g,), (0,)) and not group.matches((g, g), (0, 1))
