"""bstrain.sparsity with layers that share one weight: an update decides one layout for the
weight, moves it and its optimizer state once, and switches every layer that shares it (and
the EMA copy's); RigL scores the weight by the sum of its layers' dense gradients. Ties that
cannot share one layout are refused at construction, naming both modules."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from bstrain.layout import balanced
from bstrain.nn import BlockSparseConv2d, BlockSparseLinear
from bstrain.ops import BlocksparseMatMul
from bstrain.sparsity import SET, RigL, sparse_layers
from tests.test_sparsity import blocks_by_coord

LAYOUT = balanced((4, 4), 0.5, seed=1)          # 8 of 16 blocks of 16: (nnz, 16, 16) weights


def linear(layout=LAYOUT, bs=16):
    return BlockSparseLinear(layout.shape[0] * bs, layout.shape[1] * bs, block_size=bs, layout=layout)


class Tied(nn.Module):
    """``n`` products applied in turn; ``how`` ties them: "modules" (b.weight = a.weight), "twice"
    (one module registered under two names, called twice), or "op" (a module, then a
    BlocksparseMatMul of the same layout on the module's weight, passed as an ``ops`` pair)."""

    def __init__(self, how: str, n: int = 2):
        super().__init__()
        torch.manual_seed(0)
        first = linear()
        if how == "twice":
            self.a, self.b = first, first
            self.chain = [first, first]
        elif how == "op":
            self.a, self.op = first, BlocksparseMatMul(LAYOUT, 16)
            self.chain = [first, lambda x: self.op(x, first.weight)]
        else:
            self.a = first
            for i in range(1, n):
                layer = linear()
                layer.weight = first.weight
                self.add_module("bcd"[i - 1], layer)
            self.chain = [first, *[getattr(self, "bcd"[i - 1]) for i in range(1, n)]]

    def forward(self, x):
        for f in self.chain:
            x = torch.tanh(f(x))
        return x

    def ops(self):
        return [(self.op, self.a.weight)] if hasattr(self, "op") else []

    def users(self):
        """Every (name, layout owner) that reads the shared weight."""
        out = [(name, layer) for name, layer in sparse_layers(self)]
        return out + ([("ops.0", self.op)] if hasattr(self, "op") else [])


def _layout(owner) -> np.ndarray:
    return np.asarray(owner.layout if isinstance(owner, BlocksparseMatMul) else owner.block_layout())


def _step(model, opt):
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


CASES = [("modules", 2), ("modules", 3), ("twice", 2), ("op", 2)]


@pytest.mark.parametrize("how, n", CASES, ids=["2-modules", "3-modules", "one-module-twice", "module-and-op"])
@pytest.mark.parametrize("cls", [SET, RigL], ids=["set", "rigl"])
@pytest.mark.parametrize("balanced_", [False, True], ids=["unbalanced", "balanced"])
def test_a_shared_weight_is_moved_once_and_every_layer_takes_its_layout(cls, how, n, balanced_):
    model = Tied(how, n)
    ema = copy.deepcopy(model)                                         # (deepcopy keeps the tie)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy = cls(model, opt, every=2, fraction=0.5, seed=4, balanced=balanced_, also=(ema,), ops=model.ops())
    _step(model, opt)
    assert policy.step() is None
    _step(model, opt)                                                  # the update follows this step
    w = model.a.weight
    old = LAYOUT.copy()
    blocks = blocks_by_coord(model.a)
    states = {k: blocks_by_coord(model.a, v) for k, v in opt.state[w].items() if k != "step"}
    ema_blocks = blocks_by_coord(ema.a)
    info = policy.step()
    new = _layout(model.a)
    assert info is not None and not np.array_equal(new, old) and new.sum() == old.sum()
    for name, owner in model.users() + [(n, m) for n, m in sparse_layers(ema)]:
        assert np.array_equal(_layout(owner), new), name
        if isinstance(owner, nn.Module):
            assert np.array_equal(np.asarray(owner.layout), new), name               # the layout buffer
            assert owner.weight is (model.a.weight if owner in model.modules() else ema.a.weight), name
    assert set(info["changed"]) == {name for name, _ in model.users()}
    pairs = [(blocks_by_coord(model.a), blocks, "weight"), (blocks_by_coord(ema.a), ema_blocks, "ema weight"),
             *((blocks_by_coord(model.a, opt.state[w][k]), v, k) for k, v in states.items())]
    for got_blocks, want_blocks, state in pairs:
        for coord, block in got_blocks.items():
            if coord in want_blocks:                                   # a survivor: bit for bit, moved once
                assert torch.equal(block, want_blocks[coord]), (state, coord)
            else:
                assert not block.any(), (state, coord)
    x = torch.randn(5, 64)                                             # every user computes with one dense matrix
    dense = model.a.op.to_dense(w.detach())
    with torch.no_grad():
        for f in model.chain:
            torch.testing.assert_close(f(x), x @ dense + (f.bias if isinstance(f, nn.Module) else 0),
                                       rtol=1e-5, atol=1e-5)
    assert info["blocks"]["live"] == old.sum() and len(policy.groups) == 1     # the weight counted once


@pytest.mark.parametrize("how, n", [("modules", 2), ("modules", 3), ("op", 2)],
                         ids=["2-modules", "3-modules", "module-and-op"])
def test_rigl_scores_a_shared_weight_by_the_sum_of_its_layers_dense_gradients(how, n):
    """The score of each block is the norm of the weight's own dense gradient: a float64 dense
    model with one (C, K) matrix in place of the tied layers, differentiated."""
    model = Tied(how, n).double()
    policy = RigL(model, None, every=1, fraction=0.5, ops=model.ops())
    assert policy.armed
    x = torch.randn(8, 64, dtype=torch.float64)
    model(x).square().mean().backward()
    dense = model.a.op.to_dense(model.a.weight.detach()).requires_grad_()
    h = x
    for f in model.chain:
        h = torch.tanh(h @ dense + (f.bias if isinstance(f, nn.Module) else 0))
    (g,) = torch.autograd.grad(h.square().mean(), dense)                # (C, K)
    want = g.reshape(4, 16, 4, 16).square().sum((1, 3)).sqrt()
    got = policy.grow_scores("a", model.a, LAYOUT, torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)      # (scored in fp32)


def test_a_layer_registered_under_two_names_is_one_layer():
    model = Tied("twice")
    assert [name for name, _ in sparse_layers(model)] == ["a"]
    policy = SET(model, None, every=1, fraction=0.5)
    assert [[name for name, _ in group] for group in policy.groups] == [["a"]]


def _tie(a, b):
    b.weight = a.weight
    return nn.Sequential(a, b)


def _refused():
    torch.manual_seed(0)
    other = LAYOUT[::-1].copy()                                        # 8 blocks, another layout
    holder = nn.Module()
    seq = nn.Sequential(linear(), holder)
    holder.w = seq[0].weight                                           # a dense module's parameter too
    aliased = nn.Sequential(linear(), linear())
    aliased[1].weight = nn.Parameter(aliased[0].weight.data)           # distinct Parameters, one memory
    conv = BlockSparseConv2d(64, 64, 1, block_size=16, layout=LAYOUT)
    return {
        "layouts": (_tie(linear(), linear(other)), "their layouts differ"),
        "layout-shapes": (_tie(linear(), linear(np.concatenate([LAYOUT, np.zeros((4, 4), bool)]))),
                          r"their layouts have different shapes \(\(4, 4\) and \(8, 4\)\)"),
        "block-sizes": (_tie(linear(), linear(bs=32)), r"their block sizes differ \(16 and 32\)"),
        "linear-and-conv": (_tie(linear(), conv), "one is a product, the other a convolution"),
        "dense-holder": (seq, r"layer '0' and module '1' share one weight \('1.w'\), but '1' is not a block-sparse "
                              r"layer"),
        "one-memory": (aliased, "'0' and '1' hold distinct weight tensors on the same memory"),
    }


@pytest.mark.parametrize("case", ["layouts", "layout-shapes", "block-sizes", "linear-and-conv", "dense-holder",
                                  "one-memory"])
def test_ties_that_cannot_share_one_layout_are_refused_naming_both(case):
    model, match = _refused()[case]
    with pytest.raises(ValueError, match=match) as err:
        SET(model, None)
    assert "'0'" in str(err.value) and "'1'" in str(err.value)


def test_ops_pairs_sharing_a_weight_of_other_layouts_or_a_modules_op_are_refused():
    torch.manual_seed(0)
    layer = linear()
    with pytest.raises(ValueError, match="ops: expected ops of their own, got ops.0 with the BlocksparseMatMul of "
                                         "layer 'a'"):
        SET(nn.ModuleDict({"a": layer}), None, ops=[(layer.op, layer.weight)])
    op = BlocksparseMatMul(LAYOUT[::-1].copy(), 16)
    with pytest.raises(ValueError, match="layers 'a' and 'ops.0' share one weight, but their layouts differ"):
        SET(nn.ModuleDict({"a": layer}), None, ops=[(op, layer.weight)])
    op2 = BlocksparseMatMul(LAYOUT, 16)
    with pytest.raises(ValueError, match="layers 'ops.0' and 'ops.1' share one weight, but their layouts differ"):
        SET(None, None, ops=[(op, layer.weight), (op2, layer.weight)])


def test_an_ema_copy_tied_otherwise_than_the_model_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(linear(), linear())                          # untied, of one layout
    ema = copy.deepcopy(model)
    ema[1].weight = ema[0].weight
    with pytest.raises(ValueError, match="also: layers '0' and '1' share one weight in a Sequential but not in the "
                                         "model"):
        SET(model, None, also=(ema,))
    with pytest.raises(ValueError, match="also: expected a copy with weights of its own, got a Sequential whose "
                                         "layer '0' holds the model's weight of '0'"):
        SET(model, None, also=(model,))


def test_an_untied_ema_copy_of_a_tied_model_moves_each_of_its_weights():
    model = Tied("modules")
    ema = copy.deepcopy(model)
    ema.b.weight = nn.Parameter(ema.a.weight.detach().clone())         # the copy's layers untied
    policy = SET(model, None, every=1, fraction=0.5, seed=2, also=(ema,))
    before = blocks_by_coord(model.a)
    policy.step()
    new = model.a.block_layout()
    for layer in (ema.a, ema.b):
        assert np.array_equal(layer.block_layout(), new)
        for coord, block in blocks_by_coord(layer).items():
            assert torch.equal(block, before[coord]) if coord in before else not block.any()
