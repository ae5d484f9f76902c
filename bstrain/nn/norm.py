"""``LayerNorm``: ``nn.LayerNorm``'s conventions over bstrain's fused layer-norm kernel."""
from __future__ import annotations

import torch
from torch import nn

from bstrain.ops.norms import layer_norm

__all__ = ["LayerNorm"]


class LayerNorm(nn.Module):
    """Layer norm over the last dimension, as ``nn.LayerNorm(normalized_shape)``, with the seed's
    extras: ``segments`` independently normalised equal slices of the features (the four LSTM
    gates), a fused ``relu``, and fp32 parameters with 16-bit activations in one kernel.

    Args:
        normalized_shape: C, the size of the last dimension (an int or a 1-tuple).
        eps: added to the variance.
        elementwise_affine: learn a (C,) gain ``weight`` (ones) and, with ``bias``, a (C,) ``bias`` (zeros).
        segments: normalise each of ``segments`` equal slices of C independently.
        relu: apply ReLU to the output (fused).
        device, dtype: of the parameters.

    On CUDA the fused kernel runs for segments > 1, relu, or fp32 parameters with 16-bit input;
    the plain case is ``F.layer_norm``. Input (*, C); output like the input.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 *, segments: int = 1, relu: bool = False, device=None, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int) or shape[0] < 1:
            raise ValueError(f"normalized_shape: expected a positive int (the last dimension), got {normalized_shape!r}")
        C = shape[0]
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1 or C % segments:
            raise ValueError(f"segments: expected a positive divisor of normalized_shape={C}, got {segments!r}")
        self.normalized_shape, self.eps, self.segments, self.relu = shape, float(eps), segments, bool(relu)
        self.elementwise_affine = bool(elementwise_affine)
        factory = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(C, **factory))
            self.bias = nn.Parameter(torch.empty(C, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        C = self.normalized_shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != C:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected (*, {C}), got {got}")
        pdtype = self.weight.dtype if self.weight is not None else x.dtype
        g = self.weight if self.weight is not None else x.new_ones(C, dtype=pdtype)
        b = self.bias if self.bias is not None else x.new_zeros(C, dtype=pdtype)
        return layer_norm(x, g, b, axis=-1, segments=self.segments, epsilon=self.eps, relu=self.relu)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"segments={self.segments}, relu={self.relu}")
