"""``eval`` and ``sample``: both rebuild the model from the config stored in a checkpoint."""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from bstrain.configs.schema import TrainConfig
from bstrain.data.text import check_size, load_bytes
from bstrain.models.lstm import build_model
from bstrain.train.checkpoint import load_checkpoint
from bstrain.train.progress import log
from bstrain.train.trainer import evaluate, resolve_device


def _load(ckpt_path: str, device: torch.device):
    ckpt = load_checkpoint(ckpt_path)
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), ckpt["config"])
    model = build_model(cfg.model).to(device)
    weights = ckpt["model"]
    if ckpt.get("ema") is not None:                    # evaluate with the EMA weights when trained with them
        weights = {k.removeprefix("module."): v for k, v in ckpt["ema"].items() if k.startswith("module.")}
    model.load_state_dict(weights)
    return cfg, model, ckpt


def evaluate_checkpoint(cfg) -> dict:
    """Loss and bits per byte of a checkpoint on the valid or test split."""
    if cfg.split not in ("valid", "test"):
        raise ValueError(f"split: expected valid or test, got {cfg.split!r}")
    device = resolve_device(cfg.device)
    train_cfg, model, ckpt = _load(cfg.ckpt, device)
    path = cfg.data_path if cfg.data_path is not None else train_cfg.data.path
    _, valid, test = load_bytes(path, train_cfg.data.name)
    data = valid if cfg.split == "valid" else test
    check_size(data, train_cfg.data.batch_size, train_cfg.data.seq_len, path, cfg.split)
    loss, bpb = evaluate(model, data, train_cfg, device, cfg.batches)
    log.info("%s (step %d) on %s: loss %.4f nats/byte, %.4f bits/byte", ckpt["path"], ckpt["step"], cfg.split,
             loss, bpb)
    print(f"{cfg.split}: {bpb:.4f} bits/byte (loss {loss:.4f}, step {ckpt['step']})")
    return {"loss": loss, "bpb": bpb, "step": ckpt["step"]}


@torch.no_grad()
def sample(cfg) -> str:
    """Generates ``length`` bytes after ``prompt``; prints and returns the text."""
    device = resolve_device(cfg.device)
    _, model, _ = _load(cfg.ckpt, device)
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    prompt = list(cfg.prompt.encode("utf-8")) or [10]
    x = torch.tensor([prompt], device=device)
    logits, state = model(x)
    out = bytearray(prompt)
    for _ in range(cfg.length):
        probs = torch.softmax(logits[0, -1].float() / max(cfg.temperature, 1e-5), dim=-1).cpu()
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        logits, state = model(torch.tensor([[nxt]], device=device), state)
    text = out.decode("utf-8", errors="replace")
    print(text)
    return text
