"""``eval``, ``sample`` and ``convert``: each rebuilds the model (sparsified as the run's was) and eval
and sample the data and task, from the config stored in a checkpoint, once every ``_target_`` in it is
trusted (bstrain/train/trust.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from bstrain.errors import UserError
from bstrain.train import trust
from bstrain.train.checkpoint import check_model_entries, load_checkpoint
from bstrain.train.distributed import World
from bstrain.train.progress import log
from bstrain.train.step import Forward, is_stateful
from bstrain.train.model import build_model, instantiate
from bstrain.configs.schema import Precision
from bstrain.train.run import resolve_device, set_threads


def _required_ckpt(cfg) -> str:
    if OmegaConf.is_missing(cfg, "ckpt") or not str(cfg.ckpt).strip():
        raise UserError("ckpt: expected the checkpoint file or run dir to use, e.g. ckpt=runs/2026-11-30/12-00-00")
    return str(cfg.ckpt)


def upgrade_config(config: dict) -> dict:
    """A checkpoint config from before model/data/task were built by ``_target_`` (bstrain 0.1.0 up
    to a562ef9: the sparse LSTM on bytes, ``model.name: lstm``) in today's form."""
    config = dict(config)
    model = dict(config.get("model") or {})
    if "_target_" not in model and model.get("name", "lstm") == "lstm":
        model.pop("name", None)
        config["model"] = {"_target_": "bstrain.models.lstm.SparseLSTM", **model}
    if "_target_" not in (config.get("data") or {}):
        config["data"] = {"_target_": "bstrain.data.text.ByteCorpus", **(config.get("data") or {})}
    config.setdefault("task", {"_target_": "bstrain.train.tasks.lm.ByteLM"})
    return config


def _read_trusted(cfg) -> tuple[dict, DictConfig]:
    """(the checkpoint ``ckpt=`` names, the config to build from it), refused in one line unless
    every ``_target_`` in that config is bstrain's or ``trust=[...]`` names it (bstrain/train/trust.py)."""
    trusted = trust.globs(cfg.get("trust"))

    def check(config: dict, path) -> None:
        trust.check_config(upgrade_config(config), path, trusted)

    ckpt = load_checkpoint(_required_ckpt(cfg), check_config=check)
    return ckpt, OmegaConf.create(upgrade_config(ckpt["config"]))


def _load(cfg, data_path=None):
    """(train config, model on the device in eval mode, task set up for one process, checkpoint, forward)."""
    device = resolve_device(cfg.device, "device")
    set_threads(cfg.threads)
    ckpt, train_cfg = _read_trusted(cfg)
    if data_path is not None:
        if train_cfg.data.get("tokenizer") == "bpe":       # a BPE of the new text would give other ids
            raise UserError("data_path: this run's tokenizer is a BPE trained on its own training split "
                            "(data.tokenizer=bpe), which other text would replace; evaluate its own data, or "
                            "train with data.tokenizer=PATH/tokenizer.json to evaluate other text")
        train_cfg.data.path = data_path
    task = instantiate(train_cfg.task, "task")
    task.setup(instantiate(train_cfg.data, "data"), World(), int(train_cfg.trainer.seed))
    model, _ = build_model(train_cfg, rebuild=True)        # sparsified as the run was (cfg.sparsify)
    weights = ckpt["model"]
    if ckpt.get("ema") is not None:                    # evaluate with the EMA weights when trained with them
        weights = {k.removeprefix("module."): v for k, v in ckpt["ema"].items() if k.startswith("module.")}
    check_model_entries(model, weights, ckpt["path"], adopt_layouts=True)
    model.load_state_dict(weights, assign=True)                # the checkpoint's layouts, whatever the config draws
    model.to(device).eval()
    forward = Forward(model, Precision(train_cfg.trainer.precision).dtype, device)
    return train_cfg, model, task, ckpt, forward


def evaluate_checkpoint(cfg) -> dict:
    """The task's metrics of a checkpoint on the valid or test split."""
    split = getattr(cfg.split, "value", cfg.split)
    if split not in ("valid", "test"):
        raise UserError(f"split: expected valid or test, got {split!r}")
    _, _, task, ckpt, forward = _load(cfg, cfg.data_path)
    res = task.evaluate(forward, split, cfg.batches, show_progress=True)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in res.items() if isinstance(v, float))
    weights = " (EMA weights)" if ckpt.get("ema") is not None else ""
    log.info("%s (step %d) on %s%s: %s", ckpt["path"], ckpt["step"], split, weights, shown)
    print(f"{split}{weights} at step {ckpt['step']}: {shown}")
    return {**res, "step": ckpt["step"]}


def _prompt(cfg) -> bytes:
    if cfg.prompt_file:
        try:
            with open(cfg.prompt_file, "rb") as f:
                return f.read()
        except OSError as exc:
            raise UserError(f"prompt_file: cannot read {cfg.prompt_file} ({exc.strerror})") from None
    return str(cfg.prompt).encode("utf-8")


@torch.no_grad()
def sample(cfg) -> str:
    """Generates ``length`` bytes after ``prompt``; prints and returns the text."""
    if cfg.length < 0 or cfg.temperature < 0:
        raise UserError(f"length, temperature: expected >= 0, got {cfg.length}, {cfg.temperature}")
    _, model, task, _, forward = _load(cfg)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    try:
        out = task.sample(forward, is_stateful(model), _prompt(cfg), cfg.length, cfg.temperature, gen,
                          forward.device)
    except NotImplementedError as exc:
        raise UserError(f"sample: {exc}") from None
    text = out.decode("utf-8", errors="replace")
    print(text)
    return text


def convert_checkpoint(cfg) -> str:
    """A checkpoint in the other format: a file (one process, DDP) as a sharded DCP directory
    (``out=...dcp``), or a DCP directory as a file (``out=...pt``). The optimizer's state is keyed by
    parameter index in a file and by name in DCP; the model the checkpoint's config builds (on the
    meta device, no memory) gives the order."""
    from bstrain.train import sharded
    from bstrain.train.checkpoint import save_checkpoint
    from bstrain.train.optim import make_optimizer
    out = Path(str(cfg.out)) if not OmegaConf.is_missing(cfg, "out") and str(cfg.out).strip() else None
    if out is None or out.suffix not in (".pt", ".dcp"):
        raise UserError(f"out: expected the path to write, ending in .pt (a file) or .dcp (a sharded directory), "
                        f"got {None if out is None else str(out)!r}")
    if out.exists():
        raise UserError(f"out: {out} exists; name a new path")
    ckpt, train_cfg = _read_trusted(cfg)
    with torch.device("meta"):
        model, _ = build_model(train_cfg, rebuild=True)
    optimizer = make_optimizer(model, train_cfg.optim, torch.device("cpu"), capturable=False)
    names = sharded.parameter_order(model, optimizer)
    by_name = ckpt.pop("optimizer_fqn", None)
    extra = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "path")}
    if out.suffix == ".dcp":
        optim = by_name if by_name is not None else sharded.optimizer_by_name(ckpt["optimizer"], names)
        sharded.write_whole(out, ckpt["model"], optim, extra)
    else:
        optim = ckpt["optimizer"] if by_name is None else sharded.optimizer_by_index(by_name, names)
        save_checkpoint(out, {**extra, "model": ckpt["model"], "optimizer": optim})
    log.info("%s (step %d) written as %s", ckpt["path"], ckpt["step"], out)
    print(f"wrote {out}")
    return str(out)
