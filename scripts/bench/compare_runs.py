"""Committed benchmark figures against a fresh run of the same script: the ratio new / old per row.

    python scripts/bench/compare_runs.py OLD NEW --key layout,S,D,block --value ours_fwd_ms,ours_fb_ms
                                   [--limit 1.05] [--title NAME] [--md FILE]

OLD and NEW are the result files a benchmark script wrote (.json: a list of rows or {"rows": [...]};
.csv: one row per line). Rows are matched on --key; each --value is a time (lower is better), so a
ratio above --limit is a slowdown and is marked. Prints a markdown table, and its summary line
last: rows compared, the median and the worst ratio, and how many rows passed the limit. Appends the
table to --md when given. Exit status 0 whatever the ratios (noise is judged by the reader).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics


def rows(path: str) -> list[dict]:
    """The result rows of a benchmark file (.csv or .json)."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def number(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x == x and x > 0 else None


def compare(old: list[dict], new: list[dict], key: list[str], value: list[str]) -> list[tuple[str, str, float, float]]:
    """(row key, value name, old, new) for every row and value present and positive in both."""
    def k(r: dict) -> str:
        return " ".join(str(r.get(c)) for c in key)
    fresh = {k(r): r for r in new}
    out = []
    for r in old:
        n = fresh.get(k(r))
        if n is None:
            continue
        for v in value:
            a, b = number(r.get(v)), number(n.get(v))
            if a is not None and b is not None:
                out.append((k(r), v, a, b))
    return out


def report(pairs: list[tuple[str, str, float, float]], title: str, limit: float) -> str:
    lines = [f"### {title}", "", f"| {title} | value | committed | now | now / committed |", "|---|---|---|---|---|"]
    for key, v, a, b in pairs:
        flag = " **slower**" if b / a > limit else ""
        lines.append(f"| {key} | {v} | {a:g} | {b:g} | {b / a:.3f}{flag} |")
    ratios = [b / a for _, _, a, b in pairs]
    if ratios:
        worst = max(ratios)
        lines += ["", f"{title}: {len(ratios)} figures, median ratio {statistics.median(ratios):.3f}, worst "
                      f"{worst:.3f}, {sum(r <= limit for r in ratios)} of {len(ratios)} within {limit:g}"]
    else:
        lines += ["", f"{title}: no rows matched"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--key", required=True, help="comma-separated fields that name a row")
    ap.add_argument("--value", required=True, help="comma-separated time fields (lower is better)")
    ap.add_argument("--limit", type=float, default=1.05)
    ap.add_argument("--title", default=None)
    ap.add_argument("--md", default=None, help="append the table to this file")
    a = ap.parse_args()
    text = report(compare(rows(a.old), rows(a.new), a.key.split(","), a.value.split(",")),
                  a.title or a.old, a.limit)
    print(text)
    if a.md:
        with open(a.md, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
