"""One experiment's result, as every ``gpukit bench`` experiment reports it: a table for people,
a JSON file for records and for ``gpukit bench compare``.

A result is rows of values under named columns. Some columns are *keys* (what was measured:
device, dtype, size, variant), the others are *measurements* (seconds, GB/s, ratios); two runs
are compared row by row on their keys. Each result also carries the machine and the command
(``environment``), the parameters the run used, a few headline figures (``summary``), notes
that say how to read it, and the raw timings behind every median (``raw``).

>>> r = BenchResult("demo", "A demo", keys=("size",), columns=(Column("size"),
...     Column("ms", "time", "ms", 3)), rows=[{"size": 16, "ms": 0.0123}])
>>> r.cell(r.rows[0], r.columns[1])
'0.012'
>>> BenchResult.from_dict(r.to_dict()).rows == r.rows
True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from gpukit._util.files import write_atomic
from gpukit._util.text import make_table
from gpukit.errors import ConfigError

SCHEMA = 1  # bumped when a field changes meaning; compare refuses mixed schemas


@dataclass(frozen=True)
class Column:
    """A column: ``key`` in each row, its ``header`` in the table, the ``unit`` of its values,
    the digits after the point to print (None: print as it is), and whether ``gpukit bench
    compare`` sets two runs' values side by side (off for spreads and other detail)."""

    key: str
    header: str = ""
    unit: str = ""
    digits: int | None = None
    compare: bool = True

    @property
    def title(self) -> str:
        """The table's header: the header (or key) and the unit.

        >>> Column("bw", "bandwidth", "GB/s").title
        'bandwidth (GB/s)'
        """
        name = self.header or self.key
        return f"{name} ({self.unit})" if self.unit else name

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "header": self.header,
            "unit": self.unit,
            "digits": self.digits,
            "compare": self.compare,
        }


@dataclass
class BenchResult:
    """What one experiment measured (see the module docstring)."""

    experiment: str
    title: str
    keys: tuple[str, ...]
    columns: tuple[Column, ...]
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def cell(self, row: dict[str, Any], column: Column) -> str:
        """A value as the table shows it: ``-`` for a missing value or NaN."""
        return format_value(row.get(column.key), column.digits)

    def table(self) -> Table:
        """The rows as a rich table, with the headline figures and notes below it."""
        table = make_table(
            self.title,
            [c.title for c in self.columns],
            [[self.cell(row, c) for c in self.columns] for row in self.rows],
        )
        caption = [f"{k}: {format_value(v, 3)}" for k, v in self.summary.items()]
        table.caption = "\n".join([*caption, *self.notes]) or None
        table.caption_justify = "left"
        return table

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: everything the result holds."""
        return {
            "schema": SCHEMA,
            "experiment": self.experiment,
            "title": self.title,
            "keys": list(self.keys),
            "columns": [c.to_dict() for c in self.columns],
            "rows": self.rows,
            "summary": self.summary,
            "notes": self.notes,
            "parameters": self.parameters,
            "environment": self.environment,
            "raw": self.raw,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """The result a ``to_dict()`` (or a JSON file of it) holds."""
        return cls(
            experiment=data["experiment"],
            title=data["title"],
            keys=tuple(data["keys"]),
            columns=tuple(Column(**c) for c in data["columns"]),
            rows=list(data["rows"]),
            summary=dict(data.get("summary", {})),
            notes=list(data.get("notes", [])),
            parameters=dict(data.get("parameters", {})),
            environment=dict(data.get("environment", {})),
            raw=dict(data.get("raw", {})),
        )

    def write_json(self, folder: Path) -> Path:
        """Write ``<experiment>.json`` in ``folder``; returns its path."""
        path = folder / f"{self.experiment}.json"
        write_atomic(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path


def format_value(value: Any, digits: int | None = None) -> str:
    """A value for a table: floats to ``digits`` places (or 4 significant digits), ``-`` for
    None and NaN, lists joined.

    >>> format_value(1234.5678), format_value(0.00012345), format_value(2.0, 1)
    ('1235', '0.0001234', '2.0')
    >>> format_value(None), format_value(float("nan")), format_value([1, 2])
    ('-', '-', '1, 2')
    """
    if isinstance(value, (list, tuple)):  # one level: a row's cell holds a flat list
        return ", ".join(_format_scalar(v, digits) for v in value)
    return _format_scalar(value, digits)


def _format_scalar(value: Any, digits: int | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits is not None else f"{value:.4g}"
    return str(value)


def load_result(path: Path) -> BenchResult:
    """The result stored in ``path`` (a ``NAME.json`` that ``--out`` wrote); a ConfigError that
    says what is wrong with a file that is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file; give a NAME.json that `gpukit bench --out` wrote"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict) or "experiment" not in data or "rows" not in data:
        raise ConfigError(
            f"{path}: not a gpukit bench result (no 'experiment' and 'rows'); give a NAME.json "
            "that `gpukit bench NAME --out DIR` wrote"
        )
    if data.get("schema") != SCHEMA:
        raise ConfigError(
            f"{path}: result schema {data.get('schema')!r}, this gpukit reads schema {SCHEMA}; "
            "rerun the experiment with this version"
        )
    try:
        return BenchResult.from_dict(data)
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{path}: a gpukit bench result with a broken field ({err})") from None
