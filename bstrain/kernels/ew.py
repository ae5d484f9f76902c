"""Triton kernels for fused LSTM gates, and their launchers.

(A fused softmax cross-entropy kernel was measured too, and removed: torch.compile of the
PyTorch math matched it at V=65,536 and eager PyTorch beat it at V=256; benchmarks/ops.md.)

LSTM gate order is the seed's: i, u, f, o (input, update, forget, output). The gates arrive as
four (N, K) views with their own row strides, so one fused (N, 4K) tensor and four separate
tensors take the same path. The backward recomputes the gate activations from the
pre-activations instead of saving them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels.alloc import empty
from bstrain.kernels.jit_math import load_state_grads, lstm_gates, lstm_gates_grads
from bstrain.kernels.launch import Launch, aligned, plan

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_cell(C, I, U, F, O, BIAS, numel, K, stride_c, stride_i, stride_u, stride_f, stride_o,
               HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK elements of the (N, K) cell: flat offsets, mask, row, col, then c and
    the four gate pre-activations (bias added) in fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    row = offs // K
    col = offs % K
    c = tl.load(C + row * stride_c + col, mask=mask, other=0.0).to(tl.float32)
    i = tl.load(I + row * stride_i + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(F + row * stride_f + col, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + row * stride_o + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        i += tl.load(BIAS + col, mask=mask, other=0.0).to(tl.float32)
        u += tl.load(BIAS + K + col, mask=mask, other=0.0).to(tl.float32)
        f += tl.load(BIAS + 2 * K + col, mask=mask, other=0.0).to(tl.float32)
        o += tl.load(BIAS + 3 * K + col, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, row, col, c, i, u, f, o


@triton.jit
def _lstm_gates_fwd_kernel(C, I, U, F, O, BIAS, CN, HN, numel, K,
                           stride_c, stride_i, stride_u, stride_f, stride_o, forget_bias,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """new_c = σ(f + fb)·c + σ(i)·tanh(u); new_h = σ(o)·tanh(new_c). Outputs are (N, K) contiguous."""
    offs, mask, row, col, c, i, u, f, o = _load_cell(C, I, U, F, O, BIAS, numel, K, stride_c, stride_i,
                                                      stride_u, stride_f, stride_o, HAS_BIAS, BLOCK)
    new_c, new_h = lstm_gates(c, i, u, f, o, forget_bias)
    tl.store(CN + offs, new_c.to(CN.dtype.element_ty), mask=mask)
    tl.store(HN + offs, new_h.to(HN.dtype.element_ty), mask=mask)


@triton.jit
def _lstm_gates_bwd_kernel(C, I, U, F, O, BIAS, DCN, DHN, DC, DG, numel, K,
                           stride_c, stride_i, stride_u, stride_f, stride_o, forget_bias,
                           HAS_BIAS: tl.constexpr, HAS_DC: tl.constexpr, BLOCK: tl.constexpr):
    """dc and the four pre-activation grads, written to DG as (N, 4K) in gate order i, u, f, o."""
    offs, mask, row, col, c, i, u, f, o = _load_cell(C, I, U, F, O, BIAS, numel, K, stride_c, stride_i,
                                                      stride_u, stride_f, stride_o, HAS_BIAS, BLOCK)
    dh, dcn = load_state_grads(DHN, DCN, offs, mask, HAS_DC)
    dc, di, du, df, do = lstm_gates_grads(c, i, u, f, o, dh, dcn, forget_bias)
    ty = DG.dtype.element_ty
    base = DG + row * (4 * K) + col
    tl.store(base, di.to(ty), mask=mask)
    tl.store(base + K, du.to(ty), mask=mask)
    tl.store(base + 2 * K, df.to(ty), mask=mask)
    tl.store(base + 3 * K, do.to(ty), mask=mask)
    tl.store(DC + offs, dc.to(DC.dtype.element_ty), mask=mask)


def _check_gates(c: torch.Tensor, gates, bias) -> None:
    if c.dtype not in _DTYPES or c.dim() != 2:
        raise TypeError(f"c: expected a 2-D float32/float16/bfloat16 tensor, got {c.dtype} {tuple(c.shape)}")
    if c.stride(1) != 1:
        raise ValueError("c: expected unit stride along features")
    for name, g in zip("iufo", gates):
        if g.shape != c.shape or g.dtype != c.dtype or g.device != c.device or g.stride(1) != 1:
            raise ValueError(f"{name}: expected {tuple(c.shape)} {c.dtype} on {c.device} with unit "
                             f"feature stride, got {tuple(g.shape)} {g.dtype} on {g.device}")
    if bias is not None and (bias.shape != (4 * c.shape[1],) or not bias.is_contiguous()):
        raise ValueError(f"bias: expected a contiguous ({4 * c.shape[1]},) tensor, got {tuple(bias.shape)}")


_PLANS: dict = {}


def _gates_key(tag, block, c, gates, bias, forget_bias, *more):
    """Everything a launch plan depends on: shapes, row strides, dtypes, alignment, the device."""
    i, u, f, o = gates
    return (tag, tuple(c.shape), c.stride(0), i.stride(0), u.stride(0), f.stride(0), o.stride(0), c.dtype,
            bias is not None, float(forget_bias), aligned(c, i, u, f, o, *(t for t in (bias, *more) if t is not None)),
            c.device, block, bias.dtype if bias is not None else None) + tuple(
                t.dtype if t is not None else None for t in more)


def lstm_gates_forward(c, i, u, f, o, bias=None, forget_bias=1.0, block=1024, check=True):
    """c, i, u, f, o: (N, K); bias: (4K,) or None. Returns (new_c, new_h), (N, K) contiguous."""
    if check:
        _check_gates(c, (i, u, f, o), bias)
    n, k = c.shape
    cn = empty((n, k), c.dtype, c.device)
    hn = empty((n, k), c.dtype, c.device)
    if c.numel():
        def make():
            launch = Launch(_lstm_gates_fwd_kernel, (triton.cdiv(c.numel(), block),), c.device,
                            dict(HAS_BIAS=bias is not None, BLOCK=block))
            ints = (c.numel(), k, c.stride(0), i.stride(0), u.stride(0), f.stride(0), o.stride(0), float(forget_bias))
            return lambda *t: launch(*t, *ints)
        run = plan(_PLANS, _gates_key("fwd", block, c, (i, u, f, o), bias, forget_bias), make)
        run(c, i, u, f, o, bias if bias is not None else c, cn, hn)
    return cn, hn


def lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias=None, forget_bias=1.0, block=1024, check=True):
    """Returns (dc (N, K), dgates (N, 4K) in order i, u, f, o). dc_new may be None."""
    if check:
        _check_gates(c, (i, u, f, o), bias)
    dh_new = dh_new.contiguous()
    dc_new = dc_new.contiguous() if dc_new is not None else None
    n, k = c.shape
    dc = empty((n, k), c.dtype, c.device)
    dg = empty((n, 4 * k), c.dtype, c.device)
    if c.numel():
        def make():
            launch = Launch(_lstm_gates_bwd_kernel, (triton.cdiv(c.numel(), block),), c.device,
                            dict(HAS_BIAS=bias is not None, HAS_DC=dc_new is not None, BLOCK=block))
            ints = (c.numel(), k, c.stride(0), i.stride(0), u.stride(0), f.stride(0), o.stride(0), float(forget_bias))
            return lambda *t: launch(*t, *ints)
        run = plan(_PLANS, _gates_key("bwd", block, c, (i, u, f, o), bias, forget_bias, dc_new, dh_new), make)
        run(c, i, u, f, o, bias if bias is not None else c, dc_new if dc_new is not None else dh_new, dh_new, dc, dg)
    return dc, dg
