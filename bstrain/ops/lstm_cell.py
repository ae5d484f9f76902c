"""The LSTM cell updates: the seed's fused LSTM gates, and the fused mLSTM cell.

``fused_lstm_gates(c, h)`` (with ``split4`` and ``concat4``) is the seed's cell update on the four
gate pre-activations, gate order i, u, f, o: ``new_c = σ(f + forget_bias)·c + σ(i)·tanh(u)``,
``new_h = σ(o)·tanh(new_c)``. Its Triton kernel (:mod:`bstrain.kernels.ew`) measurably beats
``torch.compile`` of the same math (scripts/bench/bench_ops.py, benchmarks/ops.md), so CUDA tensors run it.

``fused_lstm_cell`` goes one step further: per-gate layer norm of the recurrent pre-activations, the
input add and the LSTM gates, in one kernel each way on CUDA.

    gates        = xg + LN4(z; g, b) + bias        LN4: layer norm of each of the four H-wide gate segments
    new_c, new_h = fused_lstm_gates(c, gates)      gate order i, u, f, o

It stands for ``layer_norm(z, g, b, segments=4)``, an add and ``fused_lstm_gates`` (three launches and
an (N, 4H) tensor each way), and keeps the pre-activations in fp32 rather than rounding them to
z's dtype in between.

Each of the two, in this file's order: the reference → the kernel pair, from which
:func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops (``torch.ops.bstrain.lstm_gates`` and
``lstm_gates_bwd``; ``lstm_cell`` and ``lstm_cell_bwd``, fake and autograd) and the eager
``autograd.Function`` → the public function.
"""
from __future__ import annotations

import torch
from torch import Tensor

from bstrain.ops._checks import HALF, KERNEL_FLOATS, check_param, check_same, check_tensor, use_kernels
from bstrain.ops._dispatch import kernel_op
from bstrain.ops._seed import ignores
from bstrain.ops.norms import layer_norm_bwd_ref, layer_norm_ref, layer_norm_stats_ref
from bstrain.ops.tables import eager

__all__ = ["split4", "concat4", "fused_lstm_gates", "fused_lstm_gates_ref", "fused_lstm_gates_bwd_ref",
           "fused_lstm_cell", "fused_lstm_cell_ref"]


# === the seed's LSTM gates =============================================================================
# --- gate views ----------------------------------------------------------------------------------------
def split4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, 4K) -> four (N, K) views, in gate order i, u, f, o."""
    if x.dim() != 2 or x.shape[1] % 4:
        raise ValueError(f"x: expected (N, 4K), got {tuple(x.shape)}")
    return tuple(x.chunk(4, dim=1))


def concat4(x0, x1, x2, x3) -> torch.Tensor:
    """Four (N, K) tensors -> (N, 4K)."""
    xs = (x0, x1, x2, x3)
    check_same(("x0", "x1", "x2", "x3"), *xs)
    for i, x in enumerate(xs):
        if x.shape != x0.shape or x.dim() != 2:
            raise ValueError(f"x{i}: expected shape {tuple(x0.shape)} (2-D, as x0), got {tuple(x.shape)}")
    return torch.cat(xs, dim=1)


# --- reference -----------------------------------------------------------------------------------------
def fused_lstm_gates_ref(c, i, u, f, o, forget_bias: float = 1.0):
    """PyTorch LSTM cell update on pre-activations: returns (new_c, new_h)."""
    new_c = c * torch.sigmoid(f + forget_bias) + torch.sigmoid(i) * torch.tanh(u)
    return new_c, torch.tanh(new_c) * torch.sigmoid(o)


def _gates_work(c, i, u, f, o, bias):
    """c and the four gate pre-activations (bias added) in the math dtype (fp32 for 16-bit)."""
    work = torch.promote_types(c.dtype, torch.float32)
    gates = [t.to(work) for t in (i, u, f, o)]
    if bias is not None:
        gates = [t + bb.to(work) for t, bb in zip(gates, bias.reshape(4, -1))]
    return c.to(work), gates


def fused_lstm_gates_bwd_ref(c, i, u, f, o, bias, dc_new, dh_new, forget_bias: float):
    """(dc (N, K), dgates (N, 4K) in the order i, u, f, o) of the cell update, by the formulas, in
    c's dtype (math in fp32 for 16-bit inputs)."""
    cw, (gi, gu, gf, go) = _gates_work(c, i, u, f, o, bias)
    si, tu, sf, so = torch.sigmoid(gi), torch.tanh(gu), torch.sigmoid(gf + forget_bias), torch.sigmoid(go)
    t = torch.tanh(cw * sf + si * tu)
    dh = dh_new.to(cw.dtype)
    dcn = dh * so * (1 - t * t) + (dc_new.to(cw.dtype) if dc_new is not None else 0)
    dg = torch.cat([dcn * tu * si * (1 - si), dcn * si * (1 - tu * tu), dcn * cw * sf * (1 - sf),
                    dh * t * so * (1 - so)], dim=1)
    return (dcn * sf).to(c.dtype), dg.to(c.dtype)


def _gates_fwd_ref(c: Tensor, i: Tensor, u: Tensor, f: Tensor, o: Tensor, bias: Tensor | None,
                   forget_bias: float) -> tuple[Tensor, Tensor]:
    cw, gates = _gates_work(c, i, u, f, o, bias)
    new_c, new_h = fused_lstm_gates_ref(cw, *gates, forget_bias=forget_bias)
    return new_c.to(c.dtype), new_h.to(c.dtype)


# --- kernel pair: torch.ops.bstrain.lstm_gates and lstm_gates_bwd, and their eager Function ------------
def _gates_forward(c: Tensor, i: Tensor, u: Tensor, f: Tensor, o: Tensor, bias: Tensor | None,
                   forget_bias: float, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """(new_c, new_h), (N, K) each, from c and the gates i, u, f, o ((N, K) views, unit feature
    stride); bias: (4K,) or None, added to the gates. The math is fp32 for 16-bit inputs.
    ``check=False``: the caller has checked the arguments (eager calls)."""
    from bstrain.kernels.ew import lstm_gates_forward
    return lstm_gates_forward(c, i, u, f, o, bias, forget_bias, check=check)


def _gates_backward(c: Tensor, i: Tensor, u: Tensor, f: Tensor, o: Tensor, bias: Tensor | None,
                    dc_new: Tensor | None, dh_new: Tensor, forget_bias: float, *,
                    check: bool = True) -> tuple[Tensor, Tensor]:
    """(dc (N, K), dgates (N, 4K) in the order i, u, f, o), in c's dtype."""
    from bstrain.kernels.ew import lstm_gates_backward
    if check:
        for name, d in (("dc_new", dc_new), ("dh_new", dh_new)):
            if d is not None and d.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(d.shape)}")
    return lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias, forget_bias, check=check)


def _gates_setup(ctx, inputs, output):
    c, i, u, f, o, bias, forget_bias = inputs
    ctx.save_for_backward(c, i, u, f, o, bias)
    ctx.forget_bias = forget_bias
    ctx.set_materialize_grads(False)


def _dbias(dg: torch.Tensor, bias: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    if bias is None or not needed:
        return None
    dbias = dg.sum(0, dtype=torch.float32)
    return dbias if dbias.dtype == bias.dtype else dbias.to(bias.dtype)


def _gates_grads(ctx, bwd, dc_new, dh_new):
    c, i, u, f, o, bias = ctx.saved_tensors
    if dh_new is None:
        dh_new = torch.zeros_like(c)
    dc, dg = bwd(c, i, u, f, o, bias, dc_new, dh_new, ctx.forget_bias, check=False)
    return (dc,) + tuple(dg.chunk(4, dim=1)) + (_dbias(dg, bias, ctx.needs_input_grad[5]), None)


_lstm_gates_bwd = kernel_op(
    "bstrain::lstm_gates_bwd", _gates_backward, ref=fused_lstm_gates_bwd_ref,
    fake=lambda c, i, u, f, o, bias, dc_new, dh_new, forget_bias: (c.new_empty(c.shape),
                                                                   c.new_empty((c.shape[0], 4 * c.shape[1]))))
_lstm_gates = kernel_op(
    "bstrain::lstm_gates", _gates_forward, ref=_gates_fwd_ref,
    fake=lambda c, i, u, f, o, bias, forget_bias: (c.new_empty(c.shape), c.new_empty(c.shape)),
    setup=_gates_setup, backward=_gates_grads, bwd=_lstm_gates_bwd)


# --- public function -----------------------------------------------------------------------------------
@ignores("name")                        # the seed's name= (a TensorFlow op name)
def fused_lstm_gates(c: torch.Tensor, *args: torch.Tensor, bias: torch.Tensor | None = None,
                     forget_bias: float = 1.0, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's fused LSTM cell update.

    Gate order (as in the seed): **i, u, f, o** — input gate, update (candidate), forget gate,
    output gate. ``new_c = σ(f + forget_bias)·c + σ(i)·tanh(u)``, ``new_h = σ(o)·tanh(new_c)``.

    Args:
        c: (N, K) cell state.
        *args: one (N, 4K) tensor holding the four gate pre-activations side by side, or four
            (N, K) tensors i, u, f, o.
        bias: 4K elements of any shape ((4K,), (1, 4K), ...), added to the fused gates
            (one-tensor form only); c's dtype, or float32 with 16-bit gates.
        backend: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1) or "torch".
    Returns (new_c, new_h), each (N, K) in c's dtype. The math is fp32 for 16-bit inputs.
    """
    check_tensor("c", c)
    if len(args) == 1:
        h = args[0]
        check_same(("c", "h"), c, h)
        if c.dim() != 2 or h.dim() != 2 or h.shape != (c.shape[0], 4 * c.shape[1]):
            raise ValueError(f"h: expected shape (N, 4K) = {(c.shape[0], 4 * c.shape[1])} for c "
                             f"{tuple(c.shape)}, got {tuple(h.shape)}")
        if bias is not None:
            bias = check_param("bias", bias, h, h.shape[1])
        gates = h.chunk(4, dim=1)
    elif len(args) == 4:
        check_same(("c", "i", "u", "f", "o"), c, *args)
        if c.dim() != 2:
            raise ValueError(f"c: expected a 2-D (N, K) tensor, got shape {tuple(c.shape)}")
        for name, g in zip("iufo", args):
            if g.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(g.shape)}")
        if bias is not None:
            raise ValueError("bias: only supported with the fused (N, 4K) gate tensor")
        gates = args
    else:
        raise ValueError(f"args: expected one (N, 4K) gate tensor or four (N, K) tensors i, u, f, o, "
                         f"got {len(args)} tensors")
    if use_kernels(c, backend):                                              # the kernel adds the bias
        c, *gates = (t if t.stride(1) == 1 else t.contiguous() for t in (c, *gates))
        return _lstm_gates(c, *gates, bias.contiguous() if bias is not None else None, float(forget_bias),
                           check=False)
    if bias is not None:
        gates = (args[0] + bias).chunk(4, dim=1)                             # fp32 with an fp32 bias
    elif c.dtype in HALF:
        gates = tuple(g.float() for g in gates)
    new_c, new_h = fused_lstm_gates_ref(c.to(gates[0].dtype), *gates, forget_bias=forget_bias)
    return new_c.to(c.dtype), new_h.to(c.dtype)


# === the fused mLSTM cell ==============================================================================
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


def _cell_fwd_ref(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, forget_bias: float,
                  eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    mean, rstd = layer_norm_stats_ref(z, 1, eps, 4)
    return (*fused_lstm_cell_ref(c, z, xg, g, b, bias, forget_bias, eps), mean, rstd)


# --- kernel pair: torch.ops.bstrain.lstm_cell and lstm_cell_bwd, and their eager Function --------------
def _check_cell(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor) -> None:
    """The kernel's contract: c (N, H), z and xg (N, 4H), one float dtype, unit column stride;
    g, b, bias contiguous (4H,) on c's device."""
    if c.dtype not in KERNEL_FLOATS:
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


def _cell_forward(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, forget_bias: float,
                  eps: float, *, check: bool = True, group=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(new_c, new_h, mean, rstd): the cell and LN4's (N, 4) statistics (fp32; fp64 for fp64 c).
    ``check=False``: the caller has checked the arguments; ``group``: a ParamGradGroup for the
    backward (eager calls; ``ctx.hints``)."""
    from bstrain.kernels.lstm_cell import lstm_cell_forward
    if check:
        _check_cell(c, z, xg, g, b, bias)
    return lstm_cell_forward(c, z, xg, g, b, bias, forget_bias, eps)


def _cell_backward(c: Tensor, z: Tensor, xg: Tensor, g: Tensor, b: Tensor, bias: Tensor, mean: Tensor,
                   rstd: Tensor, dc_new: Tensor | None, dh_new: Tensor, forget_bias: float, *, eager_call: bool = False,
                   need_dbias: bool = True, workspace=None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dc, dz, dxg, dg, db, dbias), each in its input's dtype. Eager calls (``eager_call=True``) skip
    the checks and may return dg and db as views of one sum; ``need_dbias=False`` gives dbias None;
    with a ``workspace`` (a ParamGradGroup's) dg, db and dbias are added into it and come back None."""
    from bstrain.kernels.lstm_cell import lstm_cell_backward
    if not eager_call:
        _check_cell(c, z, xg, g, b, bias)
        for name, d in (("dc_new", dc_new), ("dh_new", dh_new)):
            if d is not None and d.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(d.shape)}")
    dc, dz, dxg, dg, db = lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias, workspace)
    if dg is None:                                      # added into the group's workspace
        return dc, dz, dxg, None, None, None
    dbias = db.to(bias.dtype, copy=True) if need_dbias else None
    # dg and db are views of one sum: an op's outputs may not share storage (autograd takes views)
    return dc, dz, dxg, dg.to(g.dtype, copy=not eager_call), db.to(b.dtype, copy=not eager_call), dbias


def _cell_fake(c, z, xg, g, b, bias, forget_bias, eps):
    stats = c.new_empty((c.shape[0], 4), dtype=torch.promote_types(c.dtype, torch.float32))
    return c.new_empty(c.shape), c.new_empty(c.shape), stats, stats.clone()


def _cell_bwd_fake(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias):
    return (c.new_empty(c.shape), z.new_empty(z.shape), xg.new_empty(xg.shape), torch.empty_like(g),
            torch.empty_like(b), torch.empty_like(bias))


def _cell_setup(ctx, inputs, output):
    c, z, xg, g, b, bias, forget_bias, eps = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(c, z, xg, g, b, bias, mean, rstd)
    ctx.forget_bias = forget_bias
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _cell_grads(ctx, bwd, dc_new, dh_new, _dmean, _drstd):
    """With a ParamGradGroup (eager calls), g, b and bias are the group's views and the backward
    kernel adds dg and db (= dbias) into its workspace."""
    c, z, xg, g, b, bias, mean, rstd = ctx.saved_tensors
    group = ctx.hints.get("group")
    if dh_new is None:
        dh_new = torch.zeros_like(c)
    grads = bwd(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, ctx.forget_bias, eager_call=True,
                need_dbias=ctx.needs_input_grad[5],
                workspace=None if group is None else lambda shape: group.workspace(shape, c.device))
    return (*grads, None, None)


_lstm_cell_bwd = kernel_op("bstrain::lstm_cell_bwd", _cell_backward, ref=fused_lstm_cell_bwd_ref,
                           fake=_cell_bwd_fake)
_lstm_cell = kernel_op("bstrain::lstm_cell", _cell_forward, ref=_cell_fwd_ref, fake=_cell_fake, setup=_cell_setup,
                       backward=_cell_grads, bwd=_lstm_cell_bwd)


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
        check_tensor(name, t)
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
    if grad_group is not None and eager(c):          # (traced calls leave the group out)
        g, b, bias = grad_group.views
    c, z, xg = (t if t.stride(1) == 1 else t.contiguous() for t in (c, z, xg))
    out = _lstm_cell(c, z, xg, g.contiguous(), b.contiguous(), bias.contiguous(), float(forget_bias), float(epsilon),
                     check=False, group=grad_group)
    return out[0], out[1]
