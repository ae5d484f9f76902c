"""The shipped experiments (bstrain/configs/config/*.yaml): each composes against the schemas and
passes the start-up checks; transformer_long keeps its long-context shape and trains at a reduced
size; model.checkpoint is refused in one line by the models without it."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from bstrain.cli import experiments, one_line, rewrite
from bstrain.configs import schema
from bstrain.train.trainer import train


def composed(*overrides):
    schema.register()
    with initialize_config_module(config_module="bstrain.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("name", experiments())
def test_every_experiment_composes_and_checks(name):
    """Composed as the CLI does; a config that needs data gets a path (its ``???``)."""
    cfg = composed(f"config={name}")
    if OmegaConf.is_missing(cfg.data, "path"):
        cfg = composed(f"config={name}", "data.path=/data/unused")
    schema.check_config(cfg)
    assert cfg.trainer.max_steps > 0 and cfg.data.batch_size > 0


def test_transformer_long_is_a_checkpointed_local_global_lm_at_32k():
    cfg = composed("config=transformer_long", "data.path=/data/unused")
    m = cfg.model
    assert m.context == cfg.data.seq_len == 32768 and cfg.data.batch_size == 1
    assert (m.d_model // m.n_head, m.block_size, m.checkpoint) == (128, 128, True)
    assert m.attention == "local,fixed" and m.window % m.block_size == 0 and m.summary == m.block_size


@pytest.mark.parametrize("twin", [[], ["model.attention=dense"]], ids=["sparse", "dense-twin"])
def test_transformer_long_trains_at_a_reduced_size(tmp_path, twin):
    """Its model, narrower and at a 1k context, through the trainer on the CPU: two checkpointed
    bf16 steps on the embedded corpus, for the sparse layout and its dense twin."""
    cfg = composed("config=transformer_long", "data.path=null", "data.name=auto", *twin, "model.d_model=64", "model.n_head=2", "model.n_layer=2", "model.context=1024",
                   "data.seq_len=1024", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.ckpt_every=0",
                   "trainer.eval_batches=1", "trainer.log_every=1", "trainer.device=cpu", "trainer.progress=false",
                   f"trainer.run_dir={tmp_path / 'run'}")
    out = train(cfg)
    assert out["steps"] == 2 and all(loss == loss for _, loss in out["history"])


@pytest.mark.parametrize("name", ["lstm_tiny", "convnet_tiny"])
def test_checkpoint_is_refused_in_one_line_where_a_model_lacks_it(name):
    with pytest.raises(Exception) as info:
        composed(*rewrite("train", [f"config={name}", "model.checkpoint=true"]))
    assert one_line(info.value).startswith("model.checkpoint: no such key; model has _target_, ")


def test_transformer_fsdp_outgrows_ddp_on_one_h200():
    """transformer_fsdp: fsdp by default, and with AdamW (16 bytes a parameter: fp32 weight,
    gradient and two moments) more state than one H200's 141 GB before activations: DDP cannot
    hold it, fsdp splits it."""
    import torch

    from bstrain.models.transformer import SparseTransformer
    cfg = composed("config=transformer_fsdp", "data.path=/data/unused")
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.precision == "bf16" and cfg.model.checkpoint
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "_target_"}
    with torch.device("meta"):
        model = SparseTransformer(**kwargs)
    params = sum(p.numel() for p in model.parameters())
    assert params * 16 > 141e9, params
    assert len(model.shard_units()) == cfg.model.n_layer == 48
