"""The HTML of ``gpukit report``: one self-contained page (styles inline, figures as inline
SVG, no script, no link to anything outside it), so that it opens from a laptop's disk, a
mail attachment or a cluster's shared folder alike. Every value from the run's files is
escaped; a section whose records are missing says so, and why, instead of vanishing.

>>> from pathlib import Path
>>> run = RunRecords(folder=Path("runs/mlp"), status="finished", status_why="metrics.json")
>>> page = render(run, {}, PlanCheck(why="no metrics.json"))
>>> page.startswith("<!DOCTYPE html>") and "runs/mlp" in page
True
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpukit._util.text import format_bytes
from gpukit.watch.plan_check import PlanCheck
from gpukit.watch.run_records import RunRecords, newest_checkpoint

# A trace JSON larger than this is named, not read (a long trace holds every op's record).
TRACE_READ_LIMIT = 20 * 2**20

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 72em;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
th { background: #f4f4f4; }
figure { margin: 0.5em 0; } figure svg { max-width: 100%; height: auto; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
.missing { color: #777; font-style: italic; }
.status-finished { color: #176b2c; } .status-running { color: #1b4f9c; }
.status-failed { color: #a31515; } .status-stopped { color: #8a5a00; }
.sub { color: #666; font-size: 0.9em; }
"""


def e(value: object) -> str:
    """``value`` as text safe inside HTML.

    >>> e("<b>loss & 'val'</b>")
    '&lt;b&gt;loss &amp; &#x27;val&#x27;&lt;/b&gt;'
    """
    return html.escape(str(value), quote=True)


def _table(header: Sequence[str] | None, rows: Iterable[Sequence[object]], id_: str = "") -> str:
    head = "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    ident = f' id="{e(id_)}"' if id_ else ""
    return f"<table{ident}>{head}{body}</table>"


def _missing(text: str) -> str:
    return f'<p class="missing">{e(text)}</p>'


def _figure(name: str, svg: str | None, caption: str, missing: str) -> str:
    if svg is None:
        return _missing(missing)
    return f'<figure id="{e(name)}">{svg}<figcaption class="sub">{e(caption)}</figcaption></figure>'


def _number(value: object, digits: str = ".4f") -> str:
    return format(value, digits) if isinstance(value, (int, float)) else "-"


def headline(run: RunRecords) -> list[tuple[str, str]]:
    """The run at a glance: (name, value) rows."""
    m = run.metrics or {}
    s = run.settings or {}
    steps = m.get("steps")
    if steps is None and run.history:
        steps = int(max(r["step"] for r in run.history))
    asked = s.get("max_steps")
    losses = [r["loss"] for r in run.history if "loss" in r]
    final = m.get("final_loss", losses[-1] if losses else None)
    devices = m.get("devices") or ([s["devices"]] if s.get("devices") else [])
    restarts = sum(1 for ev in run.events if ev.get("kind") == "restart")
    rows = [
        ("workload", run.workload or "-"),
        ("strategy", str(m.get("strategy") or s.get("strategy") or "-")),
        ("devices", ", ".join(str(d) for d in devices) or "-"),
        ("ranks", str(m.get("world_size") or len(run.ranks) or "-")),
        ("steps", f"{steps if steps is not None else '-'}" + (f" of {asked}" if asked else "")),
        ("final loss", _number(final)),
        ("final validation loss", _number(m.get("final_val_loss"))),
        ("samples/s", _number(m.get("samples_per_s"), ".1f")),
        ("restarts", str(restarts)),
        ("status", run.status),
    ]
    return rows


def render(run: RunRecords, figures: Mapping[str, str | None], checked: PlanCheck) -> str:
    """The whole page for ``run``, with ``figures`` (name -> SVG or None, see
    :mod:`gpukit.watch.report_plots`) and the plan's comparison ``checked``."""
    made = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gpukit report: {e(run.folder)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>gpukit report: {e(run.workload or run.folder.name)}</h1>",
        f'<p class="sub">{e(run.folder)} &middot; written {e(made)}</p>',
        _headline_section(run),
        _notes_section(run),
        "<h2>Loss</h2>",
        _figure(
            "loss",
            figures.get("loss"),
            "training loss at each read-back, validation loss at each pass (metrics.csv)",
            "no loss recorded: metrics.csv is missing or holds no loss yet",
        ),
        "<h2>Throughput and step time per rank</h2>",
        _figure(
            "throughput",
            figures.get("throughput"),
            "samples/s and median step time of each rank (ranks.jsonl)",
            _no_ranks(run),
        ),
        "<h2>Memory per device</h2>",
        _figure(
            "memory",
            figures.get("memory"),
            "each rank's device memory (allocated, peak, reserved; RSS on a CPU), ranks.jsonl",
            _no_ranks(run),
        ),
        _memory_table(run),
        "<h2>Waiting for data</h2>",
        _figure(
            "data-wait",
            figures.get("data_wait"),
            "share of time the steps waited for their batches",
            "no data wait recorded: metrics.csv has no data_wait_fraction and there are no "
            "per-rank records",
        ),
        _events_section(run, figures.get("timeline")),
        _plan_section(checked),
        _settings_section(run),
        _profiles_section(run),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def _headline_section(run: RunRecords) -> str:
    rows = "".join(
        f"<tr><th>{e(name)}</th><td"
        + (f' class="status-{e(value)}"' if name == "status" else "")
        + f">{e(value)}</td></tr>"
        for name, value in headline(run)
    )
    newest = newest_checkpoint(run)
    saved = f"newest checkpoint: {newest}" if newest else "no checkpoint"
    # How a run ended is mostly said starting with its status ("failed: boom", "finished"):
    # the status is put in front only where the words do not already begin with it.
    why = run.status_why
    ended = why if why.startswith(run.status) else f"{run.status}: {why}"
    return f'<table id="headline">{rows}</table><p class="sub">{e(ended)}; {e(saved)}</p>'


def _notes_section(run: RunRecords) -> str:
    notes = list(run.notes)
    for name, count in sorted(run.skipped.items()):
        notes.append(f"{name}: {count} line(s) that did not parse were skipped")
    if run.metrics is None:
        notes.append(
            "no metrics.json: the run has not finished (or did not finish); the figures show "
            "what it recorded as it went"
        )
    if not notes:
        return ""
    items = "".join(f"<li>{e(n)}</li>" for n in notes)
    return f'<ul id="notes">{items}</ul>'


def _no_ranks(run: RunRecords) -> str:
    if (run.folder / "ranks.jsonl").exists():
        return "ranks.jsonl holds no sample yet"
    return (
        "no per-rank records (ranks.jsonl): this run was one process, not under gpukit's "
        "launcher (gpukit train runs several devices, --max-restarts or --hang-timeout there)"
    )


def _memory_table(run: RunRecords) -> str:
    rows = ((run.metrics or {}).get("memory") or {}).get("devices") or []
    if not rows:
        return ""
    body = [
        (
            r.get("device", "-") + (f" (rank {r['rank']})" if r.get("rank") is not None else ""),
            format_bytes(r.get("allocated")),
            format_bytes(r.get("reserved")),
            format_bytes(r.get("peak")),
            format_bytes(r.get("peak_tensors")),
            format_bytes(r.get("total")),
        )
        for r in rows
    ]
    header = ("device", "allocated", "reserved", "peak", "peak tensors", "total")
    return '<p class="sub">At the end (metrics.json):</p>' + _table(header, body, "memory-end")


def _events_section(run: RunRecords, svg: str | None) -> str:
    parts = ["<h2>Restarts, stragglers and hangs</h2>"]
    if not run.events:
        why = (
            "events.jsonl holds no event"
            if (run.folder / "events.jsonl").exists()
            else "no events.jsonl: this run was not under gpukit's launcher, or it predates it"
        )
        return parts[0] + _missing(why)
    start = min((float(s["time"]) for s in run.samples), default=None)
    parts.append(_figure("timeline", svg, "the job's events over time", "no timed event"))
    origin = start if start is not None else min(float(ev.get("time", 0)) for ev in run.events)
    rows = [
        (
            f"{float(ev['time']) - origin:.1f}"
            if isinstance(ev.get("time"), (int, float))
            else "-",
            *(_or_dash(ev.get(k)) for k in ("kind", "attempt", "step", "rank", "host")),
            ev.get("text") or "",
        )
        for ev in run.events
    ]
    header = ("seconds", "kind", "attempt", "step", "rank", "host", "what was said")
    parts.append(_table(header, rows, "events"))
    for ev in run.events:
        if ev.get("report"):
            title = f"{ev.get('kind', 'event')} report (attempt {ev.get('attempt', '-')})"
            parts.append(f"<h3>{e(title)}</h3><pre>{e(ev['report'])}</pre>")
    return "\n".join(parts)


def _or_dash(value: object) -> object:
    return "-" if value is None else value


def _plan_section(checked: PlanCheck) -> str:
    head = "<h2>The plan against what was measured</h2>"
    if not checked.rows:
        return head + _missing(f"not planned: {checked.why}")
    rows = []
    for c in checked.rows:
        show = format_bytes if c.unit == "bytes" else _seconds
        ratio = f"{c.ratio:.2f}x" if c.ratio is not None else "-"
        rows.append((c.what, show(c.planned), show(c.measured), ratio, c.note))
    notes = "".join(f"<li>{e(n)}</li>" for n in checked.notes)
    return (
        head
        + f'<p class="sub">planned: {e(checked.planned_for)}</p>'
        + _table(("", "planned", "measured", "measured / planned", "measured as"), rows, "plan")
        + (f'<ul class="sub">{notes}</ul>' if notes else "")
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def _settings_section(run: RunRecords) -> str:
    head = "<h2>Settings</h2>"
    if run.settings:
        rows = [(k, _flat(v)) for k, v in run.settings.items()]
        note = '<p class="sub">config.toml: gpukit train --config it trains the run again</p>'
        return head + note + _table(("flag", "value"), rows, "settings")
    config = (run.metrics or {}).get("config")
    if config:
        runtime = config.get("runtime") or {}
        rows = [(k, _flat(v)) for k, v in config.items() if k != "runtime"]
        rows += [(f"runtime.{k}", _flat(v)) for k, v in runtime.items()]
        return head + _table(("setting", "value"), rows, "settings")
    return head + _missing("no config.toml and no metrics.json: the settings are not known")


def _flat(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _profiles_section(run: RunRecords) -> str:
    head = "<h2>Trace and profile</h2>"
    if not run.profiles:
        return head + _missing(
            "no trace or profile files in the folder (gpukit trace --out FILE, "
            "gpukit trace --profile DIR or rt.profile(DIR) write them)"
        )
    parts = [head]
    for path in run.profiles:
        rel = path.relative_to(run.folder)
        size = format_bytes(path.stat().st_size)
        if path.name.endswith("summary.txt"):
            text = path.read_text(errors="replace")[:20000]
            parts.append(f"<h3>{e(rel)}</h3><pre>{e(text)}</pre>")
        elif path.name.endswith(".pt.trace.json"):
            parts.append(
                f"<p>{e(rel)} ({e(size)}): open it in ui.perfetto.dev or chrome://tracing</p>"
            )
        else:
            parts.append(f"<p>{e(rel)} ({e(size)}): {e(_trace_findings(path))}</p>")
    return "\n".join(parts)


def _trace_findings(path: Path) -> str:
    """What a ``gpukit trace --out FILE`` JSON holds, counted: its copies, its host reads
    that wait for the device, its ops per device (``gpukit trace`` ranks them, with fixes)."""
    if path.stat().st_size > TRACE_READ_LIMIT:
        return "too large to read here: gpukit trace prints its findings"
    try:
        data = json.loads(path.read_text())
        copies = sum(int(t["count"]) for t in data["transfers"])
        reads = sum(int(s["count"]) for s in data["syncs"])
        lines = len(data["transfers"]), len(data["syncs"])
        ops = ", ".join(f"{d}: {n}" for d, n in data.get("ops_per_device", {}).items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "not a trace gpukit trace wrote"
    return (
        f"gpukit trace: {copies} host-device copies ({lines[0]} kind(s) and line(s)), "
        f"{reads} host reads that wait for the device ({lines[1]} op(s) and line(s)); ops "
        f"per device: {ops or '-'}"
    )
