"""How a run stops early: SIGINT/SIGTERM (one asks for a checkpoint and a clean stop, a second
stops at once), ``trainer.time_limit_s``, and under DDP the ranks agreeing on the step to stop at."""
from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from bstrain.errors import RunAborted
from bstrain.train.checkpoint import latest_checkpoint
from bstrain.train.distributed import World, gather

if TYPE_CHECKING:
    from bstrain.train.state import TrainState


@contextlib.contextmanager
def stop_on_signals(state: TrainState, run_dir: Path, world: World, config=None):
    """SIGINT/SIGTERM ask the loop to stop after the current step (it then checkpoints); a second
    one stops the run where it is (:class:`RunAborted`: one line, no new checkpoint, the last
    complete one intact), and a third acts as usual. Only in the main thread, where Python
    delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def ask(signum, _frame):
        name = signal.Signals(signum).name
        if state.stop is None:
            state.stop = name
            return
        for s, h in old.items():
            signal.signal(s, h)
        last = latest_checkpoint(run_dir / "ckpt") if world.main else None
        raise RunAborted(f"stopped by a second {name} at step {state.step}, without a new checkpoint; "
                         + (f"the last one is {last}; {resume_hint(run_dir, config)}" if last
                            else "none was written"))
    for s in old:
        signal.signal(s, ask)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resume_hint(run_dir: Path, config=None) -> str:
    """How to continue a run: the run dir is all it takes (resuming reads the checkpoint's config),
    started as this run was, on as many processes (``trainer.nproc=N``, or torchrun's options), and
    ``trust=[...]`` for the ``_target_``s of ``config`` (the run's, plain or
    OmegaConf) outside bstrain."""
    import os
    import shlex

    from omegaconf import OmegaConf

    from bstrain.train import trust
    command = "python -m bstrain train"
    if os.environ.get("BSTRAIN_NPROC"):                 # bstrain.train.launch's workers
        command += f" trainer.nproc={os.environ['BSTRAIN_NPROC']}"
    elif "TORCHELASTIC_RUN_ID" in os.environ:           # torchrun's
        local, world = os.environ.get("LOCAL_WORLD_SIZE", "1"), os.environ.get("WORLD_SIZE", "1")
        nodes = "--standalone" if local == world else f"--nnodes={int(world) // max(1, int(local))}"
        command = f"torchrun {nodes} --nproc_per_node={local} -m bstrain train"
    if OmegaConf.is_config(config):
        config = OmegaConf.to_container(config, resolve=True)
    refused = trust.untrusted(config) if config is not None else []
    return (f"continue with {command} trainer.resume=true {shlex.quote(f'hydra.run.dir={run_dir}')}"
            + (f" {trust.trust_argument(refused)}" if refused else ""))


def _agree_to_stop(stop: str | None, world: World, log_step: bool, out_of_time: bool) -> str | None:
    """Why to stop after this step: a signal's name, "time", or None. One process decides at every
    step; under DDP the ranks agree at log steps (a collective), so all stop at the same step."""
    reason = stop or ("time" if out_of_time else None)
    if world.active:
        if not log_step:
            return None
        reasons = [r for r in gather(reason, world) if r]
        reason = next((r for r in reasons if r != "time"), reasons[0] if reasons else None)
    return reason
