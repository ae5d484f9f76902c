"""Making real tensors whatever context the caller is in: used by the layout builders
(:mod:`bstrain.layout`) and by the ops' shared tables (:mod:`bstrain.ops.tables`), so it sits
below both; and the largest index an int32 offset holds, which kernels and ops check sizes against."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["real_tensors", "INT32_MAX"]

INT32_MAX = 2**31 - 1


@contextlib.contextmanager
def real_tensors(device: torch.device):
    """Tensors made inside are real, ordinary tensors on ``device``: outside any fake mode,
    inference mode or default-device (meta) context of the caller."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), torch.inference_mode(False), torch.device(device):
        yield
