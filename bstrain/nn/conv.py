"""``BlockSparseConv2d``: a 2-D convolution whose (out, in) channel pairs live in blocks.

The layout is a (C/bs, K/bs) 0/1 array over input and output channel blocks, as for
:class:`bstrain.nn.BlockSparseLinear`; each live block (i, j) is a (bs, bs, kh, kw)
filter from input channels i·bs.. to output channels j·bs... It runs the implicit-GEMM Triton
kernels of :mod:`bstrain.kernels.conv` (custom op ``bstrain::bsconv2d``), or the two PyTorch paths of
:class:`bstrain.ops.conv.BlocksparseConv` (a grouped convolution between a channel gather and a
scatter-add, or one masked dense filter), with the index tables as buffers, so ``torch.compile``
traces it with no graph break.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain.ops.conv import conv_geometry, conv_nd, sparse_conv2d
from bstrain.ops.matmul import compute_dtype

__all__ = ["BlockSparseConv2d"]

_TABLES = ("col_ptr", "col_blk", "col_in", "row_ptr", "row_blk", "row_out", "blk_in", "blk_out")


def _pair(name: str, v) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(isinstance(a, int) and a >= 1 for a in v):
        raise ValueError(f"{name}: expected a positive int or a pair of them, got {v!r}")
    return tuple(v)


class BlockSparseConv2d(nn.Module):
    """``nn.Conv2d``'s conventions with block-sparse channel connectivity.

    Args:
        in_channels, out_channels: C and K, multiples of block_size.
        kernel_size, stride, dilation: as nn.Conv2d.
        padding: "same" (TensorFlow's rule: output ceil(size / stride)), "valid", or an int.
        bias: add a learned (K,) bias.
        block_size: channels per block.
        density: fraction of live blocks of a drawn balanced layout (when ``layout`` is None).
        layout: a (C/bs, K/bs) 0/1 array instead.
        seed: seed of the drawn layout; None follows torch's RNG.
        backend: "auto" | "grouped" | "dense" (cuDNN compositions, as BlocksparseConv) |
            "triton" (the implicit-GEMM kernels of bstrain.kernels.conv, custom op
            ``torch.ops.bstrain.bsconv2d``; CUDA, or CPU under TRITON_INTERPRET=1). "auto" takes
            "triton" for CUDA 16-bit channels-last stride-1 inputs with blocks of 64 or more (or
            at most 1/8 live), else "grouped" for block-diagonal layouts on CUDA, else "dense".

    Parameters: ``weight`` (nnz, bs, bs, kh, kw), the live blocks in row-major layout order, each
    (out, in, kh, kw) as nn.Conv2d; ``bias`` (K,). The layout is the ``layout`` buffer.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding="same", dilation=1,
                 bias: bool = True, *, block_size: int = 16, density: float | None = None, layout=None,
                 seed: int | None = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        bs = block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"block_size: expected a positive int, got {bs!r}")
        for name, ch in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(ch, bool) or not isinstance(ch, int) or ch <= 0 or ch % bs:
                raise ValueError(f"{name}: expected a positive multiple of block_size={bs}, got {ch!r}")
        if layout is not None and density is not None:
            raise ValueError("layout, density: expected one of them, got both")
        if layout is None:
            if density is None:
                raise ValueError("layout: expected a layout or a density, got neither")
            layout = layouts.balanced((in_channels // bs, out_channels // bs), density, seed=seed)
        lay = layouts.validate(layout, in_channels, out_channels, bs)
        if isinstance(padding, str):
            if padding.lower() not in ("same", "valid"):
                raise ValueError(f"padding: expected 'same', 'valid' or an int, got {padding!r}")
            padding = padding.upper()
        elif isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding: expected 'same', 'valid' or an int >= 0, got {padding!r}")
        self.in_channels, self.out_channels, self.block_size = in_channels, out_channels, bs
        self.kernel_size = _pair("kernel_size", kernel_size)
        self.stride, self.dilation = _pair("stride", stride), _pair("dilation", dilation)
        if backend not in ("auto", "grouped", "dense", "triton"):
            raise ValueError(f"backend: expected 'auto', 'grouped', 'dense' or 'triton', got {backend!r}")
        if backend == "triton" and bs not in (16, 32, 64, 128):
            raise ValueError(f"block_size: the Triton kernels take 16, 32, 64 or 128, got {bs}")
        self.padding, self.backend = padding, backend
        self._set_layout(lay, device)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(int(lay.sum()), bs, bs, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.register_buffer("layout", torch.as_tensor(lay, device=device), persistent=True)
        self.reset_parameters()

    def block_layout(self) -> np.ndarray:
        """The (C/bs, K/bs) bool layout (for TensorBoard images and the DDP layout check)."""
        return self._layout

    @property
    def density(self) -> float:
        return float(self._layout.mean())

    def fan_in(self) -> torch.Tensor:
        """(K,) live inputs of each output channel: bs x live blocks in its column x kh x kw."""
        per_col = self._layout.sum(0) * self.block_size * math.prod(self.kernel_size)
        return torch.as_tensor(np.repeat(per_col, self.block_size), dtype=torch.float32)

    def reset_parameters(self) -> None:
        """nn.Conv2d's default init with each output channel's true fan-in: uniform ±1/sqrt(fan_in).
        Also rewrites the layout buffer and the index tables from the layout (after ``to_empty()``
        they hold uninitialised memory)."""
        if self.weight.is_meta:
            return
        with torch.no_grad():
            self.layout.copy_(torch.as_tensor(self._layout))
        self._set_layout(self._layout, self.weight.device)
        bound = 1.0 / self.fan_in().clamp_min(1).sqrt()                      # (K,)
        _, kj = np.nonzero(self._layout)
        bs = self.block_size
        rows = torch.as_tensor(kj)[:, None] * bs + torch.arange(bs)[None, :]  # (nnz, bs) output channels
        with torch.no_grad():
            self.weight.uniform_(-1, 1)
            self.weight.mul_(bound[rows].view(len(kj), bs, 1, 1, 1).to(self.weight))
            if self.bias is not None:
                b = bound.to(self.bias)
                self.bias.uniform_(-1, 1).mul_(b)

    def _path(self, x: torch.Tensor, w: torch.Tensor | None = None) -> str:
        """The backend that runs x. "auto" takes the Triton kernels where they beat cuDNN on the
        H200 (benchmarks/conv.md: CUDA, 16-bit, channels-last, stride 1, blocks of 64 or more, or
        at most 1/8 live), else cuDNN's grouped conv where the blocks sit in channel order
        (block-diagonal: no gather or scatter), else the masked dense filter (faster than the
        grouped gather-scatter at every measured point)."""
        if self.backend != "auto":
            return self.backend
        w = self.weight if w is None else w
        if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dtype == w.dtype
                and self.stride == (1, 1) and self.block_size in (16, 32, 64, 128)
                and x.is_contiguous(memory_format=torch.channels_last)
                and (self.block_size >= 64 or self.density <= 0.125)):
            return "triton"
        return "grouped" if x.is_cuda and self._gather is None and self._scatter is None else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"x: expected (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        p = self.padding
        padding = [p, p] if isinstance(p, int) else (["SAME", "SAME"] if p == "SAME" else [0, 0])
        _out_size, pads = conv_geometry(self.kernel_size, [int(x.shape[2]), int(x.shape[3])], self.stride,
                                        self.dilation, padding)
        w = self.weight
        if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
            dt = compute_dtype(x)                       # autocast: run (and pick the path) in its dtype
            x, w = x.to(dt), w.to(dt)
        path = self._path(x, w)
        if path == "triton":
            if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"x: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got one on {x.device}")
            if x.dtype != w.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise TypeError(f"x: backend='triton' takes float16/bfloat16/float32 like the weight "
                                f"({w.dtype}), got {x.dtype}")
            P, Q = _out_size
            y = sparse_conv2d(x, w, [getattr(self, f"_t_{n}") for n in _TABLES], self.out_channels, P, Q,
                         list(self.stride), [pads[0][0], pads[1][0]], list(self.dilation))
        elif path == "grouped":
            xg = x if self._gather is None else x.index_select(1, self._gather)
            y = conv_nd(xg, w.flatten(0, 1), self.stride, self.dilation, pads, groups=w.shape[0])
            if self._scatter is not None:
                y = y.new_zeros(y.shape[0], self.out_channels, y.shape[2], y.shape[3]).index_add(1, self._scatter, y)
        else:
            dense = w.new_zeros(self.out_channels, self.in_channels, *self.kernel_size)
            dense = dense.index_put((self._rows, self._cols), w.flatten(0, 2), accumulate=True)
            y = conv_nd(x, dense, self.stride, self.dilation, pads)
        return y if self.bias is None else y + self.bias.to(y.dtype).view(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding!r}, block_size={self.block_size}, density={self.density:.3f}, "
                f"bias={self.bias is not None}")

    def _set_layout(self, lay: np.ndarray, device=None) -> None:
        """The layout and its index tables (buffers on ``device``, not saved: the layout buffer is)."""
        bs = self.block_size
        ci, kj = np.nonzero(lay)
        self._layout = lay
        chan = np.arange(bs)
        cin = (ci[:, None] * bs + chan).ravel()                     # gathered input channel per group row
        kout = (kj[:, None] * bs + chan).ravel()                     # output channel of each grouped output
        dev = device
        t = lambda a: torch.as_tensor(a, device=dev)               # noqa: E731
        self.register_buffer("_gather", None if np.array_equal(cin, np.arange(self.in_channels)) else t(cin),
                             persistent=False)
        self.register_buffer("_scatter", None if np.array_equal(kout, np.arange(self.out_channels)) else t(kout),
                             persistent=False)
        rows = np.repeat(kout.reshape(-1, bs), bs, axis=1).ravel()   # dense (k, c) of every filter element
        cols = np.tile(cin.reshape(-1, bs), (1, bs)).ravel()
        self.register_buffer("_rows", t(rows), persistent=False)
        self.register_buffer("_cols", t(cols), persistent=False)
        from bstrain.kernels.conv import make_luts
        luts = make_luts(lay, bs, dev)
        for name in _TABLES:
            self.register_buffer(f"_t_{name}", getattr(luts, name), persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A loaded layout replaces this layer's (same number of live blocks), so weights always
        meet the layout they were trained on; another shape or count is an error naming the layer."""
        key = prefix + "layout"
        if key in state_dict:
            new = np.asarray(state_dict[key].detach().cpu(), dtype=bool)
            name = prefix.rstrip(".") or "BlockSparseConv2d"
            if new.shape != self._layout.shape or new.sum() != self._layout.sum():
                error_msgs.append(f"{name}: the checkpoint's layout has shape {new.shape} and {int(new.sum())} live "
                                  f"blocks, this layer's {self._layout.shape} and {int(self._layout.sum())}; build "
                                  f"the layer with layout=state_dict['{key}']")
                return
            # tables rebuilt every time (to_empty() leaves garbage), where the weight will live
            assign = bool(local_metadata.get("assign_to_params_buffers"))
            incoming = state_dict.get(prefix + "weight")
            dev = incoming.device if assign and isinstance(incoming, torch.Tensor) else self.weight.device
            self._set_layout(new, dev)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
