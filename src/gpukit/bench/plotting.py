"""The experiments' plots: one look for all (labelled axes with units, a grid, a legend, a
title that says what and where), written as PNG files with matplotlib's file-only backend.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "demo.png"
>>> with figure(path, "demo", "size (elements)", "time (ms)", logx=True) as ax:
...     _ = ax.plot([1, 10, 100], [1, 2, 3], marker="o", label="cpu")
>>> path.stat().st_size > 1000
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpukit._util.files import replaced


@contextlib.contextmanager
def figure(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    *,
    logx: bool = False,
    logy: bool = False,
    size: tuple[float, float] = (7.5, 4.5),
) -> Iterator[Any]:
    """Yield the axes of a new figure; on leaving, label it and save it to ``path``.

    A legend is drawn when anything plotted has a label. The figure is closed even when the
    block fails, so a failed plot leaves no figure behind in a long run.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=11)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        with replaced(path) as temporary:
            fig.savefig(temporary, dpi=120, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)


def bar_labels(ax: Any, bars: Any, fmt: str = "{:.3g}") -> None:
    """Write each bar's value above it, so a reader needs no ruler."""
    for bar in bars:
        height = bar.get_height()
        ax.annotate(
            fmt.format(height),
            (bar.get_x() + bar.get_width() / 2, height),
            ha="center",
            va="bottom",
            fontsize=7,
        )


def size_axes(ax: Any, sizes: Sequence[int], labels: Sequence[str]) -> None:
    """Log axes for a sweep over sizes, once its lines are drawn: x in powers of two with a
    tick at each size; y in decades labelled as plain numbers (0.5, 20; not 5×10⁻¹), and at
    2 and 5 times them when the lines span less than two decades.

    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> _ = ax.plot([16, 32], [0.5, 2.0])
    >>> size_axes(ax, [16, 32], ["16", "32"])
    >>> ax.yaxis.get_major_formatter()(0.1), ax.get_xscale()
    ('0.1', 'log')
    >>> plt.close(fig)
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), list(labels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:.12g}" if value >= 1e-4 else f"{value:.0e}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    if high < 100 * low:
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())
