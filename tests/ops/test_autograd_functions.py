"""Hand-written autograd.Functions are the exception (issue 43): ops are built by kernel_op or are
plain torch. The ops that left hand-written Functions behind (float_cast, filter_tensor,
embedding_lookup): their custom ops (opcheck), their gradients against float64, and
torch.compile(fullgraph=True) through them."""
from __future__ import annotations

import ast
import pathlib
import weakref

import pytest
import torch

import bstrain
from bstrain.ops import ew
from bstrain.ops.embed import embedding_lookup
from bstrain.ops.grouping import ParamGradGroup

OPS = torch.ops.bstrain
ROOT = pathlib.Path(bstrain.__file__).parent
REASON = "Why not kernel_op:"
MAX_FUNCTIONS = 3


def _hand_written_functions() -> dict[str, str]:
    """'file:Class' -> docstring of each class in bstrain/ops and bstrain/models that subclasses
    torch.autograd.Function (read from the source, so a class no import reaches counts too)."""
    found = {}
    for path in sorted([*(ROOT / "ops").rglob("*.py"), *(ROOT / "models").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b) in ("torch.autograd.Function", "autograd.Function", "Function") for b in node.bases):
                found[f"{path.relative_to(ROOT)}:{node.name}"] = ast.get_docstring(node) or ""
    return found


def test_at_most_three_hand_written_functions_each_saying_why():
    found = _hand_written_functions()
    assert found, "the scan found no autograd.Function at all: it no longer reads the classes"
    assert len(found) <= MAX_FUNCTIONS, f"expected at most {MAX_FUNCTIONS}, got {sorted(found)}: build ops with kernel_op"
    for name, doc in found.items():
        reasons = [line for line in doc.splitlines() if line.strip().startswith(REASON)]
        assert len(reasons) == 1 and len(reasons[0].strip()) > len(REASON) + 10, \
            f"{name}: expected one docstring line '{REASON} <why the op builder cannot make it>'"


# --- the ops that replaced hand-written Functions -------------------------------------------------
def test_opcheck_float_cast_filter_and_embedding():
    x = torch.randn(4, 6, requires_grad=True)
    torch.library.opcheck(OPS.float_cast.default, (x, torch.float16, torch.bfloat16))
    torch.library.opcheck(OPS.float_cast.default, (x, torch.float32, torch.float16))        # same dtype: a copy
    torch.library.opcheck(OPS.filter_tensor.default, (x, 2.0, 1.5, True, True))
    emb = torch.randn(7, 5, requires_grad=True)
    torch.library.opcheck(OPS.embedding_lookup.default, (torch.tensor([[1, 6], [1, 0]]), emb))


@pytest.mark.parametrize("x_dtype, dtype, dx_dtype", [
    (torch.float32, torch.float32, torch.bfloat16), (torch.float64, torch.float32, torch.float16),
    (torch.float32, torch.float64, torch.bfloat16)], ids=["fp32-fp32-dxbf16", "fp64-fp32-dxfp16", "fp32-fp64-dxbf16"])
def test_float_cast_rounds_the_gradient_through_dx_dtype(x_dtype, dtype, dx_dtype):
    """A dx_dtype other than x's and dtype's: the gradient is dy rounded to dx_dtype, then x's
    dtype (the kernel_op's path; the forward is the plain cast)."""
    x = torch.randn(64, dtype=x_dtype, requires_grad=True)
    dy = torch.randn(64, dtype=torch.float64) * 1.001                 # not representable in 16 bits
    y = ew.float_cast(x, dtype, dx_dtype)
    assert y.dtype == dtype and torch.equal(y, x.detach().to(dtype))
    y.backward(dy.to(dtype))
    want = dy.to(dtype).to(dx_dtype).to(x_dtype)
    assert torch.equal(x.grad, want) and not torch.equal(x.grad, dy.to(dtype).to(x_dtype))


def test_filter_tensor_gradient_is_the_filtered_gradient():
    """The seed's filter_tensor: forward and backward both filter (zero infs and NaNs, scale, clamp)."""
    x = torch.tensor([1.0, -4.0, float("inf"), float("nan"), 0.25], dtype=torch.float64, requires_grad=True)
    dy = torch.tensor([float("-inf"), 3.0, 1.0, float("nan"), -0.5], dtype=torch.float64)
    y = ew.filter_tensor(x, 2.0, saturate=3.0, zero_infs=True, zero_nans=True)
    torch.testing.assert_close(y, torch.tensor([2.0, -3.0, 0.0, 0.0, 0.5], dtype=torch.float64))
    y.backward(dy)
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 3.0, 2.0, 0.0, -1.0], dtype=torch.float64))


def _compiled_matches_eager(fn, *inputs):
    """fn compiled with fullgraph (no graph break) gives eager's outputs and input gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [t for t in inputs if t.requires_grad]
    outs = []
    for f in (fn, compiled):
        y = f(*inputs)
        outs.append((y, torch.autograd.grad(y.double().square().sum(), leaves)))
    (want, want_g), (got, got_g) = outs
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dx_dtype", [None, torch.float16], ids=["plain-cast", "dx-fp16"])
def test_compile_float_cast(dx_dtype):
    _compiled_matches_eager(lambda x: ew.float_cast(x * 3.0, torch.bfloat16, dx_dtype),
                            torch.randn(8, 3, requires_grad=True))


def test_compile_filter_tensor():
    x = torch.randn(8, 3)
    x[0, 0], x[1, 1] = float("inf"), float("nan")
    _compiled_matches_eager(lambda x: ew.filter_tensor(x * 2.0, 0.5, saturate=1.0, zero_infs=True, zero_nans=True),
                            x.requires_grad_())


def test_compile_embedding_lookup_keeps_the_fp32_sum():
    """Traced, the op's backward still sums a bf16 table's repeated rows in fp32."""
    torch.manual_seed(0)
    emb = torch.randn(5, 4).to(torch.bfloat16).requires_grad_()
    idx = torch.randint(0, 5, (3, 300))
    _compiled_matches_eager(lambda e: embedding_lookup(e, idx) * 1.0, emb)
    y = torch.compile(lambda e: embedding_lookup(e, idx), fullgraph=True, backend="aot_eager")(emb)
    dy = torch.randn(y.shape, dtype=torch.float64).to(torch.bfloat16)
    (got,) = torch.autograd.grad(y, emb, dy)
    want = torch.zeros(5, 4, dtype=torch.float64).index_add_(0, idx.reshape(-1), dy.double().reshape(-1, 4))
    assert torch.equal(got, want.to(torch.bfloat16))


def test_a_param_grad_group_is_freed_with_its_graph():
    """The group node's context holds the workspaces, not the group: a group holding the node's
    outputs (its views) would be a reference cycle that reference counting never frees."""
    g = torch.ones(4, requires_grad=True)
    group = ParamGradGroup(g)
    (group.views[0] * 2).sum().backward()         # no step added to the workspace: no gradient from it
    assert g.grad is None
    ref = weakref.ref(group)
    del group
    assert ref() is None


def test_compile_shared_cast_sums_timestep_gradients_in_fp32():
    """The LSTM's PyTorch path takes its bf16 parameters through shared_cast (a cast per use, no
    Function): traced, a parameter's per-step gradients are still summed in fp32."""
    from bstrain.models.lstm import shared_cast
    torch._dynamo.reset()
    p = torch.randn(64, requires_grad=True)
    xs = torch.randn(8, 64).to(torch.bfloat16)

    def loss(p):
        use = shared_cast(p, torch.bfloat16)
        return sum((use() * x).float().sum() for x in xs)
    (got,) = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(p), p)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), xs.double().sum(0), rtol=1e-6, atol=1e-6)
