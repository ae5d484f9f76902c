"""bstrain.sparsity and optimizer state: after an update, every per-block state tensor of every
optimizer in torch.optim (moments, momentum buffers, accumulators, Adafactor's factored
row_var (nnz, bs, 1) and col_var (nnz, 1, bs)) holds each surviving block's state moved to the
block's new index, bit for bit; grown blocks start at the optimizer's own start value; scalars
stay. State that cannot follow the blocks (L-BFGS's flat vectors, a flattened or (bs, bs)
tensor, a list) is refused with a ValueError naming the optimizer and the key, before anything
moves."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bstrain.nn import BlockSparseConv2d
from bstrain.sparsity import SET, sparse_layers
from tests.test_sparsity import blocks_by_coord, mlp

# Every torch.optim optimizer: the arguments a test runs it with (several where its options
# keep other state), or why it cannot hold a block-sparse weight.
SUPPORTED = {
    "SGD": [dict(lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9, nesterov=True)],
    "Adam": [dict(lr=1e-2), dict(lr=1e-2, amsgrad=True)],
    "AdamW": [dict(lr=1e-2), dict(lr=1e-2, amsgrad=True)],
    "Adafactor": [dict(lr=1e-2)],
    "RMSprop": [dict(lr=1e-2), dict(lr=1e-2, centered=True, momentum=0.9)],
    "Adagrad": [dict(lr=1e-2, initial_accumulator_value=0.25)],
    "NAdam": [dict(lr=1e-2), dict(lr=1e-2, decoupled_weight_decay=True)],
    "RAdam": [dict(lr=1e-2)],
    "Adamax": [dict(lr=1e-2)],
    "ASGD": [dict(lr=1e-2, t0=1)],
    "Rprop": [dict(lr=0.03)],
    "Adadelta": [dict(lr=1.0)],
    "SparseAdam": [dict(lr=1e-2)],                  # (given sparse gradients)
}
REFUSED = {
    "LBFGS": "its state is flat vectors over all parameters: refused (test below)",
    "Muon": "2-D parameters only: it does not take a (nnz, bs, bs) weight",
}
# grown blocks' start, where it is not zero: the optimizer's own initial value for the state
STARTS = {("Adagrad", "sum"): "initial_accumulator_value", ("Rprop", "step_size"): "lr"}


def _optimizers() -> list[str]:
    return sorted(name for name in dir(torch.optim) if isinstance(getattr(torch.optim, name), type)
                  and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
                  and getattr(torch.optim, name) is not torch.optim.Optimizer)


def test_every_optimizer_of_torch_optim_is_covered():
    """A new optimizer in torch.optim is added to SUPPORTED (and so tested) or REFUSED."""
    assert set(_optimizers()) == set(SUPPORTED) | set(REFUSED)


def _steps(model, opt, n: int, sparse: bool) -> None:
    conv = any(isinstance(m, BlockSparseConv2d) for m in model.modules())
    for _ in range(n):
        x = torch.randn(2, 16, 6, 6) if conv else torch.randn(16, 64)
        model(x).square().mean().backward()
        if sparse:                                   # SparseAdam takes sparse gradients only
            for p in model.parameters():
                p.grad = p.grad.to_sparse()
        opt.step()
        opt.zero_grad()


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(BlockSparseConv2d(16, 32, 3, padding=1, block_size=8, density=0.5), nn.Tanh(),
                         BlockSparseConv2d(32, 16, 3, padding=1, block_size=8, density=0.5))


CASES = [(name, i, kw) for name, kws in SUPPORTED.items() for i, kw in enumerate(kws)]


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("name, i, kw", CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_every_blocks_state_follows_it(name, i, kw, kind):
    model = mlp() if kind == "linear" else _convnet()
    opt = getattr(torch.optim, name)(model.parameters(), **kw)
    policy = SET(model, opt, every=3, fraction=0.4, seed=1)
    _steps(model, opt, 2, name == "SparseAdam")
    assert all(policy.step() is None for _ in range(2))
    _steps(model, opt, 1, name == "SparseAdam")
    layers = sparse_layers(model)
    before = {}
    for lname, layer in layers:
        state = opt.state[layer.weight]
        assert state, (lname, "no state to check")
        blocks = {k: blocks_by_coord(layer, v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()}
        scalars = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items() if k not in blocks}
        before[lname] = layer.block_layout().copy(), blocks, scalars
    assert policy.step() is not None
    group = opt.param_groups[0]
    for lname, layer in layers:
        old, blocks, scalars = before[lname]
        new = layer.block_layout()
        grown = [tuple(c) for c in np.argwhere(new & ~old)]
        assert grown and not np.array_equal(new, old)
        state = opt.state[layer.weight]
        assert set(state) == set(blocks) | set(scalars)
        for k, v in scalars.items():                                   # step counts, ASGD's eta and mu: as they were
            assert torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v, (lname, k)
        for k, was in blocks.items():
            now = blocks_by_coord(layer, state[k])
            start = float(group[STARTS[name, k]]) if (name, k) in STARTS else 0.0     # (non-zero in SUPPORTED)
            for coord, block in now.items():
                if coord in was:                                       # a survivor: its own state, bit for bit
                    assert torch.equal(block, was[coord]), (lname, k, coord)
                else:                                                  # grown: the optimizer's start value
                    assert torch.equal(block, torch.full_like(block, start)), (lname, k, coord, block.flatten()[:4])
    was = {lname: (layer.weight.detach().clone(), layer.block_layout().copy()) for lname, layer in layers}
    _steps(model, opt, 1, name == "SparseAdam")                        # and the optimizer steps on
    for lname, layer in layers:                                        # every weight moves, no layout does
        assert torch.isfinite(layer.weight).all() and not torch.equal(layer.weight, was[lname][0]), lname
        assert np.array_equal(layer.block_layout(), was[lname][1]), lname


@pytest.mark.parametrize("name", ["Adam", "NAdam", "RAdam", "SparseAdam"])
def test_grown_moments_mean_for_adam_style_moments(name):
    """grown_moments="mean": a grown block's exp_avg_sq starts at the mean of the surviving
    blocks' (after the move); its exp_avg at zero."""
    model = mlp()
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
    policy = SET(model, opt, every=1, fraction=0.4, seed=2, grown_moments="mean")
    _steps(model, opt, 1, name == "SparseAdam")
    olds = {lname: layer.block_layout().copy() for lname, layer in sparse_layers(model)}
    policy.step()
    for lname, layer in sparse_layers(model):
        new = layer.block_layout()
        grown = [tuple(c) for c in np.argwhere(new & ~olds[lname])]
        second = blocks_by_coord(layer, opt.state[layer.weight]["exp_avg_sq"])
        first = blocks_by_coord(layer, opt.state[layer.weight]["exp_avg"])
        mean = torch.stack([second[tuple(c)] for c in np.argwhere(new & olds[lname])]).mean()
        assert grown and mean > 0
        for c in grown:
            assert torch.equal(second[c], torch.full_like(second[c], mean.item())) and not first[c].any()


def test_lbfgs_is_refused_at_construction():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"optimizer: LBFGS keeps its state \(the directions 'd', 'old_dirs', "
                                         r"'old_stps'\) as flat vectors over all its parameters.*weight of '0'"):
        SET(model, opt)
    SET(model, torch.optim.LBFGS([model[0].bias]))                    # an LBFGS without the weights is fine


class _Odd(torch.optim.SGD):
    """SGD that also keeps one more state entry per parameter, of a shape the policy cannot map."""

    def __init__(self, params, value):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.value = value

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["odd"] = self.value(p)
        return out


ODD = {
    "flattened": (lambda p: p.detach().flatten().clone(), r"as a tensor of shape \(\d+,\)"),
    "bs-by-bs": (lambda p: p.detach().sum(0).clone() if p.dim() == 3 else p.detach().clone(),
                 r"as a tensor of shape \(16, 16\)"),
    "list": (lambda p: [p.detach().clone()], "as a list"),
}


@pytest.mark.parametrize("odd", list(ODD))
@pytest.mark.parametrize("when", ["construction", "update"])
def test_state_that_cannot_follow_the_blocks_is_refused_before_anything_moves(odd, when):
    value, got = ODD[odd]
    model = mlp()
    opt = _Odd(model.parameters(), value)
    match = rf"optimizer: _Odd keeps state 'odd' for the weight of '0' {got}, which a layout update cannot move"
    if when == "construction":                      # the state exists: refused at once
        _steps(model, opt, 1, False)
        with pytest.raises(ValueError, match=match):
            SET(model, opt, every=1)
        return
    policy = SET(model, opt, every=2)               # no state yet: refused at the update, before any move
    _steps(model, opt, 1, False)
    policy.step()
    _steps(model, opt, 1, False)
    before = [(layer.block_layout().copy(), layer.weight.detach().clone(),
               opt.state[layer.weight]["momentum_buffer"].clone()) for _, layer in sparse_layers(model)]
    with pytest.raises(ValueError, match=match):
        policy.step()
    assert policy.steps == 1, "a refused update must leave the policy's step count as it was"
    for (lay, w, buf), (_, layer) in zip(before, sparse_layers(model)):
        assert np.array_equal(layer.block_layout(), lay) and torch.equal(layer.weight, w)
        assert torch.equal(opt.state[layer.weight]["momentum_buffer"], buf)
