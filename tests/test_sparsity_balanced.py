"""bstrain.sparsity, balanced=True: the layers a balanced update can never move (an update that
prunes one block; a layout that is the only one with its row and column counts) are named in
one warning at construction, and they are exactly the layers whose layout stays put."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from bstrain.nn import BlockSparseLinear
from bstrain.sparsity import SET, RigL, sparse_layers

# rows nest ({0, 1} ⊇ {0, 1} ⊇ {0} ⊇ {}): the only layout with these counts, though updates prune 2 or 3
NESTED = np.array([[1, 1], [1, 1], [1, 0], [0, 0]], dtype=bool)


def model() -> nn.Sequential:
    """nested (4x2, fixed), pair (2x2, one live block per row and column: fixed where an update
    prunes one), wide (4x8, 16 of 32 live: movable)."""
    torch.manual_seed(0)
    return nn.Sequential(BlockSparseLinear(64, 32, block_size=16, layout=NESTED),
                         BlockSparseLinear(32, 32, block_size=16, density=0.5, seed=1),
                         BlockSparseLinear(32, 64, block_size=8, density=0.5, seed=2))


def named_in(caught) -> set[str]:
    texts = [str(w.message) for w in caught if "can never move" in str(w.message)]
    assert len(texts) <= 1, texts
    return set(re.findall(r"'(\d+)' \(", texts[0])) if texts else set()


@pytest.mark.parametrize("fraction, fixed", [(0.5, {"0", "1"}), (0.9, {"0"})], ids=["prunes-1-of-2", "prunes-2-of-2"])
@pytest.mark.parametrize("cls", [SET, RigL], ids=["set", "rigl"])
def test_balanced_warns_once_naming_the_layers_that_never_move(cls, fraction, fixed):
    net = model()
    assert NESTED.sum() == 5 and np.array_equal(net[1].block_layout().sum(0), [1, 1])     # the premise
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = cls(net, None, every=1, fraction=fraction, balanced=True, seed=3)
    assert named_in(caught) == fixed
    before = {name: layer.block_layout().copy() for name, layer in sparse_layers(net)}
    moved = set()
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        for _ in range(4):
            net(torch.randn(8, 64)).square().mean().backward()
            policy.step()
            net.zero_grad()
            moved |= {name for name, layer in sparse_layers(net) if not np.array_equal(layer.block_layout(),
                                                                                      before[name])}
    assert not [w for w in later if "can never move" in str(w.message)]             # once, at construction
    assert set(before) - moved == fixed


def test_unbalanced_or_movable_layers_do_not_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SET(model(), None, every=1, fraction=0.5, balanced=False)
        SET(model()[2], None, every=1, fraction=0.5, balanced=True)
    assert not [w for w in caught if "can never move" in str(w.message)]
