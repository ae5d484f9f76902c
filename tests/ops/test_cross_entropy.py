"""bstrain.ops.cross_entropy: per-row loss and the logits' gradient against float64 on both
backends (one slice and several of the vocabulary, ragged rows), the seed's softmax_cross_entropy
on the kernel, NaN for a bad label on the kernel path, and the argument checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bstrain.ops as bs
from bstrain.ops.cross_entropy import cross_entropy
from tests.conftest import DTYPE_IDS, assert_close, kernel_device

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
CASES = [("torch", torch.float32), ("torch", torch.bfloat16)] + [("triton", d) for d in DTYPES]


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda v: DTYPE_IDS.get(v, v))
@pytest.mark.parametrize("shape", [(3, 5, 256), (7, 3), (2, 5000)], ids=["byte-lm", "tiny", "wide"])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.uint8], ids=["i64", "u8"])
def test_cross_entropy(backend, dtype, shape, label_dtype):
    dev = kernel_device() if backend == "triton" else "cpu"
    V = shape[-1]
    logits = (4 * torch.randn(*shape, device=dev)).to(dtype).requires_grad_()
    labels = torch.randint(0, min(V, 256), shape[:-1], device=dev).to(label_dtype)
    loss = cross_entropy(logits, labels, backend=backend)
    assert loss.dtype == torch.float32 and loss.shape == shape[:-1]
    l64 = logits.detach().double().cpu().requires_grad_()
    want = F.cross_entropy(l64.reshape(-1, V), labels.long().cpu().reshape(-1), reduction="none").reshape(shape[:-1])
    assert_close(loss, want, None, dtype, "loss")
    w = torch.rand(shape[:-1], dtype=torch.float64)
    (got,) = torch.autograd.grad(loss, logits, w.to(dev, torch.float32))
    (ref,) = torch.autograd.grad(want, l64, w)
    assert got.dtype == dtype
    assert_close(got, ref, None, dtype, "dlogits")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mean_loss_gradient(backend):
    """A mean's gradient arrives broadcast (stride 0)."""
    dev = kernel_device() if backend == "triton" else "cpu"
    logits = torch.randn(10, 33, device=dev, requires_grad=True)
    labels = torch.randint(0, 33, (10,), device=dev)
    (got,) = torch.autograd.grad(cross_entropy(logits, labels, backend=backend).mean(), logits)
    l64 = logits.detach().double().cpu().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(l64, labels.cpu()), l64)
    assert_close(got, ref, None, torch.float32, "dlogits")


@pytest.mark.triton
def test_bad_label_is_nan_on_the_kernel_and_an_error_in_the_seed_op():
    dev = kernel_device()
    logits = torch.randn(3, 8, device=dev)
    loss = cross_entropy(logits, torch.tensor([1, 8, 2], device=dev), backend="triton")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    with pytest.raises(ValueError, match=r"labels: expected values in \[0, 8\)"):
        bs.softmax_cross_entropy(logits, torch.tensor([1, 8, 2], device=dev))


@pytest.mark.triton
@pytest.mark.parametrize("kw, exc, match", [
    (dict(logits=torch.ones(2, 4, dtype=torch.int32)), TypeError, "logits: expected a floating tensor"),
    (dict(logits=torch.ones(2, 0)), ValueError, r"logits: expected \(\.\.\., V\) with V >= 1"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), ValueError, r"labels: expected integer ids of shape \(2,\)"),
    (dict(labels=torch.zeros(2)), ValueError, "labels: expected integer ids"),
])
def test_bad_arguments(kw, exc, match):
    args = dict(logits=torch.ones(2, 4), labels=torch.zeros(2, dtype=torch.long))
    args.update(kw)
    with pytest.raises(exc, match=match):
        cross_entropy(args["logits"], args["labels"], backend="triton")
