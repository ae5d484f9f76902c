"""RigL's scores: the dense weight gradient of the step before an update, recorded over its
calls (``_GradRecord``), its block norms, and the mean over ranks that makes every rank decide
alike."""
from __future__ import annotations

import torch
from torch import nn

from bstrain.sparsity.groups import _block_size


class _GradRecord:
    """The dense weight gradient of one layer over the calls of one step: a running fp32 sum, and
    the (x, dY) of calls kept for one product at the end. A call whose x and dY take fewer bytes
    than the dense gradient (an LSTM's time step: 2.5 MB against 268 MB for a 4096 -> 16384 layer)
    is kept, so that the step costs one X·dY over all of them instead of a sum read and written per
    call; a larger one (a transformer's whole batch) goes into the sum at once."""

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self) -> "_GradRecord":
        out = _GradRecord()
        out.sum, out.calls = self.sum, list(self.calls)
        return out

    def add(self, layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
        from bstrain.nn.conv import BlockSparseConv2d
        if not isinstance(layer, BlockSparseConv2d):
            dense = layer.op.C * layer.op.K * 4
            if x.numel() * x.element_size() + dy.numel() * dy.element_size() < dense:
                self.calls.append((x, dy))
                return
        g = _dense_grad(layer, x, dy)
        if self.sum is None:
            self.sum = g
        else:
            self.sum.add_(g)

    def total(self, layer: nn.Module) -> torch.Tensor | None:
        """The step's dense fp32 gradient (None if no call reached the layer)."""
        g = self.sum
        if self.calls:
            xs, dys = zip(*self.calls)
            axis = layer.op.feature_axis
            if axis == 1:
                x2 = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])
                dy2 = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys])
            else:
                x2 = torch.cat([x.reshape(x.shape[0], -1) for x in xs], 1)
                dy2 = torch.cat([dy.reshape(dy.shape[0], -1) for dy in dys], 1)
            kept = _dense_grad(layer, x2, dy2)
            g = kept if g is None else g + kept
        return g


def _dense_grad(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The dense fp32 weight gradient of one call of ``layer``: (C, K) for a product, (K, C, kh, kw)
    for a convolution (the calls of a step are summed before :func:`_block_norms`)."""
    from bstrain.nn.conv import BlockSparseConv2d
    if isinstance(layer, BlockSparseConv2d):
        from bstrain.ops.conv import conv_nd
        xb = x if x.dim() == 4 else x.unsqueeze(0)
        dyb = dy if dy.dim() == 4 else dy.unsqueeze(0)
        _, _, pads, _ = layer._geometry(xb.shape[2], xb.shape[3])
        with torch.enable_grad():
            wd = torch.zeros(layer.out_channels, layer.in_channels, *layer.kernel_size, device=x.device,
                             dtype=torch.float32, requires_grad=True)
            y = conv_nd(xb.float(), wd, layer.stride, layer.dilation, pads)
            (g,) = torch.autograd.grad(y, wd, dyb.float())                    # (K, C, kh, kw)
        return g
    # in the activations' dtype (bf16 under autocast: the GEMM accumulates in fp32; the scores only rank)
    dt = x.dtype if x.dtype == dy.dtype and x.is_cuda else torch.float32
    if layer.op.feature_axis == 1:
        x2, dy2 = x.reshape(-1, x.shape[-1]).to(dt), dy.reshape(-1, dy.shape[-1]).to(dt)
        g = (x2.t() @ dy2).float()                                              # (C, K)
    else:
        x2, dy2 = x.reshape(x.shape[0], -1).to(dt), dy.reshape(dy.shape[0], -1).to(dt)
        g = (x2 @ dy2.t()).float()
    return g


def _block_norms(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """(C/bs, K/bs) block norms of a dense gradient from :func:`_dense_grad`."""
    bs = _block_size(layer)
    if g.dim() == 4:                                                            # a conv's (K, C, kh, kw)
        K, C = g.shape[:2]
        return g.reshape(K // bs, bs, C // bs, bs, -1).square().sum((1, 3, 4)).t().sqrt()
    C, K = g.shape
    return g.reshape(C // bs, bs, K // bs, bs).square().sum((1, 3)).sqrt()


def _all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over the ranks of the default process group (unchanged without one)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()
