"""bstrain.data.text: default corpus, enwik8/text8 naming and splits, size errors, BPTT batches."""
from __future__ import annotations

import math
import re
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bstrain.data import (
    DEFAULT_CORPUS_BYTES, BpttBatches, DataError, bits_per_byte, check_size, default_corpus, load_bytes,
)

# A real text file every Python has (the tinyshakespeare copy beside the repository is not in it).
REAL_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"


def _lengths(splits) -> tuple[int, int, int]:
    return tuple(len(s) for s in splits)


# --- default corpus --------------------------------------------------------------------------------
def test_default_corpus_is_deterministic_real_text():
    a, b = default_corpus(), default_corpus()
    assert a == b
    assert 0 < len(a) <= DEFAULT_CORPUS_BYTES
    assert b"def " in a and b"import " in a


@pytest.mark.parametrize("max_bytes", [1, 1000, 123_457], ids=["1B", "1KB", "odd"])
def test_default_corpus_respects_max_bytes(max_bytes):
    small = default_corpus(max_bytes)
    assert len(small) == max_bytes
    assert default_corpus().startswith(small)


def test_recursive_corpus_reaches_into_packages():
    """recursive=True reads every *.py below the stdlib in sorted order: more text than the top level."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.rglob("*.py"))
    first = files[0].read_bytes()
    big = default_corpus(len(first) + 5000, recursive=True)
    assert big.startswith(first) and len(big) == len(first) + 5000
    assert len(default_corpus(1 << 30, recursive=True)) > len(default_corpus(1 << 30))


def test_default_corpus_rejects_bad_max_bytes():
    with pytest.raises(ValueError, match=r"max_bytes: expected a positive int, got 0"):
        default_corpus(0)


@pytest.mark.parametrize("path", [None, ""], ids=["none", "empty-string"])
def test_load_default_splits_90_5_5(path):
    train, valid, test = load_bytes(path)
    n = len(default_corpus())
    assert _lengths((train, valid, test)) == (n * 90 // 100, n * 5 // 100, n - n * 90 // 100 - n * 5 // 100)
    assert train.dtype == np.uint8
    assert np.concatenate([train, valid, test]).tobytes() == default_corpus()


# --- files, names and splits -----------------------------------------------------------------------
def test_bytes_file_contiguous_split(tmp_path):
    data = bytes(range(256)) * 4  # 1024 bytes
    path = tmp_path / "corpus.bin"
    path.write_bytes(data)
    train, valid, test = load_bytes(str(path))
    assert _lengths((train, valid, test)) == (921, 51, 52)
    assert train.tobytes() + valid.tobytes() + test.tobytes() == data


@pytest.mark.parametrize("name", ["enwik8", "text8"])
@pytest.mark.parametrize("zipped", [False, True], ids=["raw", "zip"])
def test_named_corpus_small_file_falls_back_to_proportional(tmp_path, name, zipped):
    data = (b"the quick brown fox jumps over the lazy dog " * 50)[:2000]
    if zipped:
        path = tmp_path / f"{name}.zip"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(name, data)
    else:
        path = tmp_path / name
        path.write_bytes(data)
    train, valid, test = load_bytes(str(path))  # "auto" recognises the file name
    assert _lengths((train, valid, test)) == (1800, 100, 100)
    assert train.tobytes() + valid.tobytes() + test.tobytes() == data
    assert train.flags.writeable  # so torch.from_numpy does not warn


def test_auto_reads_other_zip_as_raw_bytes(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("enwik8", b"x" * 100)
    raw = path.read_bytes()
    assert b"".join(s.tobytes() for s in load_bytes(str(path))) == raw
    # Naming the corpus explicitly unpacks it.
    assert sum(_lengths(load_bytes(str(path), name="enwik8"))) == 100


def test_enwik8_zip_without_member(tmp_path):
    path = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", b"hello")
    with pytest.raises(DataError, match=re.escape(f"data path '{path}': expected a zip member named 'enwik8'")):
        load_bytes(str(path))


def test_unknown_name(tmp_path):
    with pytest.raises(ValueError, match=r"name: expected one of .*'enwik8'.*, got 'enwik9'"):
        load_bytes(None, name="enwik9")


# --- errors --------------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=re.escape(f"data path '{path}' does not exist")) as err:
        load_bytes(str(path))
    assert "\n" not in str(err.value)


def _tree(root, n_files: int) -> dict:
    """n files of distinct contents under root (two levels), plus a hidden one; {relative path: bytes}."""
    files = {}
    for i in range(n_files):
        rel = f"pkg{i % 7}/mod_{i:03d}.py"
        files[rel] = f"# file {i}\n".encode() + bytes([65 + i % 26]) * (100 + i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(files[rel])
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (root / "notes.txt").write_bytes(b"not python\n" * 5)
    files["notes.txt"] = b"not python\n" * 5
    return files


def test_directory_and_glob_hold_out_whole_files(tmp_path):
    from bstrain.data.text import _file_split
    files = _tree(tmp_path, 200)
    for path, chosen in ((str(tmp_path), files),
                         (str(tmp_path / "**" / "*.py"), {k: v for k, v in files.items() if k.endswith(".py")})):
        train, valid, test = load_bytes(path)
        want = [b"".join(chosen[k] for k in sorted(chosen, key=lambda k: str(tmp_path / k)) if _file_split(k) == s)
                for s in range(3)]
        assert [bytes(a) for a in (train, valid, test)] == want
        assert len(valid) and len(test) and len(train) > 10 * len(valid) // 2
        assert b"refs/heads" not in bytes(train) + bytes(valid) + bytes(test)        # hidden files skipped
    # adding a file moves no other file between splits
    (tmp_path / "pkg0" / "zz_new.py").write_bytes(b"new" * 50)
    again = load_bytes(str(tmp_path / "**" / "*.py"))
    for old, new in zip(load_bytes(str(tmp_path / "**" / "*.py")), again):
        assert bytes(old) == bytes(new)


def test_max_bytes_and_few_files(tmp_path):
    _tree(tmp_path, 200)
    parts = load_bytes(str(tmp_path / "**" / "*.py"), max_bytes=5000)
    assert sum(len(p) for p in parts) == 5000
    few = tmp_path / "few"
    few.mkdir()
    (few / "a.txt").write_bytes(b"a" * 1000)
    (few / "b.txt").write_bytes(b"b" * 1000)
    train, valid, test = load_bytes(str(few))                     # too few files: a byte split of both
    assert (len(train), len(valid), len(test)) == (1800, 100, 100)
    with pytest.raises(DataError, match="matches no file"):
        load_bytes(str(tmp_path / "*.nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory without files"):
        load_bytes(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="max_bytes: expected an int >= 0"):
        load_bytes(str(few), max_bytes=-1)


def test_rank_slices_equal_one_process_with_the_whole_batch():
    data = _ramp(1000)
    whole = BpttBatches(data, 6, 8)
    ranks = [BpttBatches(data, 3, 8, rank=r, world=2) for r in range(2)]
    for _ in range(len(whole) + 2):
        x, y, wrapped = whole.next_batch()
        parts = [b.next_batch() for b in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert all(p[2] == wrapped for p in parts)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\), got 2"):
        BpttBatches(data, 3, 8, rank=2, world=2)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(f"data path '{path}' is empty")):
        load_bytes(str(path))


def test_check_size_names_path_split_and_sizes():
    split = np.zeros(100, dtype=np.uint8)
    check_size(split, 3, 33, "/data/x.txt", "valid")  # 3 * 33 + 1 = 100 fits exactly
    msg = "data path '/data/x.txt': the valid split has 100 bytes, but batch_size 4 x seq_len 32 needs at least 129"
    with pytest.raises(DataError, match=re.escape(msg)):
        check_size(split, 4, 32, "/data/x.txt", "valid")
    with pytest.raises(DataError, match=r"^the embedded default corpus: the test split has 100 bytes.* 129$"):
        check_size(split, 4, 32, None, "test")


# --- BPTT batches ----------------------------------------------------------------------------------
def _ramp(n: int) -> np.ndarray:
    return (np.arange(n) % 251).astype(np.uint8)  # 251 is prime: no accidental periodic matches


@pytest.mark.parametrize("batch_size,seq_len,n", [(4, 8, 1000), (3, 5, 16), (1, 7, 50)],
                         ids=["B4T8", "B3T5-minimal", "B1T7"])
def test_bptt_shapes_and_shift(batch_size, seq_len, n):
    data = _ramp(n)
    batches = BpttBatches(data, batch_size, seq_len)
    stream_len = (n - 1) // batch_size
    assert len(batches) == stream_len // seq_len
    for i in range(len(batches)):
        x, y = batches.batch(i)
        assert x.shape == y.shape == (batch_size, seq_len)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        # Row b is stream b: data[b*L + i*T + t], and y the byte right after.
        for b in range(batch_size):
            start = b * stream_len + i * seq_len
            assert x[b].tolist() == data[start:start + seq_len].tolist()
            assert y[b].tolist() == data[start + 1:start + seq_len + 1].tolist()


def test_bptt_streams_are_contiguous_across_batches():
    batches = BpttBatches(_ramp(1000), 4, 8)
    for i in range(len(batches) - 1):
        x0, y0 = batches.batch(i)
        x1, _ = batches.batch(i + 1)
        # The next batch's first input is this batch's last target: the hidden state carries over.
        assert torch.equal(x1[:, 0], y0[:, -1])
        assert torch.equal(x1[:, 0], x0[:, -1] + 1)  # the ramp has no wrap within these indices


def test_bptt_batch_index_is_modulo():
    batches = BpttBatches(_ramp(1000), 4, 8)
    for a, b in zip(batches.batch(len(batches) + 2), batches.batch(2)):
        assert torch.equal(a, b)


def test_bptt_next_batch_wraps_and_tracks_position():
    batches = BpttBatches(_ramp(200), 2, 10)  # L = 99, 9 batches
    assert len(batches) == 9 and batches.position == 0
    wrapped = []
    for step in range(2 * len(batches) + 1):
        x, _, w = batches.next_batch()
        assert torch.equal(x, batches.batch(step)[0])
        wrapped.append(w)
        assert batches.position == (step + 1) % len(batches)
    assert [i for i, w in enumerate(wrapped) if w] == [0, 9, 18]


def test_bptt_state_dict_round_trip():
    batches = BpttBatches(_ramp(200), 2, 10)
    for _ in range(5):
        batches.next_batch()
    state = batches.state_dict()
    assert state == {"position": 5, "batches": 9}
    resumed = BpttBatches(_ramp(200), 2, 10)
    resumed.load_state_dict(state)
    for _ in range(6):
        (xa, ya, wa), (xb, yb, wb) = batches.next_batch(), resumed.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and wa == wb
    with pytest.raises(ValueError, match=r"state\['position'\]: expected an int in \[0, 9\), got 9"):
        resumed.load_state_dict({"position": 9})
    other = BpttBatches(_ramp(1000), 2, 8)                           # another batch shape: same fraction
    other.load_state_dict({"position": 3, "batches": 9})
    assert other.position == 3 * len(other) // 9


def test_bptt_argument_errors():
    with pytest.raises(DataError, match=r"data: expected at least batch_size 4 x seq_len 8 \+ 1 = 33 bytes, got 32"):
        BpttBatches(_ramp(32), 4, 8)
    with pytest.raises(TypeError, match=r"data: expected a 1-D uint8, uint16 or uint32 numpy array, got 1-D int64 array"):
        BpttBatches(np.arange(100), 4, 8)
    with pytest.raises(ValueError, match=r"seq_len: expected a positive int, got 0"):
        BpttBatches(_ramp(100), 4, 0)


def test_bits_per_byte():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_a_real_text_file_end_to_end():
    train, valid, _ = load_bytes(str(REAL_TEXT))
    check_size(valid, 16, 64, str(REAL_TEXT), "valid")
    x, y, wrapped = BpttBatches(train, 16, 64).next_batch()
    assert wrapped and x.shape == (16, 64)
    assert bytes(x[0].tolist()).startswith(REAL_TEXT.read_bytes()[:64])


def test_enwik8_full_size_uses_standard_cuts(tmp_path):
    # A sparse file: 100M + 10 bytes on paper, next to nothing on disk.
    path = tmp_path / "enwik8"
    with open(path, "wb") as f:
        f.truncate(100_000_010)
    train, valid, test = load_bytes(str(path))
    assert _lengths((train, valid, test)) == (90_000_000, 5_000_000, 5_000_000)
    # The same bytes under another name split proportionally: the standard cuts come from the name.
    other = tmp_path / "big.bin"
    path.rename(other)
    assert _lengths(load_bytes(str(other))) == (90_000_009, 5_000_000, 5_000_001)


def test_an_existing_name_with_glob_characters_is_a_file(tmp_path):
    path = tmp_path / "corpus[v2].txt"
    path.write_bytes(b"abc" * 1000)
    train, valid, test = load_bytes(str(path))
    assert len(train) + len(valid) + len(test) == 3000


def test_check_size_names_the_per_rank_batch():
    with pytest.raises(DataError, match=r"batch_size 4 x 2 ranks x seq_len 8 needs at least 65"):
        check_size(_ramp(64), 4, 8, None, "train", ranks=2)
    check_size(_ramp(65), 4, 8, None, "train", ranks=2)
