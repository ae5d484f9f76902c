"""The seed's SparseProj: one-to-one projections between a dense hidden state and a subset of it.

Activations are feature-first, (nhidden, N) and (nproj, N), as in the seed. All four methods are
torch indexing ops, which autograd differentiates; re-exported from :mod:`bstrain.ops.matmul`.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["SparseProj"]


class SparseProj:
    """Gathers nproj of nhidden features, and scatters them back.

    Args:
        nhidden: size of the dense hidden state.
        nproj: pick this many features at random (sorted); or
        proj_stride: pick every proj_stride-th feature, trimmed to a multiple of block_size; or
        gather_lut: the (nproj,) feature indices to use, distinct, in [0, nhidden).
        seed: seed for the random pick (None: drawn from torch's global generator, so that
            ``torch.manual_seed`` makes it reproducible).
        name: the seed's op name; ignored.
    """

    def __init__(self, nhidden: int, nproj: int | None = None, proj_stride: int | None = None,
                 block_size: int = 32, gather_lut=None, seed: int | None = None, name: str | None = None):
        if gather_lut is None:
            lut = np.arange(nhidden)
            if nproj is not None:
                if not 0 < nproj <= nhidden:
                    raise ValueError(f"nproj: expected 1 <= nproj <= nhidden={nhidden}, got {nproj}")
                if seed is None:
                    seed = int(torch.randint(2**62, (), device="cpu"))
                lut = np.sort(np.random.default_rng(seed).permutation(nhidden)[:nproj])
            elif proj_stride is not None:
                if not 0 < proj_stride <= nhidden:
                    raise ValueError(f"proj_stride: expected 1 <= proj_stride <= nhidden={nhidden}, got {proj_stride}")
                keep = ((nhidden // proj_stride) // block_size) * block_size * proj_stride
                lut = lut[:keep:proj_stride]
                if lut.size == 0:
                    raise ValueError(f"proj_stride: {proj_stride} leaves fewer than block_size={block_size} features")
            else:
                raise ValueError("nproj, proj_stride, gather_lut: expected one of them, got none")
        else:
            lut = np.asarray(gather_lut)
            if lut.ndim != 1 or lut.size == 0 or lut.min() < 0 or lut.max() >= nhidden \
                    or np.unique(lut).size != lut.size:
                raise ValueError(f"gather_lut: expected distinct indices in [0, {nhidden}), got {lut!r}")
        self.nhidden, self.nproj = nhidden, int(lut.size)
        cpu = torch.device("cpu")                       # host tables, also under a meta or CUDA default device
        self.gather_lut = torch.as_tensor(lut, dtype=torch.int64, device=cpu)
        scatter = torch.full((nhidden,), -1, dtype=torch.int64, device=cpu)
        scatter[self.gather_lut] = torch.arange(self.nproj, device=cpu)
        self.scatter_lut = scatter                      # -1 where a hidden feature is not projected
        self._luts: dict = {}

    def _lut(self, device: torch.device) -> torch.Tensor:
        if device not in self._luts:
            self._luts[device] = self.gather_lut.to(device)
        return self._luts[device]

    def _check(self, name: str, x, rows: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} features on axis 0, got shape {tuple(x.shape)}")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(nhidden, N) -> (nproj, N)."""
        self._check("x", x, self.nhidden)
        return x.index_select(0, self._lut(x.device))

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(nproj, N) -> (nhidden, N), zeros where no feature is projected."""
        self._check("x", x, self.nproj)
        out = x.new_zeros((self.nhidden,) + tuple(x.shape[1:]))
        return out.index_copy(0, self._lut(x.device), x)

    def scatter_add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (nhidden, N) with y (nproj, N) added at the projected features."""
        self._check("x", x, self.nhidden)
        self._check("y", y, self.nproj)
        return x.index_add(0, self._lut(x.device), y)

    def scatter_mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (nhidden, N) with the projected features multiplied by y (nproj, N)."""
        self._check("x", x, self.nhidden)
        self._check("y", y, self.nproj)
        scale = torch.ones_like(x).index_copy(0, self._lut(x.device), y)
        return x * scale
