"""bstrain.ops.rotary: the kernel against float64 on fused qkv projections (rotated heads and copied
ones, strided inputs, ragged lengths), the backward as the inverse turn, the tables' cache, and the
argument checks."""
from __future__ import annotations

import math

import pytest
import torch

from bstrain.ops.rotary import apply_rotary, apply_rotary_ref, rotary_tables
from tests.conftest import DTYPE_IDS, assert_close, kernel_device

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
CASES = [("torch", torch.float32), ("torch", torch.bfloat16)] + [("triton", d) for d in DTYPES]


def _turn64(x, head_dim, rotated):
    """Rotary by its definition, in float64: pair (i, i + D/2) of head j < rotated at position t
    turns by t·10000^(-i/(D/2))."""
    B, T, C = x.shape
    out = x.clone().view(B, T, C // head_dim, head_dim)
    half = head_dim // 2
    t = torch.arange(T, dtype=torch.float64)[:, None]
    ang = t * torch.tensor([10000 ** (-i / half) for i in range(half)], dtype=torch.float64)[None, :]
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = out[:, :, :rotated, :half].clone(), out[:, :, :rotated, half:].clone()
    out[:, :, :rotated, :half] = a * c - b * s
    out[:, :, :rotated, half:] = a * s + b * c
    return out.view(B, T, C)


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("B, T, heads, D, rotated", [(2, 37, 6, 16, 4), (1, 5, 3, 6, 3), (3, 64, 2, 32, 1)],
                         ids=["qkv", "odd-half", "one-head"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_apply_rotary(backend, dtype, B, T, heads, D, rotated, with_bias):
    """y and dx (and the bias's gradient) against the definition in float64."""
    dev = kernel_device() if backend == "triton" else "cpu"
    x = torch.randn(B, T, heads * D, device=dev).to(dtype).requires_grad_()
    bias = torch.randn(heads * D, device=dev).requires_grad_() if with_bias else None
    cos, sin = rotary_tables(T + 3, D, dev)
    y = apply_rotary(x, cos, sin, D, rotated, bias=bias, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    leaves = [x] if bias is None else [x, bias]
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    y64 = _turn64(leaves64[0] + (leaves64[1] if with_bias else 0), D, rotated)
    assert_close(y, y64, None, dtype, "y")
    dy = torch.randn_like(y64)
    got = torch.autograd.grad(y, leaves, dy.to(dev, dtype))
    want = torch.autograd.grad(y64, leaves64, dy.to(dtype).double())
    for name, g, w, t in zip(("dx", "dbias"), got, want, leaves):
        assert g.dtype == t.dtype, name
        assert_close(g, w, None, dtype, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_chunk_and_inverse(backend):
    """A strided view (a slice of a wider projection) turns as its copy does; inverse undoes it."""
    dev = kernel_device() if backend == "triton" else "cpu"
    wide = torch.randn(2, 9, 80, device=dev)
    x = wide[..., 16:64]                                     # rows of stride 80
    cos, sin = rotary_tables(9, 8, dev)
    y = apply_rotary(x, cos, sin, 8, 4, backend=backend)
    assert_close(y, _turn64(x.double().cpu(), 8, 4), None, torch.float32, "y")
    back = apply_rotary(y, cos, sin, 8, 4, inverse=True, backend=backend)
    assert_close(back, x.double().cpu(), None, torch.float32, "inverse")


def test_reference_matches_definition_and_tables_are_cached():
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    cos, sin = rotary_tables(11, 8, "cpu")
    assert rotary_tables(11, 8, "cpu")[0] is cos                  # made once
    assert cos.dtype == torch.float32 and cos.shape == (11, 4)
    assert math.isclose(float(sin[3, 1]), math.sin(3 * 10000 ** (-1 / 4)), rel_tol=1e-6)
    torch.testing.assert_close(apply_rotary_ref(x, cos, sin, 8, 2), _turn64(x, 8, 2), rtol=1e-6, atol=1e-6)


def test_tables_on_meta_are_not_cached():
    a, _ = rotary_tables(4, 2, "meta")
    assert a.is_meta and rotary_tables(4, 2, "meta")[0] is not a


@pytest.mark.triton
@pytest.mark.parametrize("kw, exc, match", [
    (dict(x=torch.ones(2, 4)), ValueError, r"x: expected \(batch, T, heads·head_dim\)"),
    (dict(head_dim=3), ValueError, "head_dim: expected an even int dividing the 16 features"),
    (dict(head_dim=6), ValueError, "head_dim: expected an even int dividing"),
    (dict(rotated=5), ValueError, r"rotated: expected an int in \[0, 4\]"),
    (dict(cos=torch.ones(2, 2)), ValueError, r"cos: expected a float32 \(>= 3, 2\) table"),
    (dict(sin=torch.ones(3, 2, dtype=torch.float64)), ValueError, "sin: expected a float32"),
    (dict(bias=torch.ones(15)), ValueError, "bias: expected 16 elements"),
])
def test_bad_arguments(kw, exc, match):
    cos, sin = rotary_tables(3, 4, "cpu")
    args = dict(x=torch.ones(1, 3, 16), cos=cos, sin=sin, head_dim=4, rotated=None, bias=None)
    args.update(kw)
    with pytest.raises(exc, match=match):
        apply_rotary(args["x"], args["cos"], args["sin"], args["head_dim"], args["rotated"], bias=args["bias"],
                     backend="triton")
