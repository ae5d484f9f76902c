"""Tasks: what a run learns. A task owns the batches, the loss, the metrics, evaluation and sampling;
the trainer knows none of them by name.

A task is built from the ``task`` config by its ``_target_`` and handed the ``data`` object (built
from the ``data`` config the same way). The trainer calls, in this order:

- ``setup(data, world, seed)``: load and check the data (raise :class:`bstrain.errors.UserError`
  for a bad path or too small a split), before any model is built;
- ``check_model_config(model)`` (optional): a UserError naming the key where the model's config
  (a dict of its constructor's arguments) contradicts the data: image channels, classes, the
  vocabulary, the context (see :func:`model_key`);
- ``next_batch(device) -> (inputs, targets, fresh)``: this rank's next training batch; ``fresh``
  says that a carried recurrent state must restart (a new epoch of contiguous streams);
- ``loss(output, targets) -> scalar tensor``: the mean training loss, in fp32;
- ``train_metrics(loss) -> dict``: host-side metrics derived from a mean loss (``bpb``);
- ``batch_metrics(output, targets) -> dict``: device-side training metrics of one batch, as
  scalar tensors (``acc``), averaged over the steps between log lines and over the ranks (they
  are computed inside the step, a CUDA graph's too, and must not read the device);
- ``unit`` and ``units_per_batch()``: what a batch holds and how many of this rank's (tokens,
  images), for the throughput the logs report (``tokens/s``, ``images/s``);
- ``evaluate(forward, split, max_batches) -> dict``: ``loss`` and the task's metrics on a split,
  and ``batches``, the number of batches evaluated (the same name for every task), where
  ``forward(x, state) -> (output, state)`` runs the model (state None: a fresh one);
- ``evaluation_sums(forward, split, max_batches, rank, size)`` and ``evaluation_metrics(sums)``
  (optional): ``evaluate`` in two halves, so that under fsdp each of ``size`` ranks evaluates its
  rows of every batch (the forward is collective: every rank runs each batch) and the sums
  (float64 tensors) are all-reduced before the metrics; ``evaluate`` is then the two in one process;
- ``state_dict()`` / ``load_state_dict(state, world)``: the data position, for exact resumes
  (``state_continues = False`` after loading tells the trainer to drop a carried model state);
- ``sample(forward, stateful, prompt, ...)`` (language tasks only).

``loss`` checks the shape of the model's output (TypeError naming the expected and the got
shape): when a run starts, the trainer runs the model on two rows of the first batch and reports
that error in one line, before any step (bstrain/train/checks.py).

``metric`` names the validation value a run reports and TensorBoard's hparams view shows.
Add a task by writing a class with these methods and naming it in a config's ``task._target_``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

Forward = Callable[[torch.Tensor, Any], tuple[Any, Any]]


class Task:
    """Base class: the protocol above, with defaults for the optional parts."""

    metric: str = "loss"
    unit: str = "samples"          # what units_per_batch() counts: the logs report unit/s
    state_continues: bool = True   # False after load_state_dict when a carried model state no longer fits the data

    def setup(self, data, world, seed: int) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__

    def next_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        raise NotImplementedError

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_model_config(self, model: dict) -> None:
        """UserError where the model's config contradicts the data; by default nothing is checked."""

    def train_metrics(self, loss: float) -> dict:
        return {}

    def batch_metrics(self, output, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def evaluate(self, forward: Forward, split: str, max_batches: int, show_progress: bool = False) -> dict:
        if not splits_evaluation(self):
            raise NotImplementedError
        return self.evaluation_metrics(self.evaluation_sums(forward, split, max_batches, 0, 1, show_progress))

    def evaluation_sums(self, forward: Forward, split: str, max_batches: int, rank: int = 0, size: int = 1,
                        show_progress: bool = False) -> dict[str, torch.Tensor]:
        """Sums (float64 tensors) over rows ``rank`` of ``size`` of every evaluation batch."""
        raise NotImplementedError

    def evaluation_metrics(self, sums: dict[str, torch.Tensor]) -> dict:
        """The metrics of the sums of every rank's :meth:`evaluation_sums`."""
        raise NotImplementedError

    def units_per_batch(self) -> int:
        """Units (tokens, images) in one batch of this rank: for the throughput line."""
        legacy = getattr(self, "tokens_per_batch", None)
        if legacy is not None:                    # the protocol's old name keeps working for now
            warnings.warn(f"{type(self).__name__}.tokens_per_batch is deprecated: name it units_per_batch "
                          f"(and set unit = 'tokens')", DeprecationWarning, stacklevel=2)
            return legacy()
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, world) -> None:
        pass

    def hparams(self) -> dict:
        return {}

    def sample(self, forward: Forward, stateful: bool, prompt: bytes, length: int, temperature: float,
               generator: torch.Generator, device: torch.device) -> bytes:
        raise NotImplementedError(f"{type(self).__name__} does not generate samples")


def model_key(model: dict, names: tuple[str, ...]) -> tuple[str, int] | None:
    """(name, value) of the first of ``names`` (the spellings models give one argument: in_channels,
    channels, in_chans) that the model config sets to an int; None when it sets none."""
    for name in names:
        value = model.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def splits_evaluation(task) -> bool:
    """Whether ``task`` evaluates in two halves (:meth:`Task.evaluation_sums`), which ranks can share."""
    return getattr(type(task), "evaluation_sums", Task.evaluation_sums) is not Task.evaluation_sums


def rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows ``rank`` of ``size`` near-equal parts of ``t`` (batch on dim 0)."""
    return t if size == 1 else torch.tensor_split(t, size)[rank]


def eval_progress(total: int, enabled: bool, desc: str):
    """A tqdm bar over evaluation batches when stderr is a terminal, else a plain range."""
    import sys
    if enabled and total > 1 and sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(range(total), desc=desc, leave=False, dynamic_ncols=True)
    return range(total)
