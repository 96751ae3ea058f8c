"""PNG figures of a run's (or several runs') metrics from their metrics.jsonl files."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PANELS = (
    ("reward/mean", "reward"),
    ("entropy", "entropy"),
    ("clip/low_neg", "lower-clip fraction, A<0"),
    ("clip/high_pos", "upper-clip fraction, A>0"),
)


def plot_runs(runs: dict[str, list[dict]], out_png: str | Path,
              panels: tuple[tuple[str, str], ...] = DEFAULT_PANELS, title: str = "") -> Path:
    """One panel per metric, one line per run. `runs` maps a label to its JSONL records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for name, records in runs.items():
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=name, linewidth=1.4)
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
