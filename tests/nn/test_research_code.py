"""BlockSparseLinear and LayerNorm as research code uses PyTorch modules: inference mode before
training, meta-device construction, export, copies; the old import paths; the package's imports."""
from __future__ import annotations

import ast
import copy
import pathlib
import pickle

import pytest
import torch
from torch import nn

from bstrain.nn import BlockSparseLinear, LayerNorm
from bstrain.ops.norms import layer_norm_ref
from tests.conftest import fresh_seed


def _linear(**kw):
    return BlockSparseLinear(64, 48, block_size=16, density=0.5, seed=fresh_seed(), **kw)


def test_first_call_in_inference_mode_then_training():
    """Lightning's sanity check runs a batch under inference_mode first: nothing cached then may
    break a later backward ("Inference tensors cannot be saved for backward")."""
    layer = _linear()
    with torch.inference_mode():
        y0 = layer(torch.randn(3, 64))
    assert y0.is_inference()
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    tables = layer.op._tables.on("cpu")
    assert not tables.c_idx.is_inference() and not tables.k_idx.is_inference()


def test_meta_construction_with_a_drawn_layout_then_to_empty_and_load():
    torch.manual_seed(fresh_seed())
    ref = _linear()
    with torch.device("meta"):
        m = BlockSparseLinear(64, 48, block_size=16, density=0.5)
    assert m.weight.is_meta
    m.to_empty(device="cpu")
    assert m.layout.dtype == torch.bool and torch.equal(m.layout, torch.as_tensor(m.op.layout))
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    torch.testing.assert_close(m(x), ref(x))


def test_meta_layout_buffer_is_rewritten_by_to_empty():
    seed = fresh_seed()
    with torch.device("meta"):
        m = BlockSparseLinear(64, 48, block_size=16, density=0.5, seed=seed)
    m.to_empty(device="cpu")
    torch.testing.assert_close(m.layout, torch.as_tensor(m.op.layout))


def test_load_state_dict_assign_takes_another_block_count():
    a, b = _linear(), BlockSparseLinear(64, 48, block_size=16, density=0.25, seed=fresh_seed())
    with pytest.raises(RuntimeError, match="live blocks"):
        a.load_state_dict(b.state_dict())
    a.load_state_dict(b.state_dict(), assign=True)
    x = torch.randn(4, 64)
    torch.testing.assert_close(a(x), b(x))


def test_export_then_eager_stays_real():
    layer = _linear()
    ep = torch.export.export(layer, (torch.randn(4, 64),), strict=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(ep.module()(x), layer(x))
    assert type(layer(x)) is torch.Tensor


def test_deepcopy_and_pickle_share_the_tables():
    layer = _linear()
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.op._tables is layer.op._tables
        x = torch.randn(2, 64)
        torch.testing.assert_close(other(x), layer(x))


@pytest.mark.parametrize("old, name", [("bstrain.models.layers", "BlockSparseLinear"),
                                       ("bstrain.models.layers", "sparsify"),
                                       ("bstrain.models.conv", "BlockSparseConv2d"),
                                       ("bstrain.models", "BlockSparseLinear")])
def test_old_import_paths_warn_and_work(old, name):
    import importlib
    import bstrain.nn
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"bstrain.nn.{name}"):
        obj = getattr(module, name)
    assert obj is getattr(bstrain.nn, name)


# --- LayerNorm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("segments, relu", [(1, False), (2, True), (4, False)])
def test_layer_norm_module_matches_the_reference(segments, relu):
    m = LayerNorm(32, eps=1e-5, segments=segments, relu=relu).double()
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    y = m(x)
    ref = layer_norm_ref(x.reshape(-1, 32), m.weight, m.bias, 1, 1e-5, relu, segments).reshape(x.shape)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, m.weight, m.bias], g)
    want = torch.autograd.grad(ref, [x, m.weight, m.bias], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_layer_norm_module_follows_nn_layer_norm():
    ours, theirs = LayerNorm(24), nn.LayerNorm(24)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(3, 24)
    torch.testing.assert_close(ours(x), theirs(x))
    plain = LayerNorm(24, elementwise_affine=False)
    assert not list(plain.parameters())
    torch.testing.assert_close(plain(x), nn.functional.layer_norm(x, (24,), eps=1e-5))
    with torch.device("meta"):
        meta = LayerNorm(24)
    assert meta.weight.is_meta


@pytest.mark.parametrize("kwargs, match", [({"normalized_shape": (4, 4)}, "normalized_shape"),
                                           ({"normalized_shape": 10, "segments": 3}, "segments")])
def test_layer_norm_module_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerNorm(**kwargs)
    with pytest.raises(ValueError, match="x: expected"):
        LayerNorm(8)(torch.randn(2, 9))


# --- the package's imports ------------------------------------------------------------------------------
def _module_imports(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """bstrain modules imported at module level (imports inside functions are deferred by design)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bstrain"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("bstrain"))
    return out


def test_the_package_has_no_import_cycle():
    root = pathlib.Path(__file__).resolve().parents[2]
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "bstrain").rglob("*.py")}
    graph = {m: {d for d in _module_imports(p, root) if d in files and d != m} for m, p in files.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph[m]:
            if d.startswith(m + "."):          # a package importing its own submodule is not a cycle
                continue
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2
    for m in graph:
        if m not in state:
            visit(m, [])


def test_sparsify_swaps_linear_and_conv_layers_keeping_the_largest_blocks():
    from bstrain.nn import BlockSparseConv2d, sparsify
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 1, groups=2),
                          nn.Flatten(), nn.Linear(32 * 4 * 4, 64))
    with pytest.raises(ValueError, match="^2: expected groups=1"):
        sparsify(model, "*", block_size=16, density=1.0)
    assert isinstance(model[0], nn.Conv2d), "nothing is replaced when a chosen layer cannot be"
    x = torch.randn(2, 16, 4, 4)
    before = model(x)
    names = sparsify(model, lambda name, m: name != "2", block_size=16, density=1.0)
    assert names == ["0", "4"]
    assert isinstance(model[0], BlockSparseConv2d) and isinstance(model[4], BlockSparseLinear)
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)   # density 1 keeps every block
    half = nn.Conv2d(16, 32, 3, padding=1)
    with torch.no_grad():
        half.weight.zero_()
        half.weight[16:, :] = torch.randn(16, 16, 3, 3)                 # only output block 1 is non-zero
    m = nn.Sequential(half)
    sparsify(m, "*", block_size=16, density=0.5)
    assert m[0].block_layout()[:, 1].all() and not m[0].block_layout()[:, 0].any()
