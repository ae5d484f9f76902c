"""The fused mLSTM cell: per-gate layer norm of the recurrent pre-activations, the input add and the
LSTM gates, in one kernel each way on CUDA.

    gates        = xg + LN4(z; g, b) + bias        LN4: layer norm of each of the four H-wide gate segments
    new_c, new_h = fused_lstm_gates(c, gates)      gate order i, u, f, o (bstrain.ops.ew)

It stands for ``layer_norm(z, g, b, segments=4)``, an add and ``fused_lstm_gates`` (three launches and
an (N, 4H) tensor each way), and keeps the pre-activations in fp32 rather than rounding them to
z's dtype in between.

In this file's order: the reference → the custom ops ``torch.ops.bstrain.lstm_cell`` and
``lstm_cell_bwd`` (fake, autograd) → the eager ``autograd.Function`` → the public function.
"""
from __future__ import annotations

import torch
from torch import Tensor

from bstrain.ops.ew import _check_tensor, check_param, fused_lstm_gates_bwd_ref, fused_lstm_gates_ref, use_kernels
from bstrain.ops.norms import layer_norm_bwd_ref, layer_norm_ref, layer_norm_stats_ref
from bstrain.ops.tables import eager

__all__ = ["fused_lstm_cell", "fused_lstm_cell_ref"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- reference --------------------------------------------------------------------------------------
def _preact_ref(z, xg, g, b, bias, work, eps, stats=None):
    """xg + LN4(z) + bias in ``work`` (fp32, or fp64 for fp64 inputs), from z's own statistics or
    the given (mean, rstd)."""
    if stats is None:
        ln = layer_norm_ref(z.to(work), g, b, 1, eps, False, 4)
    else:
        mean, rstd = stats
        n = z.shape[0]
        ln = ((z.to(work).reshape(n, 4, -1) - mean[..., None]) * rstd[..., None]).reshape(n, -1) * g.to(work) + \
            b.to(work)
    return xg.to(work) + ln + bias.to(work)


def fused_lstm_cell_ref(c, z, xg, g, b, bias, forget_bias: float = 1.0, epsilon: float = 1e-6):
    """PyTorch fused cell: the CPU path and the tests' oracle (differentiable). Math in fp32 (fp64
    for fp64 c); returns (new_c, new_h) in c's dtype."""
    work = torch.promote_types(c.dtype, torch.float32)
    gates = _preact_ref(z, xg, g, b, bias, work, epsilon).chunk(4, dim=1)
    new_c, new_h = fused_lstm_gates_ref(c.to(work), *gates, forget_bias=forget_bias)
    return new_c.to(c.dtype), new_h.to(c.dtype)


def fused_lstm_cell_bwd_ref(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias: float):
    """(dc, dz, dxg, dg, db, dbias) of the cell by the formulas (the custom op's CPU backward runs
    below autograd); each in its input's dtype."""
    work = mean.dtype
    pre = _preact_ref(z, xg, g, b, bias, work, 0.0, (mean, rstd))
    dc, dpre = fused_lstm_gates_bwd_ref(c.to(work), *pre.chunk(4, dim=1), None, dc_new, dh_new, forget_bias)
    dz, dg, db, _ = layer_norm_bwd_ref(dpre, z, g, b, mean, rstd, 1, False, 4)
    return dc.to(c.dtype), dz, dpre.to(xg.dtype), dg, db, dpre.sum(0).to(bias.dtype)


# --- custom ops (traced calls) -------------------------------------------------------------------------
def _check_cell(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor) -> None:
    """The kernel's contract: c (N, H), z and xg (N, 4H), one float dtype, unit column stride;
    g, b, bias contiguous (4H,) on c's device."""
    if c.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"c: expected float32, float16 or bfloat16, got {c.dtype}")
    if c.dim() != 2 or c.shape[1] == 0 or c.stride(1) != 1:
        raise ValueError(f"c: expected a 2-D (N, H) tensor with H >= 1 and unit stride along H, got shape "
                         f"{tuple(c.shape)}, strides {c.stride()}")
    n, H = c.shape
    for name, t in (("z", z), ("xg", xg)):
        if t.dtype != c.dtype:
            raise TypeError(f"{name}: expected {c.dtype} (as c), got {t.dtype}")
        if t.shape != (n, 4 * H) or t.stride(1) != 1 or t.device != c.device:
            raise ValueError(f"{name}: expected shape {(n, 4 * H)} with unit stride along features on {c.device}, "
                             f"got {tuple(t.shape)}, strides {t.stride()} on {t.device}")
    for name, p in (("g", g), ("b", b), ("bias", bias)):
        if p.shape != (4 * H,) or not p.is_contiguous() or p.device != c.device:
            raise ValueError(f"{name}: expected a contiguous ({4 * H},) tensor on {c.device}, got "
                             f"{tuple(p.shape)} on {p.device}")


@torch.library.custom_op("bstrain::lstm_cell", mutates_args=())
def _lstm_cell_op(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, forget_bias: float,
                  eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(new_c, new_h, mean, rstd): the cell and LN4's (N, 4) statistics (fp32; fp64 for fp64 c).
    CUDA: the kernel; CPU: the reference."""
    if c.is_cuda:
        from bstrain.kernels.lstm_cell import lstm_cell_forward
        _check_cell(c, z, xg, g, b, bias)
        return lstm_cell_forward(c, z, xg, g, b, bias, forget_bias, eps)
    mean, rstd = layer_norm_stats_ref(z, 1, eps, 4)
    return (*fused_lstm_cell_ref(c, z, xg, g, b, bias, forget_bias, eps), mean, rstd)


@_lstm_cell_op.register_fake
def _(c, z, xg, g, b, bias, forget_bias, eps):
    stats = c.new_empty((c.shape[0], 4), dtype=torch.promote_types(c.dtype, torch.float32))
    return c.new_empty(c.shape), c.new_empty(c.shape), stats, stats.clone()


@torch.library.custom_op("bstrain::lstm_cell_bwd", mutates_args=())
def _lstm_cell_bwd_op(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, mean: Tensor,
                      rstd: Tensor, dc_new: Tensor | None, dh_new: Tensor,
                      forget_bias: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dc, dz, dxg, dg, db, dbias), each in its input's dtype."""
    if not c.is_cuda:
        return fused_lstm_cell_bwd_ref(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias)
    from bstrain.kernels.lstm_cell import lstm_cell_backward
    _check_cell(c, z, xg, g, b, bias)
    for name, d in (("dc_new", dc_new), ("dh_new", dh_new)):
        if d is not None and d.shape != c.shape:
            raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(d.shape)}")
    dc, dz, dxg, dg, db = lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias)
    # dg and db are views of one sum: outputs may not share storage
    return dc, dz, dxg, dg.to(g.dtype, copy=True), db.to(b.dtype, copy=True), db.to(bias.dtype, copy=True)


@_lstm_cell_bwd_op.register_fake
def _(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias):
    return (c.new_empty(c.shape), z.new_empty(z.shape), xg.new_empty(xg.shape), torch.empty_like(g),
            torch.empty_like(b), torch.empty_like(bias))


def _cell_setup(ctx, inputs, output):
    c, z, xg, g, b, bias, forget_bias, eps = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(c, z, xg, g, b, bias, mean, rstd)
    ctx.forget_bias = forget_bias
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _cell_backward(ctx, dc_new, dh_new, _dmean, _drstd):
    c, z, xg, g, b, bias, mean, rstd = ctx.saved_tensors
    if dh_new is None:
        dh_new = torch.zeros_like(c)
    grads = _lstm_cell_bwd_op(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, ctx.forget_bias)
    return (*grads, None, None)


_lstm_cell_op.register_autograd(_cell_backward, setup_context=_cell_setup)


# --- eager autograd -------------------------------------------------------------------------------------
class _LstmCell(torch.autograd.Function):
    """The custom ops' kernels without the dispatcher's round trip. With a ParamGradGroup, g, b and
    bias are the group's views and the backward kernel adds dg and db (= dbias) into its workspace."""

    @staticmethod
    def forward(ctx, c, z, xg, g, b, bias, forget_bias, eps, group):
        from bstrain.kernels.lstm_cell import lstm_cell_forward
        c, z, xg = (t if t.stride(1) == 1 else t.contiguous() for t in (c, z, xg))
        g, b, bias = g.contiguous(), b.contiguous(), bias.contiguous()
        new_c, new_h, mean, rstd = lstm_cell_forward(c, z, xg, g, b, bias, forget_bias, eps)
        ctx.save_for_backward(c, z, xg, g, b, bias, mean, rstd)
        ctx.forget_bias, ctx.group = forget_bias, group
        ctx.set_materialize_grads(False)
        return new_c, new_h

    @staticmethod
    def backward(ctx, dc_new, dh_new):
        from bstrain.kernels.lstm_cell import lstm_cell_backward
        c, z, xg, g, b, bias, mean, rstd = ctx.saved_tensors
        group = ctx.group
        if dh_new is None:
            dh_new = torch.zeros_like(c)
        dc, dz, dxg, dg, db = lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, ctx.forget_bias,
                                                 None if group is None else
                                                 lambda shape: group.workspace(shape, c.device))
        if dg is None:
            return dc, dz, dxg, None, None, None, None, None, None
        dbias = db.to(bias.dtype, copy=True) if ctx.needs_input_grad[5] else None
        return dc, dz, dxg, dg.to(g.dtype), db.to(b.dtype), dbias, None, None, None


# --- public function ------------------------------------------------------------------------------------
def fused_lstm_cell(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, forget_bias: float = 1.0,
                    epsilon: float = 1e-6, *, grad_group=None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """The mLSTM cell update after the recurrent matmul, fused: ``fused_lstm_gates(c, xg +
    layer_norm(z, g, b, segments=4), bias=bias)`` with the pre-activations kept in fp32.

    Args:
        c: (N, H) cell state.
        z: (N, 4H) recurrent pre-activations (m·W_mg), normalised per gate segment; c's dtype.
        xg: (N, 4H) input pre-activations (x·W_xg), added after the norm; c's dtype.
        g, b: LN4's gain and bias, 4H elements of any shape; c's dtype, or float32 with 16-bit c.
        bias: the gate bias, 4H elements, as g.
        forget_bias: added to the forget gate's pre-activation (gate order i, u, f, o).
        grad_group: a :class:`bstrain.ops.grouping.ParamGradGroup` of (g, b, bias) with
            rows=(0, 1, 1), made once per sequence: the eager kernel path adds dg and db (which
            is also dbias) into it instead of handing them to autograd at every step.
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns (new_c, new_h), each (N, H) in c's dtype.
    """
    for name, t in (("c", c), ("z", z), ("xg", xg)):
        _check_tensor(name, t)
        if t.dtype != c.dtype:
            raise TypeError(f"{name}: expected dtype {c.dtype} (as c), got {t.dtype}")
        if t.device != c.device:
            raise ValueError(f"{name}: expected device {c.device} (as c), got {t.device}")
    if c.dim() != 2 or c.shape[1] == 0:
        raise ValueError(f"c: expected a 2-D (N, H) tensor with H >= 1, got shape {tuple(c.shape)}")
    n, H = c.shape
    for name, t in (("z", z), ("xg", xg)):
        if t.shape != (n, 4 * H):
            raise ValueError(f"{name}: expected shape (N, 4H) = {(n, 4 * H)} for c {tuple(c.shape)}, got "
                             f"{tuple(t.shape)}")
    g, b, bias = (check_param(name, p, z, 4 * H) for name, p in (("g", g), ("b", b), ("bias", bias)))
    if grad_group is not None and not grad_group.matches((g, b, bias), (0, 1, 1)):
        raise ValueError("grad_group: expected a group of these g, b and bias (param_grad_group(g, b, bias, "
                         "rows=(0, 1, 1))), got one of other parameters")
    if not use_kernels(c, backend):
        return fused_lstm_cell_ref(c, z, xg, g, b, bias, forget_bias, epsilon)
    if eager(c):
        if grad_group is not None:
            g, b, bias = grad_group.views
        return _LstmCell.apply(c, z, xg, g, b, bias, float(forget_bias), float(epsilon), grad_group)
    c, z, xg = (t if t.stride(1) == 1 else t.contiguous() for t in (c, z, xg))
    out = torch.ops.bstrain.lstm_cell(c, z, xg, g.contiguous(), b.contiguous(), bias.contiguous(),
                                      float(forget_bias), float(epsilon))
    return out[0], out[1]
