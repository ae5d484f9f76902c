"""Tokenized text (bstrain/data/tokens.py): tokenizer files, the BPE cache, memory-mapped token ids,
and bits per byte of the LM task on tokens."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from bstrain.data import tokens  # noqa: E402
from bstrain.data.text import BpttBatches, ByteCorpus, DataError, default_corpus  # noqa: E402
from bstrain.errors import UserError  # noqa: E402
from bstrain.train.distributed import World  # noqa: E402
from bstrain.train.step import Forward  # noqa: E402
from bstrain.train.tasks.lm import ByteLM  # noqa: E402

TEXT = "déjà vu ✓ — naïve café\n" * 3 + "def f(x):\n    return x + 1\n"


@pytest.fixture(scope="module")
def slice_bytes() -> np.ndarray:
    """A small slice of the embedded corpus: BPE training stays well under a second."""
    return np.frombuffer(bytearray(default_corpus(60_000)), dtype=np.uint8)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory, slice_bytes):
    return tokens.bpe_tokenizer(slice_bytes, 300, tmp_path_factory.mktemp("cache"))


def _text_file(tmp_path, repeat: int = 40):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * repeat, encoding="utf-8")
    return path


def test_tokenizer_json_round_trip(bpe_file, tmp_path):
    tokenizer = tokens.load_tokenizer(bpe_file)
    copy = tmp_path / "tokenizer.json"
    tokenizer.save(str(copy))
    again = tokens.load_tokenizer(copy)
    ids = again.encode(TEXT).ids
    assert ids == tokenizer.encode(TEXT).ids
    assert again.decode(ids) == TEXT
    assert again.get_vocab_size() == 300


def test_byte_lengths_add_up_to_the_utf8_bytes(bpe_file):
    tokenizer = tokens.load_tokenizer(bpe_file)
    lengths = tokens.token_byte_lengths(tokenizer)
    ids = tokenizer.encode(TEXT).ids
    assert lengths[ids].sum() == len(TEXT.encode("utf-8"))
    assert lengths[tokenizer.token_to_id(tokens.SPECIAL_TOKENS[0])] == len(tokens.SPECIAL_TOKENS[0])


def test_bpe_is_cached_by_content_hash(slice_bytes, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="bstrain"):
        first = tokens.bpe_tokenizer(slice_bytes, 280, tmp_path)
        mtime = first.stat().st_mtime_ns
        second = tokens.bpe_tokenizer(slice_bytes, 280, tmp_path)
    assert second == first and second.stat().st_mtime_ns == mtime
    assert sum("training a byte-level BPE" in r.message for r in caplog.records) == 1
    other_text = tokens.bpe_tokenizer(slice_bytes[:-1000], 280, tmp_path)
    other_size = tokens.bpe_tokenizer(slice_bytes, 290, tmp_path)
    assert len({first, other_text, other_size}) == 3


def test_token_splits_are_memmaps_of_the_tokenized_text(bpe_file, tmp_path):
    corpus = ByteCorpus(str(_text_file(tmp_path)), tokenizer=str(bpe_file), cache_dir=str(tmp_path / "cache"),
                        seq_len=8, batch_size=2)
    train, valid, test = corpus.splits()
    assert all(isinstance(s, np.memmap) and s.dtype == np.uint16 for s in (train, valid, test))
    text = (TEXT * 40).encode("utf-8")
    want = corpus.tokenizer.encode(text[:len(text) * 90 // 100].decode("utf-8", "replace")).ids
    assert train.tolist() == want
    batches = BpttBatches(train, 2, 8)
    stream = (len(train) - 1) // 2
    x, y = batches.batch(1)                               # (2, 8): rows are streams, window 1
    for row in range(2):
        start = row * stream + 8
        assert x[row].tolist() == want[start:start + 8] and y[row].tolist() == want[start + 1:start + 9]
    again = ByteCorpus(str(_text_file(tmp_path)), tokenizer=str(bpe_file), cache_dir=str(tmp_path / "cache"))
    assert again.splits()[0].filename == train.filename     # read from the cache, not tokenized again


def test_a_directory_corpus_is_spilled_file_by_file_and_mapped(bpe_file, tmp_path, monkeypatch):
    """A directory (or glob) of files is written split by split to the cache, file by file, and
    memory-mapped: the bytes never sit whole in memory, and the splits equal the in-memory read
    (whole files held out) before and after tokenizing."""
    from bstrain.data import text
    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(40):
        (folder / f"m{i}.py").write_text(TEXT * (i % 5 + 1), encoding="utf-8")
    in_memory = text.load_bytes(str(folder))
    monkeypatch.setattr(text, "_read_files", None)        # the tokenized path must not read them whole
    spilled = text.load_bytes(str(folder), mmap=True, spill=tmp_path / "cache")
    assert all(isinstance(s, np.memmap) for s in spilled)
    assert all(np.array_equal(a, b) for a, b in zip(in_memory, spilled))
    corpus = ByteCorpus(str(folder), tokenizer=str(bpe_file), cache_dir=str(tmp_path / "cache"), seq_len=8,
                        batch_size=2)
    for split, ids in zip(in_memory, corpus.splits()):
        assert isinstance(ids, np.memmap)
        assert ids.tolist() == corpus.tokenizer.encode(bytes(split).decode("utf-8")).ids


def test_text_chunks_cut_at_newlines_and_whole_characters():
    data = np.frombuffer(bytearray(("ééé✓✓" * 50 + "\n" + "x" * 30).encode("utf-8")), dtype=np.uint8)
    chunks = list(tokens.text_chunks(data, chunk_bytes=64))
    assert "".join(chunks).encode("utf-8") == bytes(data)
    assert all("\ufffd" not in c for c in chunks) and len(chunks) > 3


def _task(corpus) -> ByteLM:
    task = ByteLM()
    task.setup(corpus, World(), 0)
    return task


class _Tiny(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))         # (B, T, V)


@pytest.fixture
def token_corpus(bpe_file, tmp_path):
    return ByteCorpus(str(_text_file(tmp_path, 200)), tokenizer=str(bpe_file), cache_dir=str(tmp_path / "cache"),
                      seq_len=8, batch_size=2)


def test_bits_per_byte_equals_a_float64_hand_computation(token_corpus):
    torch.manual_seed(0)
    model, task = _Tiny(token_corpus.vocab_size), _task(token_corpus)
    res = task.evaluate(Forward(model, None, torch.device("cpu")), "valid", max_batches=3)
    batches = BpttBatches(token_corpus.splits()[1], 2, 8)
    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for i in range(3):
            x, y = batches.batch(i)
            logp = torch.log_softmax(model(x).double(), dim=-1)
            nats -= logp.gather(-1, y[..., None]).sum().item()
            n_bytes += int(token_corpus.byte_lengths[y.numpy()].sum())
    assert res["batches"] == 3
    assert res["bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-6)
    assert res["loss_per_token"] == pytest.approx(nats / (3 * 2 * 8), rel=1e-6)


def test_a_uniform_model_has_log2_vocab_bits_per_token(token_corpus):
    vocab, task = token_corpus.vocab_size, _task(token_corpus)
    uniform = lambda x, state=None: (torch.zeros(*x.shape, vocab), None)      # noqa: E731
    uniform.device = torch.device("cpu")
    res = task.evaluate(uniform, "valid", max_batches=2)
    y = np.concatenate([BpttBatches(token_corpus.splits()[1], 2, 8).batch(i)[1].numpy().ravel() for i in range(2)])
    n_bytes = token_corpus.byte_lengths[y].sum()
    assert res["bpb"] == pytest.approx(math.log2(vocab) * len(y) / n_bytes, rel=1e-6)


def test_the_hf_model_output_logits_are_read(token_corpus):
    """A model returning a ModelOutput-like object with .logits trains through the same loss."""
    class Output:
        def __init__(self, logits):
            self.logits = logits
    task, logits = _task(token_corpus), torch.randn(2, 8, token_corpus.vocab_size)
    y = torch.randint(0, token_corpus.vocab_size, (2, 8))
    assert torch.equal(task.loss(Output(logits), y), task.loss(logits, y))


def test_a_tokenizer_file_that_does_not_parse(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": 3}')
    corpus = ByteCorpus(str(_text_file(tmp_path)), tokenizer=str(bad), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"^data.tokenizer: '.*tokenizer.json' is not a Hugging Face tokenizer.json "
                                        r"\(.*\); give a tokenizer.json") as info:
        corpus.splits()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("vocab", [None, 100, 256], ids=["none", "v100", "v256"])
def test_a_bpe_vocabulary_below_the_bytes_and_specials(vocab):
    with pytest.raises(DataError, match=rf"^data.vocab_size={vocab}: a byte-level BPE needs at least 257 tokens .*"
                                        rf"set data.vocab_size=257 or more"):
        ByteCorpus(tokenizer="bpe", vocab_size=vocab)


def test_a_vocab_size_without_a_tokenizer():
    with pytest.raises(DataError, match=r"data.vocab_size=512 needs a tokenizer .* data.tokenizer=bpe"):
        ByteCorpus(vocab_size=512)


def test_the_model_vocabulary_below_the_tokenizers(token_corpus):
    task = _task(token_corpus)
    with pytest.raises(UserError, match=r"^model.config.vocab_size=64 is smaller than the vocabulary of "
                                         r"data.tokenizer=.* \(300 tokens\): set model.config.vocab_size to at least 300"):
        task.check_model_config({"config": {"vocab_size": 64}})
    task.check_model_config({"config": {"vocab_size": 512}})           # a larger embedding is fine
