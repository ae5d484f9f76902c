"""Median trainer step time (ms) of a built-in config, from train()'s logged windows (warm-up left out).

    PYTHONPATH=TREE taskset -c 0 python scripts/bench/trainer_step_time.py lstm_tiny   (or transformer_tiny)
"""
import statistics, sys, tempfile
from hydra import compose, initialize_config_module
from omegaconf import open_dict
from bstrain.configs.schema import register
from bstrain.train.trainer import train
register()
name = sys.argv[1]
with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
    cfg = compose(config_name="train", overrides=[f"config={name}"])
with open_dict(cfg):
    t = cfg.trainer
    t.max_steps, t.log_every, t.eval_every, t.ckpt_every, t.threads, t.progress = 30, 5, 0, 0, 1, False
    t.run_dir = tempfile.mkdtemp()
import logging; logging.disable(logging.INFO)
out = train(cfg)
rates = out["throughput"][1:]
units = {"lstm_tiny": cfg.data.batch_size * cfg.data.seq_len, "transformer_tiny": cfg.data.batch_size * cfg.data.seq_len}[name]
print(f"{name} {1e3 * units / statistics.median(rates):.3f}")
