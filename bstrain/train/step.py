"""The language-model loss every training path shares (eager loop, CUDA graph, evaluation, benchmarks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(net, x: torch.Tensor, y: torch.Tensor, state, amp_dtype: torch.dtype | None, group_size: int = 1):
    """Forward under autocast (amp_dtype None: off), then the mean next-byte cross-entropy in fp32.

    Returns (loss, new recurrent state).
    """
    with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        logits, state = net(x, state, group_size=group_size)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)), state


def clip_grads(params, grad_clip: float) -> torch.Tensor:
    """Global-norm clipping to ``grad_clip`` (0: none); returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
