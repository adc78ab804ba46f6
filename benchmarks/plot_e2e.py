"""The e2e suite's stage breakdown as a stacked-bar PNG (docs/performance.md section 7).

    python -m benchmarks.plot_e2e RESULT.json [RESULT.json ...] --out docs/img/e2e-stages.png

One pair of bars per JSON (a shape): its first iteration and its median steady one (by length), each split into
the suite's stages, grouped as the section's table groups them. Reads only the JSON the suite wrote
(`suites.e2e.data`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# Stage groups, in the order an iteration runs them; the rest of the suite's stages fall in "other".
GROUPS: dict[str, tuple[str, ...]] = {
    "generate": ("generate",),
    "train": ("train",),
    "sync": ("sync",),
    "parity": ("parity",),
    "engine release / resume": ("engine_release", "engine_resume_weights", "engine_resume_kv"),
    "trainer onload / offload": ("trainer_onload", "trainer_offload"),
}
OTHER = "persist / load / reward / other"
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#999999"]


@dataclass(frozen=True)
class Bar:
    label: str
    seconds: dict[str, float]  # group -> seconds, OTHER included

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def grouped(stage_seconds: dict[str, float], iteration_s: float) -> dict[str, float]:
    """Stage seconds summed into GROUPS; OTHER is what the iteration took beyond the grouped stages (the named small
    stages and the time between them), so the bar's length is the iteration's."""
    out = {group: sum(stage_seconds.get(s, 0.0) for s in stages) for group, stages in GROUPS.items()}
    out[OTHER] = max(0.0, iteration_s - sum(out.values()))
    return out


def bars_of(result: dict) -> list[Bar]:
    """The first and the median steady iteration of one e2e JSON."""
    suite = result["suites"]["e2e"]
    runs = suite["data"]["iterations"]
    if not runs:
        raise ValueError(f"{suite['params'].get('shape')}: no finished iteration in this JSON")
    shape = suite["params"].get("shape", "?")
    bars = [Bar(f"{shape} first", grouped(runs[0]["seconds"], runs[0]["iteration_s"]))]
    steady = runs[1:]
    if steady:
        # one real iteration (per-stage medians need not add up to the median iteration): the median by length,
        # the shorter of the middle two when there are even many
        middle = statistics.median_low(r["iteration_s"] for r in steady)
        run = next(r for r in steady if r["iteration_s"] == middle)
        bars.append(Bar(f"{shape} steady", grouped(run["seconds"], run["iteration_s"])))
    return bars


def plot(bars: list[Bar], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*GROUPS, OTHER]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(bars) + 1.6))
    labels = [b.label for b in bars][::-1]  # first bar on top
    left = [0.0] * len(bars)
    for group, colour in zip(groups, COLOURS):
        widths = [b.seconds[group] for b in bars][::-1]
        ax.barh(labels, widths, left=left, color=colour, label=group)
        left = [a + w for a, w in zip(left, widths)]
    for y, bar in enumerate(bars[::-1]):
        ax.text(bar.total, y, f" {bar.total:.1f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds per iteration")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(b.total for b in bars) * 1.12)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(bars) < 4 else -0.2))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="e2e suite JSON files, one per shape")
    ap.add_argument("--out", type=Path, default=Path("docs/img/e2e-stages.png"))
    ap.add_argument("--title", default="one colocated RL iteration by stage (first and median steady)")
    args = ap.parse_args(argv)
    bars = [bar for path in args.results for bar in bars_of(json.loads(path.read_text()))]
    plot(bars, args.out, args.title)
    for bar in bars:
        parts = ", ".join(f"{g} {s:.2f}" for g, s in bar.seconds.items())
        print(f"{bar.label}: {bar.total:.2f} s ({parts})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
