"""How often the trainer's config, followed through the code, returns to a file it already left.

    python scripts/profile/config_path.py [config=lstm_tiny]

Trains a tiny run (2 steps, one evaluation, one checkpoint) under ``sys.setprofile``: each call into
bstrain/train or bstrain/configs that receives the config, one of its sections (an OmegaConf node) or
an object holding it (``.cfg``: the run) as an argument is a point on the config's path; the path's files, with repeats in a row merged, are
counted where a file comes back after another was visited in between. Prints the count and the path.
"""
from __future__ import annotations

import os
import sys
import tempfile

from omegaconf import DictConfig, ListConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)          # this tree's bstrain, not an installed one


def main(argv: list[str]) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from bstrain.configs.schema import register
    from bstrain.train.trainer import train
    register()
    overrides = argv or ["config=lstm_tiny"]
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.ckpt_every = 2, 2, 2
        cfg.trainer.eval_batches, cfg.trainer.progress = 1, False
        cfg.trainer.run_dir = tempfile.mkdtemp()
    root = ROOT
    watched = (os.path.join(root, "bstrain", "train"), os.path.join(root, "bstrain", "configs"))
    path: list[str] = []

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(watched):
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(isinstance(a, (DictConfig, ListConfig)) or isinstance(getattr(a, "cfg", None), DictConfig)
               for a in args):
            name = os.path.relpath(code.co_filename, root)
            if not path or path[-1] != name:
                path.append(name)
    sys.setprofile(profile)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
    returns = sum(1 for i, f in enumerate(path) if f in path[:i])
    print(f"config path: {len(path)} file visits, {returns} returns to a file already left")
    print(" -> ".join(p.removeprefix("bstrain/") for p in path))


if __name__ == "__main__":
    main(sys.argv[1:])
