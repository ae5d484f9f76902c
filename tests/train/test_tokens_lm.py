"""config=llama_tiny: a Hugging Face Llama trains on BPE tokens through the trainer; the vocabulary
reaches the model's config; bad token settings stop the start in one line."""
from __future__ import annotations

import math

import pytest
from omegaconf import open_dict

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from bstrain.errors import UserError  # noqa: E402
from bstrain.train.checkpoint import load_checkpoint  # noqa: E402
from bstrain.train.trainer import train  # noqa: E402
from tests.train.test_cli import one_line_error, run as cli  # noqa: E402


@pytest.fixture
def llama_cfg(make_cfg, tmp_path):
    """config=llama_tiny shrunk: a BPE of 300 tokens on 60 kB of the embedded corpus, 3 steps."""
    def make(*overrides, **shrink):
        cfg = make_cfg("config=llama_tiny", "data.max_bytes=60000", "data.vocab_size=300",
                       f"data.cache_dir={tmp_path / 'cache'}", "model.config.hidden_size=32",
                       "model.config.intermediate_size=64", "model.config.num_attention_heads=2",
                       "model.config.num_key_value_heads=2", *overrides,
                       **{"trainer__max_steps": 3, "trainer__eval_every": 0, "trainer__ckpt_every": 0, **shrink})
        with open_dict(cfg):
            del cfg.model.hidden, cfg.model.embed, cfg.model.block_size      # (make_cfg's LSTM sizes)
        return cfg
    return make


def test_llama_trains_on_tokens_and_reports_bits_per_byte(llama_cfg):
    out = train(llama_cfg())
    assert [step for step, _ in out["history"]] == [1, 2, 3]
    assert out["valid_batches"] == 2 and out["valid_loss"] == out["valid_loss_per_token"]
    # bits per byte, not per token: the same nats over more bytes (a BPE of 300 tokens: 1.3 bytes per token)
    assert 1.2 < out["valid_loss"] / (math.log(2) * out["valid_bpb"]) < 1.5
    ckpt = load_checkpoint(out["run_dir"])
    assert ckpt["config"]["model"]["config"]["vocab_size"] == 300
    assert ckpt["model"]["model.embed_tokens.weight"].shape == (300, 32)


def test_a_tokenizer_file_fills_data_vocab_size(llama_cfg, tmp_path):
    """data.vocab_size=null beside a tokenizer.json: the trainer sets it to the file's vocabulary,
    and the model's ${data.vocab_size} reads it."""
    first = train(llama_cfg(trainer__max_steps=1, run="bpe"))
    tokenizer = next((tmp_path / "cache").glob("bpe-300-*.json"))
    out = train(llama_cfg(f"data.tokenizer={tokenizer}", "data.vocab_size=null", trainer__max_steps=1, run="file"))
    assert out["valid_bpb"] == pytest.approx(first["valid_bpb"], rel=1e-6)
    assert load_checkpoint(out["run_dir"])["config"]["data"]["vocab_size"] == 300


def test_a_model_vocabulary_smaller_than_the_tokenizers(llama_cfg):
    with pytest.raises(UserError, match=r"^model.config.vocab_size=200 is smaller than the vocabulary of "
                                        r"data.tokenizer=bpe \(300 tokens\): set model.config.vocab_size to at least "
                                        r"300"):
        train(llama_cfg("model.config.vocab_size=200"))


def test_the_cli_says_a_too_small_bpe_in_one_line(tmp_path):
    out = cli("train", "config=llama_tiny", "data.vocab_size=100", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    one_line_error(out, "data.vocab_size=100: a byte-level BPE needs at least 257 tokens", "data.vocab_size=257")
    assert not list(tmp_path.iterdir()), "the start stopped before a run dir or a cache entry was made"
