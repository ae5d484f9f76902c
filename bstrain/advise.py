"""Which block size and density to give a block-sparse layer, from committed measurements.

The block-sparse product's forward, dX and dW (``BlocksparseMatMul``) were timed against dense
cuBLAS on the same product (``scripts/bench/bench_matmul.py``, ``benchmarks/matmul.md``). Their
ratio is the **rate**: the useful FLOPs per second of the sparse layer as a fraction of the dense
one's. Time per useful FLOP is 1 / rate; at density d the layer takes d / rate of the dense
layer's time, so at the dense layer's GPU time it can be rate / d times as wide (the **speedup**).

    >>> from bstrain.advise import advise, format_advice
    >>> print(format_advice(advise(4096, 4096, tokens=8192, density=0.25)))   # doctest: +SKIP

``python -m bstrain advise in_features=4096 out_features=4096 tokens=8192`` prints the same table.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from importlib import resources

# device name (as torch.cuda.get_device_name reports it) -> its table in bstrain/measurements/
TABLES = {"NVIDIA H200": "bsmm_h200.csv"}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
DENSITIES = (0.05, 0.0625, 0.1, 0.125, 0.2, 0.25, 0.333, 0.5)     # the grid a free density is chosen from


@dataclass(frozen=True)
class Advice:
    """One (block size, density) choice for a layer, estimated from the measurements.

    rate: fwd + dX + dW useful FLOP/s as a fraction of dense cuBLAS's (time per useful FLOP is 1/rate).
    speedup: dense time / sparse time at this shape, = rate / density; equally, how many times
        wider the layer can be at the dense layer's GPU time.
    in_range: density and tokens lie within the measured ones (interpolated between them); False:
        outside, and the nearest measurement stands in.
    """
    block_size: int
    density: float
    rate: float
    speedup: float
    in_range: bool


def _table(device: str, dtype: str) -> dict[tuple[int, int, float], float]:
    """{(M, block size, density): rate} of one device's measurements in ``dtype``."""
    text = resources.files("bstrain.measurements").joinpath(TABLES[device]).read_text()
    sums: dict[tuple[int, int, float], list[float]] = {}
    for row in csv.DictReader(line for line in text.splitlines() if not line.startswith("#")):
        if row["dtype"] != dtype:
            continue
        key = (int(row["M"]), int(row["bs"]), float(row["density"]))      # the asked density; the
        acc = sums.setdefault(key, [0.0, 0.0, float(row["real_density"])])  # layout's own gives the rate
        acc[0] += float(row["ours_us"])
        acc[1] += float(row["dense_us"])
    return {k: dense * d / ours for k, (ours, dense, d) in sums.items()}


def _between(x: float, points: list[float]) -> tuple[float, float, float]:
    """(lower point, upper point, weight of the upper) for log-linear interpolation, clamped."""
    x = min(max(x, points[0]), points[-1])
    for lo, hi in zip(points, points[1:]):
        if x <= hi:
            return lo, hi, (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return points[-1], points[-1], 0.0


def _rate(table: dict, tokens: int, bs: int, density: float) -> float:
    """The rate at (tokens, bs, density), log-linear in tokens and in density between measurements."""
    ms = sorted({m for m, b, _ in table if b == bs})
    ds = sorted({d for m, b, d in table if b == bs and m == ms[0]})
    m0, m1, wm = _between(tokens, ms)
    d0, d1, wd = _between(density, ds)

    def at(m):
        return math.exp((1 - wd) * math.log(table[m, bs, d0]) + wd * math.log(table[m, bs, d1]))
    return math.exp((1 - wm) * math.log(at(m0)) + wm * math.log(at(m1)))


def _device(device: str | None) -> str:
    if device is None:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else next(iter(TABLES))
    for name in TABLES:
        if name.lower() in device.lower() or device.lower() in name.lower():
            return name
    raise ValueError(f"device: no measurements for {device!r}; measured: {', '.join(TABLES)} "
                     f"(run scripts/bench/bench_matmul.py on it to add a table)")


def advise(in_features: int, out_features: int, tokens: int = 8192, *, density: float | None = None,
           dtype: str = "bf16", device: str | None = None) -> list[Advice]:
    """The (block size, density) choices for an (in_features -> out_features) layer applied to
    ``tokens`` rows per call, best first (highest rate: least time per useful FLOP).

    Args:
        density: rank the block sizes at this density; None ranks every block size and density
            of :data:`DENSITIES`.
        dtype: "bf16" or "fp16".
        device: a measured device's name (``torch.cuda.get_device_name()``); None: this
            machine's GPU, or the first measured device when there is none.
    Only block sizes that divide both feature counts are offered. The measurements are of a
    4096 x 4096 weight: a layer of another shape is estimated by its rows (tokens) and density.
    """
    from bstrain.layout import check_density
    for name, value in (("in_features", in_features), ("out_features", out_features), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    densities = DENSITIES if density is None else (check_density(density),)
    table = _table(_device(device), DTYPES[dtype])
    ms, ds = sorted({m for m, _, _ in table}), sorted({d for _, _, d in table})
    sizes = sorted({b for _, b, _ in table if in_features % b == 0 and out_features % b == 0})
    if not sizes:
        raise ValueError(f"in_features, out_features: no measured block size ({', '.join(map(str, sorted({b for _, b, _ in table})))}) "
                         f"divides both {in_features} and {out_features}")
    out = []
    for bs in sizes:
        for d in densities:
            rate = _rate(table, tokens, bs, d)
            inside = ms[0] <= tokens <= ms[-1] and ds[0] - 1e-9 <= d <= ds[-1] + 1e-9
            out.append(Advice(bs, d, rate, rate / d, inside))
    return sorted(out, key=lambda a: (-a.rate, a.density))


def format_advice(rows: list[Advice], top: int | None = None) -> str:
    """A text table of :func:`advise`'s rows."""
    lines = ["block  density  rate vs dense  speedup (= width at dense's time)",
             "-----  -------  -------------  ---------------------------------"]
    for a in rows[:top]:
        note = "" if a.in_range else "  (outside the measured range: nearest used)"
        lines.append(f"{a.block_size:>5}  {a.density:>7.3g}  {a.rate:>13.3f}  {a.speedup:>10.2f}x{note}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m bstrain advise in_features=N out_features=N [tokens=N] [density=D] [dtype=bf16|fp16]
    [device=NAME] [top=N]``; a wrong key or value exits with one line."""
    import sys
    keys = {"in_features": int, "out_features": int, "tokens": int, "density": float, "dtype": str,
            "device": str, "top": int}
    args: dict = {}
    try:
        for arg in argv:
            key, sep, value = arg.partition("=")
            if not sep or key not in keys:
                raise ValueError(f"{arg}: expected key=value with a key of {', '.join(keys)}")
            try:
                args[key] = keys[key](value)
            except ValueError:
                raise ValueError(f"{key}: expected {keys[key].__name__}, got {value!r}") from None
        missing = [k for k in ("in_features", "out_features") if k not in args]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required (e.g. in_features=4096 out_features=4096)")
        top = args.pop("top", 10)
        rows = advise(args.pop("in_features"), args.pop("out_features"), **args)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    print(format_advice(rows, top))
