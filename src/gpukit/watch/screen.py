"""One screen of ``gpukit top``: a job's ``live.json`` object drawn with rich.

A header (the job, its size, progress, throughput, time left, restarts, newest checkpoint and
the ranks slow now), a table with one row per rank, then the lines to read: notes, nodes not
heard from, and the job's last events. Every field may be missing or of the wrong type (a
launcher of another version, a view cut short): it is then shown as ``-``, never an error.

>>> from gpukit._util.text import render_plain
>>> view = {"name": "gpukit train", "nnodes": 1, "nproc": 1, "step": 3, "total_steps": 10,
...         "ranks": [{"rank": 0, "node": 0, "step": 3, "phase": "forward"}]}
>>> print(render_plain(screen(view, now=0.0), width=100))
gpukit train  1 node x 1 rank  step 3/10 (30%)
- samples/s  ETA -  restarts -  checkpoint -  updated -
node   rank   step   step time   samples/s   phase     data   coll   comp
─────────────────────────────────────────────────────────────────────────
   0      0      3       - / -           -   forward      -      -      -
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, JustifyMethod, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from gpukit._util.text import format_bytes
from gpukit.watch.jobs import number

MISSING = "-"
EVENTS_SHOWN = 5
SLOW_STYLE = "bold red"
# The launcher rewrites its view about once a second: one this old says the launcher is late
# (stuck, or its machine overloaded), and the figures shown are that old.
LATE_S = 5.0

Rank = dict[str, Any]
# One column of the rank table: its header, the cell of a rank, and whether any rank has it.
Column = tuple[str, Callable[[Rank], str], Callable[[Rank], bool]]


def screen(view: dict[str, Any], now: float | None = None) -> RenderableType:
    """The screen for one ``live.json`` object (``now`` for the ages, default the clock)."""
    now = time.time() if now is None else now
    ranks = [r for r in _list(view.get("ranks")) if isinstance(r, dict)]
    slow = _slow_ranks(view)
    parts: list[RenderableType] = [*_header(view, now, slow), RankTable(ranks, slow)]
    below = [*_notes(view, ranks), *_stale_nodes(view)]
    parts += [Text(line, style="yellow") for line in below]
    events = [e for e in _list(view.get("events")) if isinstance(e, dict)][-EVENTS_SHOWN:]
    if events:
        parts.append(Text("last events:", style="bold"))
        parts += [Text(f"  {_event_line(e)}") for e in events]
    return Group(*parts)


class RankTable:
    """One row per rank; the memory and GPU columns only where some rank has a value. The
    ranks in ``slow`` are drawn in red and marked ``slow`` (seen without colour too). On a
    terminal too narrow for every column the last ones are left out, and a line says which,
    rather than every cell being cut to a few letters."""

    def __init__(self, ranks: Sequence[Rank], slow: Collection[int] = ()) -> None:
        self.ranks = sorted(ranks, key=lambda r: _int(r.get("rank"), 1 << 30))
        self.slow = slow
        self.columns = [c for c in _COLUMNS if c[0] in _ALWAYS or any(c[2](r) for r in ranks)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = self.columns
        table = self.table(columns)
        while len(columns) > len(_ALWAYS) and _width(console, options, table) > options.max_width:
            columns = columns[:-1]
            table = self.table(columns)
        yield table
        hidden = [name for name, _, _ in self.columns[len(columns) :]]
        if hidden:
            yield Text(f"(widen the terminal to see {', '.join(hidden)})", style="dim")

    def table(self, columns: Sequence[Column]) -> Table:
        table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for name, _, _ in columns:
            justify: JustifyMethod = "left" if name in _LEFT else "right"
            table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
        for rank in self.ranks:
            cells = [cell(rank) for _, cell, _ in columns]
            style = "dim" if _dead(rank) else None
            if rank.get("rank") in self.slow:
                style, cells[1] = SLOW_STYLE, f"{cells[1]} slow"
            # As Text: a cell is the view's text, never markup ("[/]" in a phase would raise).
            table.add_row(*map(Text, cells), style=style)
        return table


def _width(console: Console, options: ConsoleOptions, table: Table) -> int:
    return Measurement.get(console, options.update(width=1 << 16), table).maximum


# --- the header ----------------------------------------------------------------------------------


def _header(view: dict[str, Any], now: float, slow: set[int]) -> list[Text]:
    nnodes, nproc = view.get("nnodes"), view.get("nproc")
    size = f"{_count(nnodes, 'node')} x {_count(nproc, 'rank')}"
    step, total = number(view.get("step")), number(view.get("total_steps"))
    progress = f"step {_whole(step)}"
    if step is not None and total:
        progress += f"/{_whole(total)} ({100 * step / total:.0f}%)"
    first = Text(f"{view.get('name') or 'gpukit job'}", style="bold")
    first.append(f"  {size}  {progress}")
    updated = number(view.get("updated"))
    figures = [
        f"{_rate(view.get('samples_per_s'))} samples/s",
        f"ETA {_eta(view.get('eta_s'))}",
        f"restarts {_whole(view.get('restarts'))}",
        f"checkpoint {_checkpoint(view.get('checkpoint'))}",
    ]
    second = Text("  ".join(figures))
    if updated is None:
        second.append(f"  updated {MISSING}")
    elif now - updated > LATE_S and not view.get("ended"):
        second.append(f"  updated {_seconds(now - updated)} ago: the launcher is late", "yellow")
    else:
        second.append(f"  updated {_seconds(now - updated)} ago")
    lines = [first, second]
    if view.get("ended"):
        lines.append(Text(f"ended: {_ended(view['ended'])}", style="bold"))
    stragglers = [e for e in _list(view.get("stragglers")) if isinstance(e, dict)]
    if stragglers:
        named = "; ".join(_straggler(e) for e in stragglers)
        lines.append(Text(f"stragglers: {named}", style=SLOW_STYLE))
    elif slow:
        lines.append(Text(f"stragglers: ranks {sorted(slow)}", style=SLOW_STYLE))
    return lines


def _slow_ranks(view: dict[str, Any]) -> set[int]:
    return {
        e["rank"]
        for e in _list(view.get("stragglers"))
        if isinstance(e, dict) and isinstance(e.get("rank"), int)
    }


def _straggler(event: dict[str, Any]) -> str:
    text = f"rank {_whole(event.get('rank'))}"
    if event.get("host") or event.get("node") is not None:
        text += f" (node {_whole(event.get('node'))}, {event.get('host') or MISSING})"
    slowdown = number(event.get("slowdown"))
    if slowdown is not None:
        text += f" {slowdown:.1f}x slower"
    if event.get("phase"):
        text += f", mostly in {event['phase']}"
    return text


def _checkpoint(checkpoint: Any) -> str:
    if not isinstance(checkpoint, dict):
        return MISSING
    return f"step {_whole(checkpoint.get('step'))} ({checkpoint.get('path') or MISSING})"


def _ended(ended: Any) -> str:
    if not isinstance(ended, dict):
        return str(ended)
    at = number(ended.get("time"))
    when = time.strftime("%H:%M:%S", time.localtime(at)) if at is not None else MISSING
    return f"{ended.get('how') or MISSING}, exit code {_whole(ended.get('code'))} at {when}"


# --- the lines under the table -------------------------------------------------------------------


def _notes(view: dict[str, Any], ranks: Sequence[Rank]) -> list[str]:
    """The view's notes, then each rank's GPU note with the ranks that share it. The launcher
    gathers its ranks' notes and its nodes' into the view's: those said there, or by the line
    of a stale node, are not said again."""
    stale = {
        f"node {_whole(node.get('node'))}: {node.get('note')}"
        for node in _list(view.get("nodes"))
        if isinstance(node, dict) and node.get("stale")
    }
    lines = [str(n) for n in _list(view.get("notes")) if n and str(n) not in stale]
    by_note: dict[str, list[str]] = {}
    for rank in ranks:
        if rank.get("gpu_note") and str(rank["gpu_note"]) not in lines:
            by_note.setdefault(str(rank["gpu_note"]), []).append(_whole(rank.get("rank")))
    for note, which in by_note.items():
        lines.append(f"rank{'s' if len(which) > 1 else ''} {', '.join(which)}: {note}")
    return lines


def _stale_nodes(view: dict[str, Any]) -> list[str]:
    lines = []
    for node in _list(view.get("nodes")):
        if isinstance(node, dict) and node.get("stale"):
            line = f"node {_whole(node.get('node'))} ({node.get('host') or MISSING}): no news "
            line += f"for {_seconds(node.get('age_s'))}, its ranks show their last known state"
            if node.get("note"):
                line += f" ({node['note']})"
            lines.append(line)
    return lines


def _event_line(event: dict[str, Any]) -> str:
    at = number(event.get("time"))
    when = time.strftime("%H:%M:%S", time.localtime(at)) if at is not None else MISSING
    kind = str(event.get("kind") or MISSING)
    text = str(event.get("text") or f"rank {_whole(event.get('rank'))}")
    if text.startswith(kind.split("-")[0]):  # "straggler: rank 1 ...": the kind said once
        return f"{when}  {text}"
    return f"{when}  {kind}  {text}"


# --- the rank table's columns --------------------------------------------------------------------


def _step_time(rank: Rank) -> str:
    """``52 / 50 ms``: the last step and the median, the unit said once when they share it."""
    last, median = _seconds(rank.get("step_s")), _seconds(rank.get("step_s_median"))
    unit = median.rpartition(" ")[2]
    if last.endswith(f" {unit}") and unit not in ("", MISSING):
        last = last.rpartition(" ")[0]
    return f"{last} / {median}"


def _phase(rank: Rank) -> str:
    return "exited" if _dead(rank) else str(rank.get("phase") or MISSING)


def _share(name: str) -> Callable[[Rank], str]:
    def cell(rank: Rank) -> str:
        shares = rank.get("shares")
        value = number(shares.get(name)) if isinstance(shares, dict) else None
        return MISSING if value is None else f"{100 * value:.0f}%"

    return cell


def _memory(name: str) -> tuple[Callable[[Rank], str], Callable[[Rank], bool]]:
    def value(rank: Rank) -> float | None:
        memory = rank.get("memory")
        return number(memory.get(name)) if isinstance(memory, dict) else None

    def cell(rank: Rank) -> str:
        found = value(rank)
        return MISSING if found is None or found < 0 else format_bytes(found)

    return cell, lambda rank: (value(rank) or -1) >= 0


def _gpu(show: Callable[[dict[str, Any]], str]) -> tuple[Callable[[Rank], str], Any]:
    def cell(rank: Rank) -> str:
        gpu = rank.get("gpu")
        return show(gpu) if isinstance(gpu, dict) else MISSING

    return cell, lambda rank: isinstance(rank.get("gpu"), dict)


def _gpu_index(gpu: dict[str, Any]) -> str:
    return _whole(gpu.get("index"))


def _util(gpu: dict[str, Any]) -> str:
    util = number(gpu.get("util"))
    return MISSING if util is None else f"{util:.0f}%"


def _power(gpu: dict[str, Any]) -> str:
    used, limit = number(gpu.get("power_w")), number(gpu.get("power_limit_w"))
    if used is None:
        return MISSING
    return f"{used:.0f}/{limit:.0f} W" if limit else f"{used:.0f} W"


def _temperature(gpu: dict[str, Any]) -> str:
    temp = number(gpu.get("temp_c"))
    return MISSING if temp is None else f"{temp:.0f} °C"


def _clock(gpu: dict[str, Any]) -> str:
    clock, top = number(gpu.get("sm_clock_mhz")), number(gpu.get("max_sm_clock_mhz"))
    if clock is None:
        return MISSING
    return f"{clock:.0f}/{top:.0f}" if top else f"{clock:.0f}"


def _throttle(gpu: dict[str, Any]) -> str:
    reasons = gpu.get("throttle")
    if not isinstance(reasons, list):
        return MISSING
    return ", ".join(map(str, reasons)) or "none"


def _rank_cell(rank: Rank) -> str:
    return _whole(rank.get("rank"))


def _always(rank: Rank) -> bool:
    return True


def _field(name: str) -> Callable[[Rank], str]:
    return lambda rank: _whole(rank.get(name))


_COLUMNS: list[Column] = [
    ("node", _field("node"), _always),
    ("rank", _rank_cell, _always),
    ("step", _field("step"), _always),
    ("step time", _step_time, _always),
    ("samples/s", lambda r: _rate(r.get("samples_per_s")), _always),
    ("phase", _phase, _always),
    ("data", _share("data"), _always),
    ("coll", _share("coll"), _always),
    ("comp", _share("compute"), _always),
    ("alloc", *_memory("allocated")),
    ("peak", *_memory("peak")),
    ("reserved", *_memory("reserved")),
    ("rss", *_memory("rss")),
    ("gpu", *_gpu(_gpu_index)),
    ("util", *_gpu(_util)),
    ("power", *_gpu(_power)),
    ("temp", *_gpu(_temperature)),
    ("SM MHz", *_gpu(_clock)),
    ("throttle", *_gpu(_throttle)),
]
_ALWAYS = {"node", "rank", "step", "step time", "samples/s", "phase"}
_LEFT = {"phase", "throttle"}


# --- numbers in words ----------------------------------------------------------------------------


def _dead(rank: Rank) -> bool:
    return rank.get("alive") is False


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any, default: int) -> int:
    found = number(value)
    return int(found) if found is not None else default


def _whole(value: Any) -> str:
    found = number(value)
    return MISSING if found is None else str(int(found))


def _count(value: Any, noun: str) -> str:
    found = number(value)
    if found is None:
        return f"{MISSING} {noun}s"
    return f"{int(found)} {noun}{'' if int(found) == 1 else 's'}"


def _rate(value: Any) -> str:
    found = number(value)
    if found is None:
        return MISSING
    return f"{found:,.0f}" if found >= 100 else f"{found:.1f}"


def _seconds(value: Any) -> str:
    """A short span: ``52 ms``, ``1.25 s``, ``3 min 05 s``."""
    s = number(value)
    if s is None or s < 0:
        return MISSING
    if s < 0.01:
        return f"{s * 1000:.1f} ms"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"
    return _eta(s)


def _eta(value: Any) -> str:
    """Time left: ``45 s``, ``12 min 05 s``, ``3 h 12 min``."""
    s = number(value)
    if s is None or s < 0:
        return MISSING
    whole = round(s)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
