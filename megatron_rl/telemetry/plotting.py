"""PNG figures of a run's (or several runs') metrics from their metrics.jsonl files."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PANELS = (
    ("reward/mean", "reward"),
    ("entropy", "entropy"),
    ("clip/low_neg", "lower-clip fraction, A<0"),
    ("clip/high_pos", "upper-clip fraction, A>0"),
)


def moving_average(values, window: int) -> list[float]:
    """Trailing mean over `window` points (shorter at the start): the trend under per-step noise."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def surge_spans(records: list[dict]) -> list[tuple[int, int]]:
    """(first, last) step of each run of consecutive records with health/surge == 1."""
    spans: list[tuple[int, int]] = []
    open_span = False
    for r in records:
        surging = bool(r.get("health/surge"))
        if surging and open_span:
            spans[-1] = (spans[-1][0], r["step"])
        elif surging:
            spans.append((r["step"], r["step"]))
        open_span = surging
    return spans


def _mark_surges(ax, records: list[dict], color) -> None:
    """Entropy panel: shade the steps in a surge (health/surge) and a dashed line at the first
    surge's onset (health/surge_step; docs/health.md)."""
    for first, last in surge_spans(records):
        ax.axvspan(first, last, color=color, alpha=0.12, linewidth=0)
    onset = next((r["health/surge_step"] for r in records if r.get("health/surge_step") is not None), None)
    if onset is not None:
        ax.axvline(onset, color=color, linestyle="--", linewidth=1.0)


def plot_runs(runs: dict[str, list[dict]], out_png: str | Path,
              panels: tuple[tuple[str, str], ...] = DEFAULT_PANELS, title: str = "") -> Path:
    """One panel per metric, one run per color: raw values faint, their moving average bold.
    `runs` maps a label to its JSONL records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label) in zip(axes.flat, panels):
        for i, (name, records) in enumerate(runs.items()):
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not pts:
                continue
            steps, values = zip(*pts)
            color = colors[i % len(colors)]
            ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.35)
            ax.plot(steps, moving_average(values, max(1, len(values) // 10)), color=color,
                    linewidth=1.8, label=name)
            if key == "entropy":
                _mark_surges(ax, records, color)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
