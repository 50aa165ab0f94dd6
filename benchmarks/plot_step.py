#!/usr/bin/env python
"""The README's whole-step figure and table (issue 39 item 3), from the raw result files (``_table_step.SPECS``).

    python3 -m pip install -e ".[bench]"          # matplotlib, for the figure only
    python3 benchmarks/plot_step.py               # writes docs/step_vs_upgrades.png
    python3 benchmarks/plot_step.py --table       # prints the README's block (paste between its markers)

Per configuration, the package's step time (top) and peak memory per rank (bottom) as a ratio to each upgrade's
(TRL 1.14, TRL 1.16: ``_upgrades.UPGRADES``), a line at 1.0. The
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
COLORS = ("#3b6ea8", "#e08a2c", "#5a9e4b", "#8c5aa8")  # one per upgrade, oldest first


def draw(data: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data)
    upgrades = list(dict.fromkeys(u for d in data for u in d["ratios"]))  # oldest first, as _upgrades lists them
    width = 0.8 / len(upgrades)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.0 * n + 1.5), 8.4), dpi=110, sharex=True)
    for ax, key, what in zip(axes, ("time", "peak"), ("step time", "peak memory per rank")):
        values = [d["ratios"][u][key] for d in data for u in d["ratios"]]
        for j, upgrade in enumerate(upgrades):
            for i, d in enumerate(data):
                if upgrade not in d["ratios"]:
                    continue
                older = bool(d["note"])  # a row that predates the current package: hatched
                x, y = i + (j - (len(upgrades) - 1) / 2) * width, d["ratios"][upgrade][key]
                ax.bar(x, y, width, color=COLORS[j % len(COLORS)], alpha=0.55 if older else 1.0,
                       hatch="//" if older else None, edgecolor="white" if not older else COLORS[j % len(COLORS)],
                       linewidth=0.6, label=upgrade if i == 0 else None)  # fmt: skip
                ax.annotate(f"{y:.2f}", (x, y), xytext=(0, 1.5), textcoords="offset points", ha="center",
                            va="bottom", fontsize=6.5)  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1.2, zorder=0)
        ax.set_ylim(0, max(1.3, max(values) + 0.2))
        ax.set_ylabel(f"{what}: the package ÷ the upgrade\n(below 1: better)", fontsize=9)
        ax.grid(axis="y", color="#dddddd", linewidth=0.6, zorder=-1)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_title("One whole DDP step, 2 ranks, V=151,936, 50 % prompt: the package against each upgrade",
                      fontsize=10.5)  # fmt: skip
    axes[1].set_xticks(range(n))
    axes[1].set_xticklabels([_tick(d) for d in data], fontsize=8.5)
    axes[1].set_xlim(-0.6, n - 0.4)
    handles, labels = axes[0].get_legend_handles_labels()
    notes = dict.fromkeys(f"{d['machine']}, {d['date']}: {d['note']}" for d in data if d["note"])
    if notes:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray", hatch="//"))
        labels.append("\n".join(notes))
    axes[0].legend(handles, labels, loc="upper left", fontsize=8.5, frameon=False)
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
    ap.add_argument("--table", action="store_true", help="print the README's two table blocks instead")
    ap.add_argument("--out", default=str(ROOT / _table_step.FIGURE), help="the PNG (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.table:
        print(_table_step.table(), _table_step.sim_table(), sep="\n\n")
        return 0
    draw(_table_step.figure_data(), Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
