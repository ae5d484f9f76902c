"""What the kernel families ask of the device and their operands before they launch: the
multiprocessor count, tl.dot's input precision, whether tensors can take TMA loads, and TMA
tensor descriptors built once per plan and rebound to each call's tensors.
"""
from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    return True


def desc_template(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor of t's shape, strides and block, checked, holding no tensor."""
    d = TensorDescriptor(t, list(t.shape), list(t.stride()), block)
    d.base = None
    return d


def desc_like(template: TensorDescriptor, t: torch.Tensor) -> TensorDescriptor:
    """``template`` over tensor t, which has its shape, strides and alignment: the checks were
    made once, when the template was built."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(template.__dict__)
    d.base = t
    return d
