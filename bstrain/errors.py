"""The exceptions ``python -m bstrain`` reports in one line, without a traceback.

- :class:`UserError`: a data, config or checkpoint problem the user can fix (exit status 1). It
  is a ``ValueError`` so that library callers catching ``ValueError`` keep working.
  :class:`DataError` is the one data raises, :class:`CheckpointError` the one a checkpoint raises (missing, truncated, corrupt, foreign).
  :class:`UserCodeError`: an exception raised by the user's own code at start (a model's
  constructor), in one line; its traceback is in the run's train.log, so the run dir is kept.
- :class:`RunInterrupted`: SIGINT or SIGTERM stopped a run after it wrote a checkpoint (exit
  status 130); the message says how to resume.
- :class:`RunAborted`: a second SIGINT or SIGTERM stopped a run at once, without a new
  checkpoint (exit status 130); the message names the last one and says how to resume.

Every other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(ValueError):
    """A data, config or checkpoint problem, stated in one line that names what to change."""


class DataError(UserError):
    """A data problem (a bad path, too small a file, a tokenizer that does not parse)."""


class CheckpointError(UserError):
    """A checkpoint that is missing, truncated, corrupt or not one of ours."""


class UserCodeError(UserError):
    """An exception raised inside the user's own code when a run starts (a ``_target_`` model's
    constructor): one line naming the class and the exception. Its traceback is written to the
    run's train.log, so the start keeps that run directory; under torchrun rank 0 prints it."""


class RunInterrupted(Exception):
    """A run stopped by a signal, after saving a checkpoint; the message says how to resume."""

    exit_code = 130


class RunAborted(KeyboardInterrupt):
    """A second signal: the run stops where it is, without a checkpoint (checkpoints are written
    atomically, so the last complete one stays intact). A KeyboardInterrupt, so that no ``except
    Exception`` on the way swallows it."""

    exit_code = 130
