"""The run's optimizer: AdamW built for the device and for CUDA-graph capture, and matched to this
run again after a checkpoint's state dict brought another run's settings."""
from __future__ import annotations

import torch


def _optimizer_flags(device: torch.device, capturable: bool) -> dict:
    """Fused AdamW on CUDA, foreach elsewhere; capturable for CUDA-graph capture."""
    fused = device.type == "cuda"
    return {"fused": True if fused else None, "foreach": None if fused else True, "capturable": capturable}


def _lr(value, capturable: bool, device: torch.device):
    """Graph capture reads the learning rate from a device tensor the schedule fills; else a float."""
    return torch.tensor(float(value), device=device) if capturable else float(value)


def make_optimizer(model: torch.nn.Module, cfg, device: torch.device,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and blocks only; fused kernels on CUDA, foreach elsewhere.

    capturable: for CUDA-graph capture (learning rates become device tensors the schedule fills).
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": ps, "weight_decay": wd, "lr": _lr(cfg.lr, capturable, device)}
              for ps, wd in ((decay, cfg.weight_decay), (rest, 0.0)) if ps]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **_optimizer_flags(device, capturable))


def _match_graph_mode(optimizer: torch.optim.Optimizer, capturable: bool, device: torch.device) -> None:
    """After loading a state dict, which brings the saving run's group settings (another device,
    with or without CUDA graphs): this run's optimizer flags and learning-rate kind (a checkpoint's
    tensor lr comes back on the CPU, where a graph would not see the schedule), and step counters
    where AdamW wants them.
    """
    flags = _optimizer_flags(device, capturable)
    for g in optimizer.param_groups:
        g.update(flags)
        g["lr"] = _lr(g["lr"], capturable, device)
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if isinstance(st.get("step"), torch.Tensor):
                on_device = capturable or flags["fused"]
                st["step"] = st["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)
