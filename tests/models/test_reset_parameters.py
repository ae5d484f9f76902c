"""Whole models built on the meta device, given memory with to_empty and initialised with
reset_parameters(): the constructor's initialisation (fixed values equal, random ones of the same
scale), the same layouts, and a finite forward."""
from __future__ import annotations

import pytest
import torch

from bstrain.models.convnet import SparseResNet
from bstrain.models.lstm import SparseLSTM
from bstrain.models.transformer import SparseTransformer

MODELS = {
    "lstm": (lambda: SparseLSTM(hidden=32, embed=8, block_size=16, density=0.5, depth=2, init="identity"),
             lambda: (torch.randint(0, 256, (2, 5)),)),
    "transformer": (lambda: SparseTransformer(d_model=32, n_layer=2, n_head=2, context=64, block_size=16, window=16,
                                              attention="strided,local", positions="learned"),
                    lambda: (torch.randint(0, 256, (2, 64)),)),
    "resnet": (lambda: SparseResNet(widths="32,64", depth=1, block_size=16, density=0.5, classes=10),
               lambda: (torch.randn(2, 3, 16, 16),)),
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_meta_built_model_resets_to_the_constructors_init(name):
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(1)
    fixed = {k for k, v in make().state_dict().items() if torch.equal(v, ref.state_dict()[k])}   # seed-free inits
    with torch.device("meta"):
        meta = make()
    assert all(p.is_meta for p in meta.parameters())
    model = meta.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))                          # whatever to_empty left must be overwritten
    model.reset_parameters()
    want, got = ref.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for key, a in want.items():
        b = got[key]
        assert torch.isfinite(b.float()).all(), key
        if key in fixed:                                   # layouts, ones, zeros, identities
            torch.testing.assert_close(b, a, msg=key)
        else:                                              # random inits: the same scale
            ratio = float(b.float().std() / a.float().std())
            lo, hi = (0.7, 1.4) if a.numel() >= 256 else (0.4, 2.5)
            assert lo < ratio < hi, (key, ratio)
    y = _first(model(*inputs()))
    assert torch.isfinite(y).all()
    model.load_state_dict(ref.state_dict())
    a = inputs()
    torch.testing.assert_close(_first(model.eval()(*a)), _first(ref.eval()(*a)))
