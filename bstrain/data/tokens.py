"""Tokenized text: a Hugging Face ``tokenizers`` tokenizer and each split tokenized once into a flat,
memory-mapped ``.bin`` file of token ids.

The tokenizer is a ``tokenizer.json`` file, or a byte-level BPE trained here on the training split
(``data.tokenizer=bpe``, ``data.vocab_size=N``). Both the trained tokenizer and the token files are
cached by content hash in the cache directory (``data.cache_dir``; else ``$BSTRAIN_CACHE``; else
``$XDG_CACHE_HOME/bstrain``, i.e. ``~/.cache/bstrain``):

- ``bpe-<vocab>-<key>.json``: key = sha256 of the training split's bytes and the BPE settings;
- ``tokens-<key>.<dtype>.bin``: key = sha256 of the split's bytes, the tokenizer file's bytes and
  the chunking; uint16 ids for vocabularies up to 65,536, else uint32.

A cached file is read, never rebuilt; files are written under a temporary name and renamed, so a
run stopped half-way (or two processes writing the same entry) leaves no partial file behind.
Tokenizing reads the split in chunks of about :data:`CHUNK_BYTES`, cut after a newline, and writes
the ids as it goes: the corpus is never one Python string, and training reads windows straight
from the memory map.

Bits per byte need the bytes each token stands for: :func:`token_byte_lengths` gives them exactly
for byte-level tokenizers (each character of a byte-level token is one byte); see its docstring for
the others.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from bstrain.errors import DataError
from bstrain.errors import UserError

__all__ = ["check_tokenizer", "BPE", "SPECIAL_TOKENS", "MIN_BPE_VOCAB", "CHUNK_BYTES", "cache_dir", "content_hash", "text_chunks",
           "bpe_tokenizer", "load_tokenizer", "token_byte_lengths", "tokenize_split", "tokenize_splits"]

log = logging.getLogger("bstrain")

BPE = "bpe"
SPECIAL_TOKENS = ("<|endoftext|>",)
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)   # every byte, and the special tokens
CHUNK_BYTES = 1 << 20
_FORMAT = 1          # bump when how text is cut or tokenized changes: older cache entries are then not read
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def check_tokenizer(tokenizer, vocab_size) -> str | None:
    """data.tokenizer, with data.vocab_size checked against it; DataError naming the key to fix."""
    if tokenizer is None:
        if vocab_size is not None and vocab_size != 256:
            raise DataError(f"data.vocab_size={vocab_size} needs a tokenizer (bytes have 256 values): set "
                            f"data.tokenizer={BPE} or a tokenizer.json path, or data.vocab_size=null")
        return None
    if not isinstance(tokenizer, str) or not tokenizer.strip():
        raise DataError(f"data.tokenizer: expected null, {BPE} or a tokenizer.json path, got {tokenizer!r}")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
        raise DataError(f"data.vocab_size: expected an int, got {vocab_size!r}")
    if tokenizer == BPE and (vocab_size is None or vocab_size < MIN_BPE_VOCAB):
        raise DataError(f"data.vocab_size={vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens (256 "
                        f"bytes + the special tokens); set data.vocab_size={MIN_BPE_VOCAB} or more, e.g. 4096")
    return tokenizer


def _check_file_vocab(tokenizer: str, requested: int | None, vocab: int) -> None:
    if tokenizer != BPE and requested is not None and requested != vocab:
        raise DataError(f"data.vocab_size={requested}, but data.tokenizer={tokenizer} has {vocab} tokens: set "
                        f"data.vocab_size={vocab} or null")



def cache_dir(path: str | None = None) -> Path:
    """``path`` (data.cache_dir), else ``$BSTRAIN_CACHE``, else ``$XDG_CACHE_HOME/bstrain`` (``~/.cache/bstrain``)."""
    if path:
        return Path(os.path.expanduser(str(path)))
    if os.environ.get("BSTRAIN_CACHE"):
        return Path(os.path.expanduser(os.environ["BSTRAIN_CACHE"]))
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bstrain"


def content_hash(data: np.ndarray | bytes) -> str:
    """sha256 (hex) of a byte array, read in chunks (a memory map is not read whole)."""
    h = hashlib.sha256()
    for start in range(0, len(data), CHUNK_BYTES):
        h.update(memoryview(np.ascontiguousarray(data[start:start + CHUNK_BYTES])))
    return h.hexdigest()


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def text_chunks(data: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """(n,) uint8 text as str pieces of at most ``chunk_bytes`` bytes, each cut after its last newline
    (else before a UTF-8 character that would be split), decoded with errors="replace"."""
    start, n = 0, len(data)
    while start < n:
        end = min(start + chunk_bytes, n)
        piece = bytes(data[start:end])
        cut = len(piece)
        if end < n and b"\n" in piece:
            cut = piece.rfind(b"\n") + 1
        elif end < n:                                 # no newline: back to the start of a character
            while cut > 1 and (int(data[start + cut]) & 0xC0) == 0x80:
                cut -= 1
        yield piece[:cut].decode("utf-8", errors="replace")
        start += cut


def _write_atomic(path: Path, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, then renamed onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("data.tokenizer: tokenized text needs Hugging Face tokenizers: pip install tokenizers "
                        "(or data.tokenizer=null for bytes)") from None
    return tokenizers


def bpe_tokenizer(train: np.ndarray, vocab_size: int, directory: Path, train_hash: str | None = None) -> Path:
    """The path of a byte-level BPE of ``vocab_size`` tokens trained on ``train`` ((n,) uint8), from
    the cache when one was trained on the same bytes with the same settings.

    Byte-level: GPT-2's pre-tokenizer and decoder, every byte in the initial alphabet (no unknown
    token), :data:`SPECIAL_TOKENS` first, pairs seen at least twice merged.
    """
    settings = json.dumps({"kind": "byte-level bpe", "vocab_size": vocab_size, "special_tokens": SPECIAL_TOKENS,
                           "min_frequency": 2, "format": _FORMAT}, sort_keys=True)
    path = directory / f"bpe-{vocab_size}-{_key(train_hash or content_hash(train), settings)}.json"
    if path.exists():
        return path
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    log.info("data: training a byte-level BPE of %d tokens on %s bytes (cached in %s)", vocab_size,
             f"{len(train):,}", directory)
    tokenizer.train_from_iterator(text_chunks(train), trainer=trainer)
    _write_atomic(path, lambda f: f.write(tokenizer.to_str().encode("utf-8")))
    return path


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json; a DataError line naming data.tokenizer otherwise."""
    tk = _tokenizers()
    file = Path(os.path.expanduser(str(path)))
    if not file.is_file():
        raise DataError(f"data.tokenizer: no file {str(path)!r}; expected the path of a Hugging Face tokenizer.json, "
                        f"or data.tokenizer={BPE} with data.vocab_size=N to train a byte-level BPE")
    try:
        return tk.Tokenizer.from_file(str(file))
    except Exception as exc:                 # tokenizers raises a bare Exception for JSON it cannot read
        reason = " ".join(str(exc).split())[:200]
        raise DataError(f"data.tokenizer: {str(path)!r} is not a Hugging Face tokenizer.json ({reason}); give a "
                        f"tokenizer.json that tokenizers.Tokenizer.from_file reads, or data.tokenizer={BPE}") from None


def token_byte_lengths(tokenizer) -> np.ndarray:
    """(V,) int64: the UTF-8 bytes each token id stands for, V = the largest id + 1.

    Exact for byte-level tokenizers (a ``ByteLevel`` decoder: each character of a token is one byte)
    and for added tokens (their content's bytes). Otherwise: a byte-fallback token ``<0xNN>`` is one
    byte; any other token its text's UTF-8 bytes, with SentencePiece's "▁" read as a space.
    :func:`tokenize_split` warns when these lengths do not add up to a split's bytes.
    """
    spec = json.loads(tokenizer.to_str())
    byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
    added = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    for token, i in vocab.items():
        if i in added:
            lengths[i] = len(added[i].encode("utf-8"))
        elif byte_level:
            lengths[i] = len(token)
        elif _BYTE_FALLBACK.fullmatch(token):
            lengths[i] = 1
        else:
            lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths


def _id_dtype(vocab: int) -> type:
    """The narrowest unsigned dtype for ids below ``vocab``: uint16 up to 65,536 tokens, else uint32."""
    return np.uint16 if vocab <= 1 << 16 else np.uint32


def _open(path: Path, dtype) -> np.ndarray:
    """The token file as a read-only memory map ((n,) ``dtype``); an empty array for an empty file
    (numpy cannot map zero bytes)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def tokenize_split(data: np.ndarray, tokenizer, path: Path, lengths: np.ndarray, name: str = "split") -> np.ndarray:
    """``data`` ((n,) uint8) tokenized chunk by chunk into ``path`` (read from it when it exists);
    returns the ids as a read-only np.memmap ((m,) uint16 or uint32, by the vocabulary's size)."""
    dtype = _id_dtype(len(lengths))
    if path.exists():
        return _open(path, dtype)
    counted = 0

    def write(f):
        nonlocal counted
        chunks = text_chunks(data)
        while batch := list(itertools.islice(chunks, 8)):     # a few chunks at a time: tokenizers runs them in parallel
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(encoding.ids, dtype=dtype)
                counted += int(lengths[ids].sum())
                ids.tofile(f)
    log.info("data: tokenizing the %s split (%s bytes) into %s", name, f"{len(data):,}", path)
    _write_atomic(path, write)
    if counted != len(data):
        log.warning("data: the %s split's tokens stand for %s bytes by the tokenizer's per-token lengths, but the "
                    "text has %s (a lossy tokenizer or text that is not UTF-8): bits per byte count the former",
                    name, f"{counted:,}", f"{len(data):,}")
    return _open(path, dtype)


def tokenize_splits(splits: tuple[np.ndarray, ...], tokenizer: str, vocab_size: int | None,
                    directory: Path) -> tuple:
    """(tokenizer, its file, (train, valid, test) memory-mapped ids, (V,) bytes per token id) for
    byte splits; ``tokenizer`` is a tokenizer.json path or :data:`BPE` (trained on the train split)."""
    hashes = [content_hash(s) for s in splits]
    file = bpe_tokenizer(splits[0], vocab_size, directory, hashes[0]) if tokenizer == BPE else Path(
        os.path.expanduser(tokenizer))
    loaded = load_tokenizer(file)
    lengths = token_byte_lengths(loaded)
    _check_file_vocab(tokenizer, vocab_size, len(lengths))
    tokenizer_hash = content_hash(file.read_bytes())
    ids = []
    for name, split, split_hash in zip(("train", "valid", "test"), splits, hashes):
        key = _key(split_hash, tokenizer_hash, str(CHUNK_BYTES), str(_FORMAT))
        dtype = np.dtype(_id_dtype(len(lengths))).name
        ids.append(tokenize_split(split, loaded, directory / f"tokens-{key}.{dtype}.bin", lengths, name))
    return loaded, file, tuple(ids), lengths
