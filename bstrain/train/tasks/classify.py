"""Image classification: cross-entropy, accuracy and top-5 accuracy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bstrain.data.images import ImageData
from bstrain.errors import UserError
from bstrain.train.tasks import Forward, Task, eval_progress, model_key, rows


class Classification(Task):
    """Classify (B, C, H, W) images into ``data.classes`` classes; the model returns (B, classes) logits.

    Each epoch visits the training images in a permutation drawn from (seed, epoch); with W ranks
    the global batch of W x data.batch_size images is cut into rank slices, so a run on W ranks
    sees the batches of one process with W times the batch. The last partial batch of an epoch is
    dropped. Metrics: ``loss``, ``acc`` (the reported one) and ``top5``; in training, ``acc`` of
    the training batches too. The model must return one logit per class of the data
    (:attr:`bstrain.data.images.ImageData.classes`).
    """

    metric = "acc"
    unit = "images"

    def __init__(self, label_smoothing: float = 0.0):
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise UserError(f"task.label_smoothing: expected a value in [0, 1), got {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self.epoch, self.position = 0, 0

    def setup(self, data, world, seed: int) -> None:
        if not isinstance(data, ImageData):
            raise UserError(f"data: the classification task needs ImageData (data=images), got {type(data).__name__}")
        self.data, self.world, self.seed = data, world, seed
        x, _ = data.splits()["train"]
        self.global_batch = data.batch_size * world.size
        if len(x) < self.global_batch:
            raise UserError(f"data.batch_size: {data.batch_size} x {world.size} rank(s) is more than the "
                            f"{len(x)} training images")
        self.per_epoch = len(x) // self.global_batch
        self.classes = data.classes
        self._order = None

    def check_model_config(self, model: dict) -> None:
        """The model's image channels, classes and image size (where it names them) against the data's.
        A model may have more classes than the labels name (a set on disk may lack the top label)."""
        channels, height, width = self.data.image_shape
        where = self.data.where()
        if (key := model_key(model, ("in_channels", "in_chans"))) and key[1] != channels:
            raise UserError(f"model.{key[0]}={key[1]}, but the images of {where} have {channels} "
                            f"channel{'s' if channels != 1 else ''}: set model.{key[0]}={channels}")
        if (key := model_key(model, ("classes", "num_classes", "n_classes"))) and key[1] < self.classes:
            raise UserError(f"model.{key[0]}={key[1]}, but the labels of {where} name {self.classes} classes: "
                            f"set model.{key[0]}={self.classes}")
        if (key := model_key(model, ("image_size", "img_size"))) and (key[1], key[1]) != (height, width):
            fix = f"set model.{key[0]}={height}" if height == width else "the model takes square images"
            raise UserError(f"model.{key[0]}={key[1]}, but the images of {where} are {height}x{width}: {fix}")

    def describe(self) -> str:
        return f"classification on {self.data.describe()}"

    def units_per_batch(self) -> int:
        return self.data.batch_size

    def batch_metrics(self, output, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The training batch's accuracy (of the augmented images)."""
        return {"acc": (output.argmax(-1) == targets).float().mean()}

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = (self.epoch, torch.randperm(len(self.data.splits()["train"][0]), generator=gen))
        return self._order[1]

    def next_batch(self, device: torch.device):
        x_all, y_all = self.data.splits()["train"]
        start = self.position * self.global_batch + self.world.rank * self.data.batch_size
        idx = self._epoch_order()[start:start + self.data.batch_size]
        x, y = torch.from_numpy(x_all[idx.numpy()]), torch.from_numpy(y_all[idx.numpy()])
        if self.data.augment:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 100_003 + self.position)
            x = self.data.augment_batch(x, gen, self.world.rank * self.data.batch_size, self.global_batch)
        fresh = self.position == 0
        self.position += 1
        if self.position == self.per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return self.data.normalise(x.to(device, non_blocking=True)), y.to(device, non_blocking=True), fresh

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != targets.shape[0] \
                or output.shape[1] < self.classes:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise TypeError(f"model output: expected (B, classes) = ({targets.shape[0]}, >= {self.classes}) logits "
                            f"for {targets.shape[0]} images of {self.classes} classes, got {got}")
        return F.cross_entropy(output.float(), targets, label_smoothing=self.label_smoothing)

    @torch.no_grad()
    def evaluation_sums(self, forward: Forward, split: str, max_batches: int, rank: int = 0, size: int = 1,
                        show_progress: bool = False) -> dict[str, torch.Tensor]:
        """The summed loss, top-1 and top-5 hits and the images of rows ``rank`` of ``size`` of
        the first ``max_batches`` (0: all) batches of a split."""
        x_all, y_all = self.data.splits()[split]
        bs = self.global_batch
        n = -(-len(x_all) // bs)
        n = n if max_batches <= 0 else min(n, max_batches)
        device = forward.device
        sums = torch.zeros(4, dtype=torch.float64, device=device)          # loss, top-1, top-5, images
        for i in eval_progress(n, show_progress, f"eval {split}"):
            x = self.data.normalise(rows(torch.from_numpy(x_all[i * bs:(i + 1) * bs]), rank, size).to(device))
            y = rows(torch.from_numpy(y_all[i * bs:(i + 1) * bs]), rank, size).to(device)
            logits, _ = forward(x, None)
            top = logits.float().topk(min(5, logits.shape[1]), dim=1).indices
            sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                                 (top[:, 0] == y).sum().double(), (top == y[:, None]).any(1).sum().double(),
                                 torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
        return {"sums": sums, "batches": torch.tensor(float(n), dtype=torch.float64, device=device) / size}

    def evaluation_metrics(self, sums: dict[str, torch.Tensor]) -> dict:
        """Mean loss, top-1 and top-5 accuracy."""
        loss, top1, top5, seen = sums["sums"].tolist()
        if seen == 0:
            raise UserError("data: the evaluated split has no images")
        return {"loss": loss / seen, "acc": top1 / seen, "top5": top5 / seen, "batches": round(float(sums["batches"]))}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict, world) -> None:
        self.epoch = int(state["epoch"])
        position = int(state["position"])
        if state.get("global_batch", self.global_batch) != self.global_batch:     # same fraction of the epoch
            position = position * int(state["global_batch"]) // self.global_batch
        self.position = min(position, self.per_epoch - 1)

    def hparams(self) -> dict:
        return {"batch_size": self.data.batch_size}
