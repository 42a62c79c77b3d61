"""``report.md``: the results of ``gpukit bench all`` in one page, tying each experiment's
table, headline figures, plot and JSON together, with the machine and the command on top.

>>> from gpukit.bench.result import BenchResult, Column
>>> r = BenchResult("demo", "A demo", ("n",), (Column("n"), Column("ms", "time", "ms", 1)),
...     [{"n": 16, "ms": 2.0}], summary={"best": 2.0})
>>> print(markdown_table(r))
| n | time (ms) |
| --- | --- |
| 16 | 2.0 |
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpukit._util.files import write_atomic
from gpukit.bench.result import BenchResult, format_value
from gpukit.bench.suite import Outcome, experiment


def markdown_table(result: BenchResult) -> str:
    """The result's rows as a Markdown table."""
    lines = [
        "| " + " | ".join(c.title for c in result.columns) + " |",
        "| " + " | ".join("---" for _ in result.columns) + " |",
    ]
    for row in result.rows:
        cells = [result.cell(row, c).replace("|", "\\|") for c in result.columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(
    folder: Path, outcomes: Sequence[Outcome], command: str, quick: bool, minutes: float
) -> Path:
    """Write ``report.md`` in ``folder`` from the outcomes of one ``bench all``; its path."""
    env = next((o.result.environment for o in outcomes if o.result is not None), {})
    lines = [
        "# gpukit bench all" + (" --quick" if quick else ""),
        "",
        _machine(env),
        "",
        f"Command: `{command}`, {minutes:.1f} minutes.",
        "",
        "| experiment | what it answers | headline | files |",
        "| --- | --- | --- | --- |",
    ]
    for o in outcomes:
        lines.append(
            f"| [{o.name}](#{o.name}) | {_title(o.name)} | {_headline(o)} | "
            + ", ".join(f"[{p.name}]({p.name})" for p in o.files)
            + " |"
        )
    for o in outcomes:
        lines += ["", f"## {o.name}", "", _title(o.name), ""]
        if o.result is None:
            lines += ["**Failed:**", "", "```", (o.error or "").rstrip(), "```"]
            continue
        png = folder / f"{o.name}.png"
        if png in o.files:
            lines += [f"![{o.name}]({png.name})", ""]
        elif o.plot_error:
            lines += [f"(no plot: {o.plot_error})", ""]
        lines += [f"**{o.result.title}**", "", markdown_table(o.result), ""]
        lines += [f"- {k}: {format_value(v, 3)}" for k, v in o.result.summary.items()]
        lines += [f"- {note}" for note in o.result.notes]
    path = folder / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _title(name: str) -> str:
    return str(getattr(experiment(name), "TITLE", name))


def _headline(outcome: Outcome) -> str:
    if outcome.result is None:
        return "**failed**: " + (outcome.error or "").splitlines()[0]
    items = list(outcome.result.summary.items())[:3]
    return "; ".join(f"{k}: {format_value(v, 3)}" for k, v in items).replace("|", "\\|") or "-"


def _machine(env: dict[str, Any]) -> str:
    devices = env.get("devices") or []
    gpus = [d["name"] for d in devices if str(d.get("device", "")).startswith("cuda")]
    return (
        f"Machine: {env.get('cpu', '?')} ({env.get('cpu_cores', '?')} cores); "
        f"GPUs: {', '.join(gpus) or 'none'}; torch {env.get('torch', '?')} "
        f"(CUDA {env.get('cuda') or '-'}); Python {env.get('python', '?')}; "
        f"gpukit {env.get('gpukit', '?')}; {env.get('date', '?')}."
    )
