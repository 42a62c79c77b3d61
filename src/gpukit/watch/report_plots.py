"""The figures of ``gpukit report``, each drawn with matplotlib and returned as SVG text to
put inline in the page: text as paths (no font to load), no XML prolog, no DOCTYPE (which
would name a DTD on the web) and no metadata block (which names its vocabularies' web
addresses), so that the page opens offline with nothing outside it.

Each function returns None when its records hold nothing to draw; the page then says why.

>>> svg = loss_curves([{"step": 1.0, "loss": 0.9}, {"step": 2.0, "loss": 0.5}], None)
>>> svg.startswith("<svg") and "<!DOCTYPE" not in svg
True
>>> loss_curves([], None) is None
True
"""

from __future__ import annotations

import io
import re
import statistics
from collections.abc import Callable
from typing import Any

# Markers and colours of the event kinds on the timeline (spec: the launcher's EVENT kinds).
EVENT_STYLES = {
    "restart": ("o", "tab:red"),
    "straggler": ("v", "tab:orange"),
    "straggler-recovered": ("^", "tab:green"),
    "hang": ("X", "tab:purple"),
    "node-lost": ("s", "tab:brown"),
    "ended": ("D", "black"),
}
MiB = 2**20
# Up to this many ranks each gets its line; beyond, the figures draw the median over the ranks
# and the band from the lowest to the highest, which stays readable for 8 ranks or 1,024.
LINES_UP_TO = 8
# Points per line at most: a long run's samples are thinned to these, so that the page stays
# small (each point is a few dozen bytes of SVG) whatever the run's length.
MAX_POINTS = 400


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    """``fig`` as inline SVG, closed after."""
    plt = _pyplot()
    buf = io.StringIO()
    try:
        fig.tight_layout()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    finally:
        plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # the prolog and DOCTYPE go
    # The metadata block names the RDF and Dublin Core vocabularies by their web addresses.
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)


def loss_curves(history: list[dict[str, float]], resumed_from: int | None) -> str | None:
    """Training and validation loss over the optimizer steps (metrics.csv)."""
    rows = [r for r in history if "loss" in r]
    checked = [r for r in history if "val_loss" in r]
    if not rows and not checked:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.4))
    if rows:
        steps, losses = _thin([r["step"] for r in rows], [r["loss"] for r in rows])
        ax.plot(steps, losses, ".-", label="training")
    if checked:
        steps, values = _thin([r["step"] for r in checked], [r["val_loss"] for r in checked])
        ax.plot(steps, values, "o-", label="validation")
    if resumed_from is not None:
        ax.axvline(resumed_from, color="grey", linestyle=":", label="resumed")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    return _svg(fig)


def _per_rank(
    samples: list[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]
) -> dict[int, tuple[list[float], list[float]]]:
    """rank -> (seconds since the first sample, values), where ``value`` knows one."""
    if not samples:
        return {}
    start = min(float(s["time"]) for s in samples)
    series: dict[int, tuple[list[float], list[float]]] = {}
    for sample in samples:
        for rank in sample["ranks"]:
            found = value(rank)
            if found is None:
                continue
            xs, ys = series.setdefault(int(rank["rank"]), ([], []))
            xs.append(float(sample["time"]) - start)
            ys.append(found)
    return series


def _thin(xs: list[float], *columns: list[float]) -> list[list[float]]:
    """``xs`` and ``columns`` with every k-th point kept (and the last), at most
    :data:`MAX_POINTS`."""
    k = max(1, -(-len(xs) // MAX_POINTS))
    keep = sorted(set(range(0, len(xs), k)) | ({len(xs) - 1} if xs else set()))
    return [[c[i] for i in keep] for c in (xs, *columns)]


def _draw_ranks(
    ax: Any,
    series: dict[int, tuple[list[float], list[float]]],
    style: str,
    what: str = "",
    scale: float = 1.0,
) -> None:
    """A line per rank, or the ranks' median and their lowest-to-highest band when there
    are more than :data:`LINES_UP_TO` of them; ``what`` ends each label."""
    suffix = f" {what}" if what else ""
    if len(series) <= LINES_UP_TO:
        for rank, (xs, ys) in sorted(series.items()):
            xs, ys = _thin(xs, [y * scale for y in ys])
            ax.plot(xs, ys, style, label=f"rank {rank}{suffix}")
        return
    at: dict[float, list[float]] = {}
    for xs, ys in series.values():
        for x, y in zip(xs, ys, strict=True):
            at.setdefault(x, []).append(y * scale)
    times = sorted(at)
    middle = [statistics.median(at[t]) for t in times]
    low, high = [min(at[t]) for t in times], [max(at[t]) for t in times]
    times, middle, low, high = _thin(times, middle, low, high)
    ax.plot(times, middle, style, label=f"median of {len(series)} ranks{suffix}")
    ax.fill_between(times, low, high, alpha=0.25, label=f"lowest to highest rank{suffix}")


def _number(record: dict[str, Any], *keys: str) -> float | None:
    value: Any = record
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def throughput(samples: list[dict[str, Any]]) -> str | None:
    """Samples/s and step time per rank over the run (ranks.jsonl).

    >>> ranks = [{"rank": 0, "samples_per_s": 900.0, "step_s_median": 0.07}]
    >>> throughput([{"time": 1.0, "ranks": ranks}, {"time": 2.0, "ranks": ranks}])[:4]
    '<svg'
    """
    rates = _per_rank(samples, lambda r: _number(r, "samples_per_s"))
    steps = _per_rank(samples, lambda r: _number(r, "step_s_median") or _number(r, "step_s"))
    if not rates and not steps:
        return None
    fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(7, 5), sharex=True)
    _draw_ranks(top, rates, ".-")
    top.set_ylabel("samples/s")
    _draw_ranks(bottom, steps, ".-", scale=1e3)
    bottom.set_ylabel("step time (ms)")
    bottom.set_xlabel("seconds since the first sample")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    (top if rates else bottom).legend(loc="upper right", fontsize="small")
    return _svg(fig)


def memory(samples: list[dict[str, Any]]) -> str | None:
    """Each rank's device memory over the run (allocated, peak, reserved; the process's RSS
    where the rank trains on a CPU), in MiB (ranks.jsonl)."""
    kinds = ("allocated", "peak", "reserved", "rss")
    lines = {
        kind: _per_rank(samples, lambda r, k=kind: _number(r, "memory", k))  # type: ignore[misc]
        for kind in kinds
    }
    if not any(lines.values()):
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.4))
    styles = {"allocated": "-", "peak": "--", "reserved": ":", "rss": "-."}
    for kind in kinds:
        _draw_ranks(ax, lines[kind], styles[kind], kind, scale=1 / MiB)
    ax.set_ylabel("MiB")
    ax.set_xlabel("seconds since the first sample")
    ax.legend(loc="upper left", fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    return _svg(fig)


def data_wait(history: list[dict[str, float]], samples: list[dict[str, Any]]) -> str | None:
    """The share of time the steps waited for their batches: metrics.csv's
    ``data_wait_fraction`` per window of steps, and each rank's data share (ranks.jsonl)."""
    rows = [r for r in history if "data_wait_fraction" in r]
    shares = _per_rank(samples, lambda r: _number(r, "shares", "data"))
    if not rows and not shares:
        return None
    panels = int(bool(rows)) + int(bool(shares))
    fig, axes = _pyplot().subplots(panels, 1, figsize=(7, 2.6 * panels))
    axes = list(axes) if panels > 1 else [axes]
    if rows:
        ax = axes.pop(0)
        steps, waited = _thin([r["step"] for r in rows], [r["data_wait_fraction"] for r in rows])
        ax.plot(steps, [100 * w for w in waited], ".-", label="rank 0")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("waiting for data (%)")
        ax.grid(alpha=0.3)
    if shares:
        ax = axes.pop(0)
        _draw_ranks(ax, shares, ".-", scale=100)
        ax.set_xlabel("seconds since the first sample")
        ax.set_ylabel("data share of a step (%)")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    return _svg(fig)


def timeline(events: list[dict[str, Any]], start: float | None) -> str | None:
    """The job's events on one time axis, a row per rank (and one for the whole job): its
    restarts, stragglers and their recoveries, hangs, nodes lost, its end.

    >>> timeline([{"time": 5.0, "kind": "restart", "rank": 1}], start=0.0)[:4]
    '<svg'
    """
    timed = [e for e in events if isinstance(e.get("time"), (int, float))]
    if not timed:
        return None
    origin = start if start is not None else min(float(e["time"]) for e in timed)
    rows = sorted({e["rank"] for e in timed if isinstance(e.get("rank"), int)})
    y_of = {rank: i + 1 for i, rank in enumerate(rows)}
    fig, ax = _pyplot().subplots(figsize=(7, 1.4 + 0.45 * (len(rows) + 1)))
    drawn: set[str] = set()
    for event in timed:
        kind = str(event.get("kind"))
        marker, colour = EVENT_STYLES.get(kind, ("*", "tab:gray"))
        rank = event.get("rank")
        y = y_of.get(rank, 0) if isinstance(rank, int) else 0
        label = kind if kind not in drawn else None
        drawn.add(kind)
        # A hang and the restart after it fall on one point: the restart's disc goes under.
        layer = 2 if kind == "restart" else 3
        ax.scatter(
            [float(event["time"]) - origin],
            [y],
            marker=marker,
            c=colour,
            s=70,
            label=label,
            zorder=layer,
        )
    ax.set_yticks(range(len(rows) + 1), ["job", *[f"rank {r}" for r in rows]])
    ax.set_ylim(-0.6, len(rows) + 0.6)
    ax.set_xlabel("seconds since the start")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(alpha=0.3, axis="x")
    return _svg(fig)
