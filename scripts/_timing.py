"""The timers, the environment record and the report writer that the scripts under scripts/ share.

- :func:`bench`: median ms of a call, ``triton.testing.do_bench`` on the GPU (a few timed calls for
  ``--cpu-smoke`` runs, which check that a script works and time nothing worth reading).
- :func:`event_times_ms`: each call timed alone by CUDA events (the caller takes the median).
- :func:`wall_per_call`: the median over loops of the mean wall time of back-to-back calls, each loop
  ended by one synchronize: what eager code that calls the op pays, host included.
- :func:`environment`: device, torch (and triton) versions and the date, for the header line and
  the JSON of a result file; :func:`software`: "torch X, triton Y".
- :func:`write_report`: a result table as NAME.md and its data as NAME.json in the output folder.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import torch


def bench(fn, smoke: bool = False, cpu_calls: int = 3, warmup: int = 25, rep: int = 200) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA; with ``smoke``, the mean of ``cpu_calls``
    calls after one warm-up call."""
    if smoke:
        fn()
        t = time.perf_counter()
        for _ in range(cpu_calls):
            fn()
        return (time.perf_counter() - t) / cpu_calls * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def event_times_ms(fn, reps: int) -> list[float]:
    """ms of each of ``reps`` calls of fn, each timed alone by CUDA events."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_per_call(fn, device: torch.device, calls: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` loops of the mean wall time (s) of ``calls`` back-to-back calls, each
    loop ended by one synchronize, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def triton_version() -> str:
    import triton
    return triton.__version__


def software() -> str:
    """"torch X, triton Y" of this process."""
    return f"torch {torch.__version__}, triton {triton_version()}"


def environment(cpu_smoke: bool, triton: bool = False) -> dict:
    """{"device", "torch"[, "triton"], "date"} of this run; the device is "cpu (smoke)" for a
    ``--cpu-smoke`` run, else the GPU's name."""
    env = {"device": "cpu (smoke)" if cpu_smoke else torch.cuda.get_device_name(), "torch": torch.__version__}
    if triton:
        env["triton"] = triton_version()
    env["date"] = str(datetime.date.today())
    return env


def write_report(out: str, name: str, lines: list[str], data: dict, quiet: bool = False) -> None:
    """``lines`` as ``out/NAME.md``, ``data`` as ``out/NAME.json``; the table printed unless ``quiet``."""
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    if not quiet:
        print("\n".join(lines))
