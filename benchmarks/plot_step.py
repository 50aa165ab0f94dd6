#!/usr/bin/env python
"""The README's whole-step figure and table (issue 39 item 3), from the raw result files (``_table_step.SPECS``).

    python3 -m pip install -e ".[bench]"          # matplotlib, for the figure only
    python3 benchmarks/plot_step.py               # writes docs/step_vs_trl114.png
    python3 benchmarks/plot_step.py --table       # prints the README's block (paste between its markers)

Per configuration, the package's step time and peak memory per rank as a ratio to TRL 1.14's, a line at 1.0. The
figure's numbers are also written into the PNG (its ``Description`` text chunk), so that
``tests/test_bench_tables.py`` can tell a stale figure without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _table_step  # noqa: E402

ROOT = HERE.parent
TIME, PEAK = "#3b6ea8", "#e08a2c"


def draw(data: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.95 * n + 1.5), 5.2), dpi=110)
    width = 0.38
    top = max(1.3, max(max(d["time"], d["peak"]) for d in data) + 0.25)
    for i, d in enumerate(data):
        older = bool(d["note"])  # a row that predates the current package: hatched
        for dx, key, color in ((-width / 2, "time", TIME), (width / 2, "peak", PEAK)):
            ax.bar(i + dx, d[key], width, color=color, alpha=0.55 if older else 1.0, hatch="//" if older else None,
                   edgecolor="white" if not older else color, linewidth=0.6)  # fmt: skip
            ax.annotate(f"{d[key]:.2f}", (i + dx, d[key]), xytext=(0, 1.5), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7.5)  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=1.2, zorder=0)
    ax.text(n - 0.45, 1.0, " TRL 1.14", va="center", ha="left", fontsize=9)
    ax.set_xticks(range(n))
    ax.set_xticklabels([_tick(d) for d in data], fontsize=8.5)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top)
    ax.set_ylabel("the package ÷ TRL 1.14  (below 1: better)")
    ax.set_title("One whole DDP step, 2 ranks, V=151,936, 50 % prompt: time and peak memory per rank vs TRL 1.14",
                 fontsize=10.5)  # fmt: skip
    ax.grid(axis="y", color="#dddddd", linewidth=0.6, zorder=-1)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=TIME), plt.Rectangle((0, 0), 1, 1, color=PEAK)]
    labels = ["step time", "peak memory per rank"]
    notes = dict.fromkeys(f"{d['machine']}, {d['date']}: {d['note']}" for d in data if d["note"])
    if notes:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray", hatch="//"))
        labels.append("\n".join(notes))
    ax.legend(handles, labels, loc="upper left", fontsize=8.5, frameon=False)
    fig.tight_layout()
    metadata = {"Description": json.dumps(data), "Title": "benchmarks/plot_step.py"}
    fig.savefig(path, metadata=metadata)
    plt.close(fig)


def _tick(d: dict) -> str:
    """``CPU mixed DPO L=2,048`` -> three short lines under its bars."""
    setup, trainer = d["label"].split(" L=")[0].rsplit(" ", 1)
    return f"{setup}\n{trainer}\nL={d['label'].split(' L=')[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="print the README's table block instead")
    ap.add_argument("--out", default=str(ROOT / _table_step.FIGURE), help="the PNG (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.table:
        print(_table_step.table())
        return 0
    draw(_table_step.figure_data(), Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
