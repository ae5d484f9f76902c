"""``trainer.nproc=N``: ``python -m bstrain train`` starts its N worker processes itself, on torch's
elastic launcher (the agent ``torchrun`` runs: standalone rendezvous on localhost; each worker then
joins the process group as under torchrun, gloo on the CPU and NCCL on GPUs).

Why not torchrun: torchrun reports a worker's exit with its own ``ChildFailedError`` traceback, and
Ctrl-C with a ``SignalException`` one and status 1. Here the launcher stays quiet and exits as one
process would: the workers print their own one-line message (rank 0 only), a bug's traceback is
printed once (the first failing worker's), and the status is the workers' (1 for an error, 130
for Ctrl-C or SIGTERM, which the agent forwards to the workers so that they checkpoint first).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid

from bstrain.train.rundir import quote_path

LAUNCHED = "BSTRAIN_NPROC"
"""Set in the workers' environment: the process count the launcher started (read by the resume hint)."""

_RUN_DIR_KEYS = ("hydra.run.dir", "trainer.run_dir", "hydra.output_subdir")


def started_by_a_launcher() -> bool:
    """Whether this process is one of several that torchrun or our launcher started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def worker_argv(argv: list[str], run_dir: str) -> list[str]:
    """The workers' command line: the user's own arguments, run in the launcher's run directory
    (which Hydra made and wrote .hydra/ into already: the workers write no second copy)."""
    kept = [a for a in argv if a.partition("=")[0].lstrip("+") not in _RUN_DIR_KEYS]
    return ["-m", "bstrain", "train", *kept, f"hydra.run.dir={quote_path(os.path.abspath(run_dir))}",
            "hydra.output_subdir=null"]


@contextlib.contextmanager
def _quiet_agent():
    """The agent's INFO, WARNING and ERROR lines (configs, rendezvous, "received death signal") off the
    console: what the user needs, the workers print. (Each of torch's elastic loggers has its own
    level, so each is raised.)"""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def launch(nproc: int, argv: list[str], run_dir: str, shutdown_timeout_s: int = 600) -> int:
    """Runs ``python -m bstrain train`` on ``nproc`` local worker processes; returns the exit status
    to leave with (0, or the failing workers' status). ``shutdown_timeout_s``: how long a signal's
    checkpoint may take before the agent kills the workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4().int),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          shutdown_timeout=shutdown_timeout_s)
    os.environ[LAUNCHED] = str(nproc)
    try:
        with _quiet_agent():
            elastic_launch(config, sys.executable)(*worker_argv(argv, run_dir))
        return 0
    except SignalException:                 # the workers had the signal too, and said how to resume
        return 130
    except ChildFailedError as exc:
        return _report(exc)
    finally:
        os.environ.pop(LAUNCHED, None)


def _report(exc) -> int:
    """The failing workers' status (rank 0's, else the first one's); a bug's traceback (the error
    file of the first worker that hit one), printed once."""
    failures = sorted(exc.failures.items())
    bugs = sorted((f.timestamp, r, f) for r, f in failures if isinstance(f.message, dict))
    if bugs:
        _, rank, failure = bugs[0]
        print(f"[rank{rank}] " + failure.message["extraInfo"]["py_callstack"].rstrip(), file=sys.stderr)
        return 1
    codes = [f.exitcode for _, f in failures if f.exitcode > 0]
    by_rank = dict(failures)
    if 0 in by_rank and by_rank[0].exitcode > 0:
        return by_rank[0].exitcode
    return codes[0] if codes else 128 - failures[0][1].exitcode
