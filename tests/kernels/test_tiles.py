"""The tile tables' one override hook (bstrain.kernels.tiles)."""
from __future__ import annotations

import pytest
import torch

from bstrain.kernels import matmul as kernels
from bstrain.kernels import tiles
from bstrain.kernels.matmul_luts import make_luts
from tests.conftest import assert_close, dense_weight, fresh_seed, kernel_device, ragged_layout


def test_override_sets_returns_and_restores():
    key = ("dx", 32, 2)
    default = tiles.CONV(*key)
    v0 = tiles.version()
    assert tiles.override("conv", key, tiles.Tile(32, 0, 2, 1)) is None
    assert tiles.CONV(*key) == tiles.Tile(32, 0, 2, 1) and tiles.version() > v0
    with tiles.overridden("conv", key, tiles.Tile(16, 0, 4, 1)):
        assert tiles.CONV(*key) == tiles.Tile(16, 0, 4, 1)
    assert tiles.CONV(*key) == tiles.Tile(32, 0, 2, 1)
    assert tiles.override("conv", key, None) == tiles.Tile(32, 0, 2, 1)
    assert tiles.CONV(*key) == default and not tiles.CONV.overrides
    with pytest.raises(RuntimeError), tiles.overridden("conv", key, tiles.Tile(16, 0, 4, 1)):
        raise RuntimeError
    assert tiles.CONV(*key) == default and not tiles.CONV.overrides
    with pytest.raises(TypeError, match="expected a Tile"):
        tiles.override("conv", key, (16, 4, 1))
    with pytest.raises(AttributeError):
        default.warps = 8                                       # frozen


def test_an_override_makes_a_new_plan_and_restoring_it_the_default_again(monkeypatch):
    """bsmm_forward at 40 rows: the plan made under an override launches its tile; after it, the
    default's again (each override bumps the tables' version, which plan keys hold)."""
    made = []
    real = kernels.Launch

    def recording(fn, grid, device, consts, **options):
        made.append((consts["BLOCK_M"], options["num_warps"]))
        return real(fn, grid, device, consts, **options)
    monkeypatch.setattr(kernels, "Launch", recording)
    dev = torch.device(kernel_device())
    lay = ragged_layout(3, 3, seed=fresh_seed())
    luts = make_luts(lay, 16, dev)
    x, w = torch.randn(40, 48, device=dev), torch.randn(luts.nnz, 16, 16, device=dev)
    want = x.double().cpu() @ dense_weight(lay, w)
    default = kernels.ds_tile(16, 40, 4, dev)
    key = ("ds_small_m" if dev.type == "cuda" else "ds", 16, 4, dev.type == "cuda")
    assert tiles.MATMUL(*key) == default
    other = default.replace(block_m=16, warps=2)
    for tile, plans in ((default, 1), (other, 2), (default, 3)):
        if tile is other:
            with tiles.overridden("matmul", key, other):
                y = kernels.bsmm_forward(x, w, luts)
        else:
            y = kernels.bsmm_forward(x, w, luts)
        assert made[-1] == (tile.block_m, tile.warps) and len(luts.fwd.plans) == plans
        assert_close(y, want, None, torch.float32, "y")
