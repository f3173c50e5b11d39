"""Plot helpers for the benchmark scripts (matplotlib, headless); the PNGs go into docs/images/."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

DPI = 220  # 2x: sharp on high-resolution screens (the docs show them at half their pixel width)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("--plot needs matplotlib: pip install -e '.[docs]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_outputs(
    result: dict, json_path: str | None, plot_path: str | None, plot: Callable[[dict, str], None]
) -> None:
    """The scripts' --json / --plot: the result as JSON (docs/data/ renders tables from it), a PNG."""
    if json_path:
        from ssmspec.bench import write_json

        write_json(result, json_path)
    if plot_path:
        plot(result, plot_path)


def _title(text: str) -> str:
    return "\n".join(textwrap.fill(line, 72) for line in text.splitlines())


def line_plot(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    hline: float | None = None,
    points: dict[str, tuple[float, float]] | None = None,
    levels: dict[str, float] | None = None,
) -> None:
    """One line per series ({label: (xs, ys)}), an optional horizontal reference, labelled anchor points (only
    where the anchor reported a value at that x) and labelled levels (anchors reported without an x)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=DPI)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3.5, label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
    for label, (x, y) in (points or {}).items():
        ax.plot([x], [y], marker="*", markersize=11, linestyle="none", label=label)
    for i, (label, y) in enumerate((levels or {}).items()):
        ax.axhline(y, color=f"C{len(series) + i + 2}", linewidth=1.0, linestyle=":", label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_title(_title(title), fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bar_plot(
    path: str | Path, values: dict[str, float], *, title: str, ylabel: str, hline: float | None = None
) -> None:
    """One horizontal bar per entry (readable names however many), value printed at its end."""
    plt = _pyplot()
    names = list(values)[::-1]  # first entry on top
    fig, ax = plt.subplots(figsize=(7.2, 1.2 + 0.24 * len(names)), dpi=DPI)
    bars = ax.barh(names, [values[n] for n in names], color="#4c72b0")
    for bar, name in zip(bars, names):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {values[name]:.2f}", va="center", fontsize=7)
    if hline is not None:
        ax.axvline(hline, color="grey", linewidth=0.8, linestyle="--")
    fig.suptitle(_title(title), fontsize=9)
    ax.set_xlabel(ylabel)
    ax.tick_params(axis="y", labelsize=7)
    ax.margins(x=0.12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
