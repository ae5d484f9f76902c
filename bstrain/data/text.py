"""Text data: corpora, train/valid/test splits and contiguous BPTT batches.

Every corpus is read as raw bytes (vocabulary 256), the usual setting for enwik8 / text8
character-level language models; with ``data.tokenizer`` set, each split is then tokenized into
memory-mapped token ids (bstrain/data/tokens.py). With no path, the running Python's own
standard-library sources serve as a small, real, offline corpus (see ``default_corpus``).
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import shutil
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bstrain.errors import DataError

__all__ = [
    "DataError", "DEFAULT_CORPUS_BYTES", "default_corpus", "load_bytes", "check_size", "BpttBatches",
    "ByteCorpus", "bits_per_byte",
]

DEFAULT_CORPUS_BYTES = 4 << 20
NAMES = ("auto", "bytes", "enwik8", "text8")
# The standard Hutter-prize split: the files are 100M bytes; 90M train, 5M valid, 5M test.
_STANDARD_CUTS = (90_000_000, 95_000_000, 100_000_000)
_DEFAULT_CORPUS_LABEL = "the embedded default corpus"


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, recursive: bool = False) -> bytes:
    """Real text that ships without a download: this Python's own standard-library sources.

    The file list is ``sorted(Path(sysconfig.get_paths()['stdlib']).glob('*.py'))`` (top level
    only, no packages), each read as bytes and concatenated in that order, then truncated to
    ``max_bytes``. The result is deterministic for a given Python build; CPython 3.x's top level
    holds about 4-5 MB of source, so the default 4 MiB is usually filled completely.

    Args:
        max_bytes: upper bound on the returned length (> 0).
        recursive: every *.py below the stdlib directory (``rglob``, sorted), not just the top
            level: a larger cut for GPU-sized runs (scripts/bench/bench_lstm.py).
    Returns: the corpus, ``len <= max_bytes``.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for source in sorted(stdlib.rglob("*.py") if recursive else stdlib.glob("*.py")):
        if total >= max_bytes:
            break
        chunk = source.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        # Some embedded Pythons ship the stdlib zipped or as .pyc only.
        raise DataError(f"{_DEFAULT_CORPUS_LABEL} is empty: no *.py sources under {stdlib}; pass a data path")
    return b"".join(chunks)


def _auto_name(path: Path) -> str:
    """The corpus a file name implies: 'enwik8', 'text8' or 'bytes'."""
    for name in ("enwik8", "text8"):
        if path.name in (name, name + ".zip"):
            return name
    return "bytes"


def _read_file(path: Path, name: str, mmap: bool = False) -> np.ndarray:
    """All bytes of ``path`` as a writable (n,) uint8 array (mmap: a read-only memory map, so that a
    file larger than RAM can be tokenized); a .zip of enwik8/text8 is unpacked."""
    if name in ("enwik8", "text8") and path.suffix == ".zip":
        try:
            with zipfile.ZipFile(path) as archive:
                members = archive.namelist()
                if name not in members:
                    raise DataError(f"data path '{path}': expected a zip member named '{name}', "
                                    f"got {members[:5]}{' ...' if len(members) > 5 else ''}")
                raw = archive.read(name)
        except zipfile.BadZipFile as err:
            raise DataError(f"data path '{path}': expected a zip archive, got an unreadable one ({err})") from None
        # bytearray: torch.from_numpy warns on the read-only buffer that plain bytes would give.
        return np.frombuffer(bytearray(raw), dtype=np.uint8)
    if mmap and path.stat().st_size > 0:          # (numpy cannot map an empty file)
        return np.memmap(path, dtype=np.uint8, mode="r")
    return np.fromfile(path, dtype=np.uint8)


def _split(data: np.ndarray, cuts: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous views data[:a], data[a:b], data[b:c] for cuts (a, b, c)."""
    a, b, c = cuts
    return data[:a], data[a:b], data[b:c]


def _proportional_cuts(n: int) -> tuple[int, int, int]:
    """90/5/5 cut points for n bytes; the test split takes the rounding remainder."""
    n_train, n_valid = n * 90 // 100, n * 5 // 100
    return n_train, n_train + n_valid, n


_GLOB_CHARS = set("*?[")


def _expand(path: str) -> tuple[list[Path], Path]:
    """The files a data path names, in sorted order, and the root their split hash is taken from.

    A file names itself; a directory every file below it (hidden files and directories skipped);
    a glob (``*``, ``?``, ``[``; ``**`` recurses) every file it matches.
    """
    text = os.path.expanduser(str(path))
    if _GLOB_CHARS & set(text) and not os.path.exists(text):     # an existing name like a[1].txt is itself
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        prefix = text[:min(text.index(c) for c in _GLOB_CHARS if c in text)]
        root = Path(prefix if prefix.endswith(os.sep) else os.path.dirname(prefix) or ".")
        if not files:
            raise DataError(f"data path '{path}': the glob matches no file")
        return files, root
    file = Path(text)
    if not file.exists():
        raise DataError(f"data path '{path}' does not exist")
    if file.is_dir():
        files = sorted(p for p in file.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(file).parts))
        if not files:
            raise DataError(f"data path '{path}' is a directory without files")
        return files, file
    return [file], file.parent


def _file_split(rel: str) -> int:
    """0 (train), 1 (valid) or 2 (test) for a file, from a hash of its path: 90/5/5 of the files."""
    u = int.from_bytes(hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()[:8], "little") / 2.0**64
    return 0 if u < 0.90 else 1 if u < 0.95 else 2


def _chunks(files: list[Path], root: Path, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(split, bytes) of each file in sorted path order, until ``max_bytes`` (0: all); whole files
    held out: each file goes to train, valid or test by :func:`_file_split`."""
    total = 0
    for f in files:
        if max_bytes and total >= max_bytes:
            return
        chunk = f.read_bytes()
        if max_bytes:
            chunk = chunk[: max_bytes - total]
        total += len(chunk)
        yield _file_split(f.relative_to(root).as_posix() if f.is_relative_to(root) else str(f)), chunk


def _read_files(files: list[Path], root: Path, max_bytes: int, path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each split is its files concatenated (:func:`_chunks`), in memory."""
    parts: tuple[list, list, list] = ([], [], [])
    for split, chunk in _chunks(files, root, max_bytes):
        parts[split].append(chunk)
    if not any(c for p in parts for c in p):
        raise DataError(f"data path '{path}' is empty")
    if not all(parts):                      # too few files to hold out whole ones: split the bytes
        data = np.frombuffer(bytearray(b"".join(c for p in parts for c in p)), dtype=np.uint8)
        return _split(data, _proportional_cuts(len(data)))
    return tuple(np.frombuffer(bytearray(b"".join(p)), dtype=np.uint8) for p in parts)


def _spill_files(files: list[Path], root: Path, max_bytes: int, path, spill: Path) -> tuple[np.ndarray, ...]:
    """:func:`_read_files` through files on disk: each split written to ``spill`` file by file and
    memory-mapped (a corpus larger than memory), kept under a key of the files' names, sizes and
    modification times (a second run maps them again)."""
    listing = "\n".join(f"{f}\t{f.stat().st_size}\t{f.stat().st_mtime_ns}" for f in files) + f"\n{max_bytes}"
    folder = Path(spill) / f"corpus-{hashlib.sha256(listing.encode('utf-8', 'surrogateescape')).hexdigest()[:24]}"
    names = [folder / f"{split}.bin" for split in ("train", "valid", "test")]
    if not folder.is_dir():
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        outs = [open(tmp / n.name, "wb") for n in names]
        try:
            for split, chunk in _chunks(files, root, max_bytes):
                outs[split].write(chunk)
        finally:
            for out in outs:
                out.close()
        try:
            os.replace(tmp, folder)
        except OSError:                     # another process (a rank) wrote it first: the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
    sizes = [n.stat().st_size for n in names]
    if sum(sizes) == 0:
        raise DataError(f"data path '{path}' is empty")
    if not all(sizes):                      # too few files to hold out whole ones: split the bytes
        whole = folder / "all.bin"
        if not whole.exists():
            with open(f"{whole}.tmp-{os.getpid()}", "wb") as out:
                for n in names:
                    with open(n, "rb") as f:
                        shutil.copyfileobj(f, out)
            os.replace(f"{whole}.tmp-{os.getpid()}", whole)
        data = np.memmap(whole, dtype=np.uint8, mode="r")
        return _split(data, _proportional_cuts(len(data)))
    return tuple(np.memmap(n, dtype=np.uint8, mode="r") for n in names)


def load_bytes(path: str | None, name: str = "auto", max_bytes: int = 0,
               mmap: bool = False, spill: Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load a corpus as bytes and split it into train / valid / test parts.

    Args:
        path: a file, a directory, a glob, or None / "" for ``default_corpus()``.
            - A directory means every file below it (hidden ones skipped); a glob (``*``, ``?``,
              ``[``; ``**`` recurses, e.g. ``src/**/*.py``) every file it matches. The files
              are read in sorted path order and **whole files are held out**: a hash of each
              file's path relative to the directory (or the glob's fixed prefix) puts 90% of the
              files in train, 5% in valid and 5% in test, so a split never sees part of a file
              another holds, and adding files does not move the others. With too few files for
              every split to get one, the concatenation is cut 90/5/5 instead.
            - One file: contiguous 90/5/5 byte ranges, or the standard split for enwik8/text8.
        name: "auto" | "bytes" | "enwik8" | "text8". "auto" means enwik8 for a file named
            ``enwik8`` or ``enwik8.zip``, text8 for ``text8`` or ``text8.zip``, else bytes.
            - enwik8 / text8: the standard split, first 90M bytes train, next 5M valid, next 5M
              test. A ``.zip`` must hold one member named ``enwik8`` (``text8``). A file shorter
              than the real 100M bytes (a test fixture, a truncated copy) falls back to the
              proportional 90/5/5 split; bytes past the first 100M are ignored.
            - bytes: any text or binary file, read raw (a .zip is not unpacked), split 90/5/5.
        max_bytes: read at most this many bytes in all (0: no limit).
        mmap: one plain file is memory-mapped (read-only) instead of read.
        spill: with ``mmap``, a directory or a glob is written split by split into this folder,
            file by file, and memory-mapped (without it, it is read into memory).
    Returns: (train, valid, test), (n_train,), (n_valid,), (n_test,) uint8 arrays.
    Raises:
        DataError: path does not exist, matches nothing, or is empty.
        ValueError: unknown name, negative max_bytes.
    """
    if name not in NAMES:
        raise ValueError(f"name: expected one of {', '.join(map(repr, NAMES))}, got {name!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes: expected an int >= 0 (0: no limit), got {max_bytes!r}")
    if not path:
        corpus = np.frombuffer(bytearray(default_corpus(max_bytes or DEFAULT_CORPUS_BYTES)), dtype=np.uint8)
        return _split(corpus, _proportional_cuts(len(corpus)))
    files, root = _expand(path)
    if len(files) > 1 or files[0] != Path(os.path.expanduser(str(path))):
        if mmap and spill is not None:
            return _spill_files(files, root, max_bytes, path, spill)
        return _read_files(files, root, max_bytes, path)
    file = files[0]
    if name == "auto":
        name = _auto_name(file)
    data = _read_file(file, name, mmap)  # (n,) uint8
    if max_bytes:
        data = data[:max_bytes]
    if len(data) == 0:
        raise DataError(f"data path '{path}' is empty")
    standard = name in ("enwik8", "text8") and len(data) >= _STANDARD_CUTS[-1]
    return _split(data, _STANDARD_CUTS if standard else _proportional_cuts(len(data)))


def check_size(split: np.ndarray, batch_size: int, seq_len: int, path: str | None, split_name: str,
               ranks: int = 1, unit: str = "bytes") -> None:
    """Raise DataError unless ``split`` can fill one (batch_size x ranks, seq_len) batch.

    One batch needs batch_size * ranks * seq_len input bytes (``unit``) plus one more for the last target.
    """
    need = batch_size * ranks * seq_len + 1
    if len(split) < need:
        where = f"data path '{path}'" if path else _DEFAULT_CORPUS_LABEL
        per = f"batch_size {batch_size} x {ranks} ranks" if ranks > 1 else f"batch_size {batch_size}"
        raise DataError(f"{where}: the {split_name} split has {len(split)} {unit}, but {per} "
                        f"x seq_len {seq_len} needs at least {need}")


class ByteCorpus:
    """The ``data`` config of language modelling: where the text comes from, its tokens, the batch shape.

    Args:
        path, name, max_bytes: as for :func:`load_bytes` (path None: the embedded corpus).
        seq_len: T, tokens (bytes by default) per sequence (the BPTT length, and the context of
            stateless models).
        batch_size: B, sequences per batch on each process.
        tokenizer: None: bytes (vocabulary 256); a tokenizer.json path (Hugging Face tokenizers); or
            "bpe": a byte-level BPE of ``vocab_size`` tokens trained on the train split. The splits
            are then memory-mapped token ids, cached in ``cache_dir`` (bstrain/data/tokens.py).
        vocab_size: with "bpe", its vocabulary (>= 256 + the special tokens); with a file, None or the
            file's vocabulary. The model's vocabulary is this (``${data.vocab_size}``) or larger.
        cache_dir: where trained tokenizers and token files are kept (None: $BSTRAIN_CACHE, else
            ~/.cache/bstrain).
    """

    def __init__(self, path: str | None = None, name: str = "auto", seq_len: int = 64, batch_size: int = 32,
                 max_bytes: int = 0, tokenizer: str | None = None, vocab_size: int | None = None,
                 cache_dir: str | None = None):
        name = getattr(name, "value", name)
        if name not in NAMES:
            raise DataError(f"data.name: expected one of {', '.join(NAMES)}, got {name!r}")
        for key, value in (("data.seq_len", seq_len), ("data.batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{key}: expected an int >= 1, got {value!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise DataError(f"data.max_bytes: expected an int >= 0 (0: no limit), got {max_bytes!r}")
        if name in ("enwik8", "text8") and not path:
            raise DataError(f"data.path: data.name={name} needs the path of {name} or {name}.zip (the embedded "
                            f"corpus is not {name}); add data.path=...")
        self.path, self.name, self.max_bytes = path, name, max_bytes
        self.seq_len, self.batch_size = seq_len, batch_size
        from bstrain.data.tokens import check_tokenizer
        self.tokenizer_name, self.cache_dir = check_tokenizer(tokenizer, vocab_size), cache_dir
        self.requested_vocab = vocab_size
        self.tokenizer = None              # the tokenizers.Tokenizer, once the splits are read
        self.byte_lengths = None           # (V,) int64 bytes per token id; None for bytes
        self._splits = None

    @property
    def unit(self) -> str:
        return "bytes" if self.tokenizer_name is None else "tokens"

    @property
    def vocab_size(self) -> int:
        """The ids the splits hold: 256 bytes, or the tokenizer's vocabulary (largest id + 1)."""
        if self.tokenizer_name is None:
            return 256
        self.splits()
        return len(self.byte_lengths)

    def splits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(train, valid, test): uint8 bytes, or memory-mapped uint16/uint32 token ids; read once."""
        if self._splits is None:
            if self.tokenizer_name is None:
                self._splits = load_bytes(self.path, self.name, self.max_bytes)
            else:                           # a corpus larger than memory: mapped, then tokenized in chunks
                from bstrain.data import tokens
                folder = tokens.cache_dir(self.cache_dir)
                splits = load_bytes(self.path, self.name, self.max_bytes, mmap=True, spill=folder)
                self.tokenizer, _, self._splits, self.byte_lengths = tokens.tokenize_splits(
                    splits, self.tokenizer_name, self.requested_vocab, folder)
        return self._splits

    def describe(self) -> str:
        train, valid, test = self.splits()
        where = self.path or _DEFAULT_CORPUS_LABEL
        tokens = "" if self.tokenizer_name is None else f" of {self.tokenizer_name} ({self.vocab_size:,} ids)"
        return f"{where}: {len(train):,} / {len(valid):,} / {len(test):,} {self.unit}{tokens} (train / valid / test)"


def bits_per_byte(mean_nll_nats: float) -> float:
    """Convert a mean per-byte negative log-likelihood from nats to bits (the enwik8 metric)."""
    return mean_nll_nats / math.log(2)


_ID_DTYPES = (np.uint8, np.uint16, np.uint32)


def _long(ids) -> torch.Tensor:
    """int64 of a tensor of bytes or of a numpy window of a token memory map (read here, once)."""
    return ids.long() if isinstance(ids, torch.Tensor) else torch.from_numpy(ids.astype(np.int64))


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


class BpttBatches:
    """Contiguous BPTT batches over one split, for RNNs that carry hidden state between batches.

    The split (n bytes) is cut into batch_size equal contiguous streams of L = (n - 1) // batch_size
    inputs each (the remainder is dropped), like the classic char-rnn ``batchify``; stream b's
    inputs are data[b*L : (b+1)*L] and its targets are the same shifted by one byte. Batch i holds
    x = streams[:, i*T:(i+1)*T] and y = the next byte of each position, so row b of batch i+1
    continues row b of batch i and a carried hidden state stays valid. The tail of each stream that
    cannot fill a whole batch (L % T inputs) is dropped.

    Args:
        data: (n,) uint8 array (bytes), or uint16 / uint32 token ids (a memory map: each batch is read
            from it, the split never copied whole); n >= batch_size * world * seq_len + 1.
        batch_size: B, number of parallel streams (of this rank).
        seq_len: T, time steps per batch (the truncated-BPTT length).
        rank, world: this process's rank and the number of processes. The split is cut into
            B * world streams and rank r takes rows [r*B, (r+1)*B), so training on W ranks of
            batch B sees exactly the batches of one process with batch W*B.
    """

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, rank: int = 0, world: int = 1):
        if not isinstance(data, np.ndarray) or data.dtype not in _ID_DTYPES or data.ndim != 1:
            got = f"{data.ndim}-D {data.dtype} array" if isinstance(data, np.ndarray) else type(data).__name__
            raise TypeError(f"data: expected a 1-D uint8, uint16 or uint32 numpy array, got {got}")
        self.batch_size = _check_positive_int("batch_size", batch_size)
        self.seq_len = _check_positive_int("seq_len", seq_len)
        world = _check_positive_int("world", world)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank: expected an int in [0, {world}), got {rank!r}")
        streams = batch_size * world
        need = streams * seq_len + 1
        if len(data) < need:
            raise DataError(f"data: expected at least batch_size {batch_size} x {world} rank(s) x seq_len {seq_len} "
                            f"+ 1 = {need} bytes, got {len(data)}" if world > 1 else
                            f"data: expected at least batch_size {batch_size} x seq_len {seq_len} + 1 = {need} "
                            f"bytes, got {len(data)}")
        # Keep uint8 (1 byte per char): int64 would take 8x the memory on a 90M-byte split.
        # np.require copies only when data is read-only, which torch.from_numpy would warn about.
        # Token ids stay numpy (a read-only memory map): each batch is read from it and converted.
        flat = torch.from_numpy(np.require(data, requirements=["C", "W"])) if data.dtype == np.uint8 else data
        stream_len = (len(data) - 1) // streams
        # Two views of the same buffer; the targets start one byte later, which is why one byte
        # beyond the last input must exist (the "+ 1" in check_size). Rank r takes streams
        # [r*B, (r+1)*B) of the world's B*world: the same bytes, in the same rows, as one process
        # with batch B*world.
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        self._inputs = flat[: streams * stream_len].reshape(streams, stream_len)[rows]        # (B, L)
        self._targets = flat[1: streams * stream_len + 1].reshape(streams, stream_len)[rows]  # (B, L)
        self._num_batches = stream_len // seq_len
        self.position = 0

    def __len__(self) -> int:
        """Number of full (B, T) batches per epoch."""
        return self._num_batches

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``i % len(self)``: (x, y), both (batch_size, seq_len) int64, y[:, t] follows x[:, t]."""
        start = (i % self._num_batches) * self.seq_len
        window = slice(start, start + self.seq_len)
        return _long(self._inputs[:, window]), _long(self._targets[:, window])  # (B, T), (B, T)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Return (x, y, wrapped) for batch ``position`` and advance ``position``.

        wrapped is True when the returned batch is batch 0, i.e. it starts an epoch (the very first
        call included): its rows do not continue the previous batch, so the caller resets its
        hidden state.
        """
        i = self.position % self._num_batches
        x, y = self.batch(i)
        self.position = (i + 1) % self._num_batches
        return x, y, i == 0

    def state_dict(self) -> dict:
        """{"position": int, "batches": int}: enough to resume mid-epoch on the same split and batch shape."""
        return {"position": self.position, "batches": self._num_batches}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``position``; it must index a batch of this split (a mismatch means other data)."""
        position = state.get("position") if isinstance(state, dict) else None
        saved = state.get("batches") if isinstance(state, dict) else None
        if isinstance(position, int) and isinstance(saved, int) and saved != self._num_batches and saved > 0:
            position = position * self._num_batches // saved      # another batch shape: the same fraction
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < self._num_batches:
            raise ValueError(f"state['position']: expected an int in [0, {self._num_batches}), got {position!r}")
        self.position = position
