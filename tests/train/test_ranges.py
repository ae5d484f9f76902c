"""The value ranges declared beside the schema's fields (bstrain/configs/schema.py): a value out of
range stops the run at start with one line naming the key, what is expected and what was given."""
from __future__ import annotations

import dataclasses
import re

import pytest
from omegaconf import open_dict

from bstrain.configs.schema import OptimConfig, SparsityConfig, TrainerConfig
from bstrain.errors import UserError
from bstrain.train.trainer import check_config, train

BAD = [  # key, a value out of range, what the error says is expected
    ("optim.lr", 0.0, "> 0"),
    ("optim.weight_decay", -0.1, ">= 0"),
    ("optim.beta1", 1.0, "in [0, 1)"),
    ("optim.beta2", -0.5, "in [0, 1)"),
    ("optim.eps", 0.0, "> 0"),
    ("optim.warmup_steps", -1, ">= 0"),
    ("optim.min_lr_ratio", 1.5, "in [0, 1]"),
    ("optim.grad_clip", -1.0, ">= 0"),
    ("optim.ema", 1.0, "in [0, 1)"),
    ("trainer.max_steps", 0, ">= 1"),
    ("trainer.group_size", 0, ">= 1"),
    ("trainer.log_every", 0, ">= 1"),
    ("trainer.eval_every", -1, ">= 0"),
    ("trainer.eval_batches", -1, ">= 0"),
    ("trainer.ckpt_every", -5, ">= 0"),
    ("trainer.keep_ckpts", 0, ">= 1"),
    ("trainer.loss_scale_window", 0, ">= 1"),
    ("trainer.time_limit_s", -1.0, ">= 0"),
    ("trainer.threads", -2, ">= 0"),
    ("trainer.nproc", 0, ">= 1"),
    ("sparsity.every", 0, "an int >= 1"),
    ("sparsity.every", -3, "an int >= 1"),
    ("sparsity.fraction", 0.0, "a share in (0, 1)"),
    ("sparsity.fraction", 1.0, "a share in (0, 1)"),
    ("sparsity.fraction", -0.2, "a share in (0, 1)"),
    ("sparsity.until", 0.0, "a share of trainer.max_steps in (0, 1]"),
    ("sparsity.until", 1.5, "a share of trainer.max_steps in (0, 1]"),
]


def _set(cfg, key: str, value) -> None:
    section, name = key.split(".")
    with open_dict(cfg):
        cfg[section][name] = value


@pytest.mark.parametrize("key, value, expected", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_value_out_of_range_names_the_key_expected_and_got(make_cfg, key, value, expected):
    cfg = make_cfg("sparsity=set")
    _set(cfg, key, value)
    with pytest.raises(UserError) as info:
        check_config(cfg)
    assert str(info.value) == f"{key}: expected {expected}, got {value!r}"


def test_every_declared_range_is_tested():
    declared = {f"{section}.{f.name}" for section, schema in (("optim", OptimConfig), ("trainer", TrainerConfig),
                                                              ("sparsity", SparsityConfig))
                for f in dataclasses.fields(schema) if "check" in f.metadata}
    assert declared == {key for key, _, _ in BAD}


@pytest.mark.parametrize("key, value", [("sparsity.every", 1), ("sparsity.fraction", 0.999), ("sparsity.until", 1.0),
                                        ("optim.beta1", 0.0), ("optim.min_lr_ratio", 1.0), ("trainer.eval_every", 0)])
def test_the_ends_of_a_range_pass(make_cfg, key, value):
    cfg = make_cfg("sparsity=rigl")
    _set(cfg, key, value)
    check_config(cfg)


@pytest.mark.parametrize("policy", ["static", "set"])
def test_sparsity_ranges_stop_a_run_before_its_run_dir_is_made(make_cfg, tmp_path, policy):
    cfg = make_cfg(f"sparsity={policy}", run="bad")
    _set(cfg, "sparsity.until", 0.0)
    with pytest.raises(UserError, match=re.escape("sparsity.until: expected a share of trainer.max_steps in (0, 1], "
                                                  "got 0.0")):
        train(cfg)
    assert not (tmp_path / "bad").exists()
