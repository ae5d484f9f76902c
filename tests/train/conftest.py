"""Helpers: compose the real Hydra config, shrunk for CPU tests."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from bstrain.configs.schema import register


@pytest.fixture
def make_cfg(tmp_path):
    register()

    def make(*overrides, lm: bool = True, **shrink):
        with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides))
        with open_dict(cfg):
            cfg.model.hidden, cfg.model.embed, cfg.model.block_size = 64, 16, 16
            if lm:
                cfg.data.seq_len, cfg.data.batch_size = 16, 4
            cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.ckpt_every = 12, 6, 4
            cfg.trainer.eval_batches, cfg.trainer.log_every = 2, 2
            cfg.trainer.run_dir = str(tmp_path / shrink.pop("run", "run"))
            cfg.trainer.progress = False
            cfg.optim.warmup_steps = 2
            for key, value in shrink.items():
                section, name = key.split("__")
                cfg[section][name] = value
        return cfg
    return make


@pytest.fixture
def command_cfg():
    """The composed config of ``eval`` or ``sample`` with overrides, as the CLI builds it."""
    register()

    def make(name, *overrides):
        with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
            return compose(config_name=name, overrides=list(overrides))
    return make
