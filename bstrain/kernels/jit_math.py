"""``@triton.jit`` math that more than one kernel file calls, under public names: the LSTM gate
math (:mod:`bstrain.kernels.ew`'s gates and :mod:`bstrain.kernels.lstm_cell`'s fused cell) and the
layer-norm backward pieces (:mod:`bstrain.kernels.norms`, :mod:`bstrain.kernels.residual_norm`,
:mod:`bstrain.kernels.lstm_cell`).

Triton resolves the functions a kernel calls among its module's globals when it compiles, so a
caller imports these names at module level.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def lstm_gates(c, i, u, f, o, forget_bias):
    """(new_c, new_h) from c and the gate pre-activations (fp32): new_c = σ(f + fb)·c + σ(i)·tanh(u),
    new_h = σ(o)·tanh(new_c)."""
    new_c = _sigmoid(f + forget_bias) * c + _sigmoid(i) * _tanh(u)
    return new_c, _sigmoid(o) * _tanh(new_c)


@triton.jit
def lstm_gates_grads(c, i, u, f, o, dh, dcn, forget_bias):
    """(dc, di, du, df, do) of :func:`lstm_gates`, from dh (new_h's gradient) and dcn (new_c's, or 0);
    the activations are recomputed from the pre-activations."""
    si = _sigmoid(i)
    tu = _tanh(u)
    sf = _sigmoid(f + forget_bias)
    so = _sigmoid(o)
    t = _tanh(sf * c + si * tu)
    dcn = dcn + dh * so * (1.0 - t * t)
    return dcn * sf, dcn * tu * si * (1.0 - si), dcn * si * (1.0 - tu * tu), dcn * c * sf * (1.0 - sf), \
        dh * t * so * (1.0 - so)


@triton.jit
def load_state_grads(DHN, DCN, offs, mask, HAS_DC: tl.constexpr):
    """(dh, dcn) at offs, fp32: the gradients reaching new_h and new_c (zero without DCN)."""
    dh = tl.load(DHN + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DC:
        dcn = tl.load(DCN + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        dcn = tl.zeros_like(dh)
    return dh, dcn


@triton.jit
def store_partial(P, val, mask, ACCUMULATE: tl.constexpr):
    """P[...] = val, or P[...] += val into a caller's workspace (one program owns each element)."""
    if ACCUMULATE:
        val += tl.load(P, mask=mask, other=0.0)
    tl.store(P, val, mask=mask)


@triton.jit
def layer_norm_input_grad(dxhat, xhat, rstd, s1, s2, n):
    """dx of a layer norm from dxhat = dy·g: s1 and s2 hold dxhat·xhat and dxhat, summed over the
    segment along axis 1 (whole-segment tiles, or per-lane sums of a looped pass)."""
    c1 = tl.sum(s1, axis=1) / n
    c2 = tl.sum(s2, axis=1) / n
    return (dxhat - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
