"""embedding_lookup and SparseProj."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain.ops.embed import embedding_lookup
from bstrain.ops.matmul import SparseProj


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_embedding_lookup_values_and_grad(dtype):
    emb = torch.randn(11, 6).to(dtype).requires_grad_()
    idx = torch.tensor([[1, 4, 4], [10, 0, 4]])
    y = emb[idx.reshape(-1)].reshape(2, 3, 6)
    torch.testing.assert_close(embedding_lookup(emb, idx), y)
    embedding_lookup(emb, idx).float().sum().backward()
    expect = torch.zeros(11, 6)
    expect[1], expect[4], expect[10], expect[0] = 1, 3, 1, 1
    torch.testing.assert_close(emb.grad.float(), expect)
    assert emb.grad.dtype == dtype


def test_embedding_grad_accumulates_in_fp32():
    """20,000 gradients of 1e-3 into one fp16 row: an fp16 running sum stalls near 4, fp32 gives 20."""
    emb = torch.zeros(3, 2, dtype=torch.float16, requires_grad=True)
    idx = torch.ones(20000, dtype=torch.int64)
    y = embedding_lookup(emb, idx)
    y.backward(torch.full_like(y, 1e-3))
    torch.testing.assert_close(emb.grad[1].float(), torch.full((2,), 20.0), rtol=2e-3, atol=0)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: embedding_lookup(torch.ones(3), torch.zeros(2, dtype=torch.int64)), ValueError, "emb: expected a 2-D"),
    (lambda: embedding_lookup(torch.ones(3, 2), torch.zeros(2)), TypeError, "idx: expected an int64"),
    (lambda: embedding_lookup(torch.ones(3, 2), torch.tensor([3])), ValueError, r"idx: expected values in \[0, 3\)"),
    (lambda: SparseProj(64), ValueError, "nproj, proj_stride, gather_lut"),
    (lambda: SparseProj(64, nproj=65), ValueError, "nproj: expected"),
    (lambda: SparseProj(64, gather_lut=[1, 1]), ValueError, "gather_lut: expected distinct"),
    (lambda: SparseProj(64, nproj=8).gather(torch.ones(32, 2)), ValueError, "x: expected 64 features"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_sparse_proj_methods_and_gradients():
    proj = SparseProj(12, gather_lut=[0, 3, 7, 11])
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    lut = [0, 3, 7, 11]
    torch.testing.assert_close(proj.gather(x), x[lut])
    scat = torch.zeros(12, 5, dtype=torch.float64)
    scat[lut] = y.detach()
    torch.testing.assert_close(proj.scatter(y), scat)
    added = x.detach().clone()
    added[lut] += y.detach()
    torch.testing.assert_close(proj.scatter_add(x, y), added)
    mult = x.detach().clone()
    mult[lut] *= y.detach()
    torch.testing.assert_close(proj.scatter_mul(x, y), mult)
    for fn, args in ((proj.gather, (x,)), (proj.scatter, (y,)), (proj.scatter_add, (x, y)), (proj.scatter_mul, (x, y))):
        assert torch.autograd.gradcheck(fn, args)
    assert proj.scatter_lut.tolist() == [0, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3]


def test_sparse_proj_stride_and_random():
    p = SparseProj(100, proj_stride=3, block_size=8)
    assert p.nproj == 32 and p.gather_lut.tolist() == list(range(0, 96, 3))
    r = SparseProj(100, nproj=10, seed=0)
    lut = r.gather_lut.numpy()
    assert r.nproj == 10 and (np.diff(lut) > 0).all() and lut.max() < 100
