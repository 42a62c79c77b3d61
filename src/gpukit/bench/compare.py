"""``gpukit bench compare A.json B.json``: two runs of one experiment side by side, row by row,
with B's value over A's for every measurement.

Rows are matched on the experiment's key columns (device, dtype, size, variant...). A row that
only one run has is kept, with ``-`` for the other, so a GPU added or a variant that could not
run is visible rather than dropped. Devices are matched by their position in the table
(``cuda:0`` with ``cuda:0``): comparing an H100 with an A100 is what the command is for, so the
device's name is not a key.

>>> from gpukit.bench.result import BenchResult, Column
>>> cols = (Column("n"), Column("ms", "time", "ms"))
>>> a = BenchResult("demo", "A", ("n",), cols, [{"n": 16, "ms": 2.0}, {"n": 32, "ms": 4.0}])
>>> b = BenchResult("demo", "B", ("n",), cols, [{"n": 16, "ms": 1.0}])
>>> [(r["n"], r["ms B/A"]) for r in compare(a, b).rows]
[(16, 0.5), (32, None)]
"""

from __future__ import annotations

import math
from typing import Any

from gpukit.bench.result import BenchResult, Column
from gpukit.errors import ConfigError


def compare(a: BenchResult, b: BenchResult, label_a: str = "A", label_b: str = "B") -> BenchResult:
    """B against A: per measured column the two values and their ratio B/A."""
    if a.experiment != b.experiment:
        raise ConfigError(
            f"cannot compare a {a.experiment!r} result with a {b.experiment!r} one: give two "
            "results of the same experiment (e.g. matmul.json from two machines)"
        )
    keys = tuple(k for k in a.keys if k in b.keys)
    measured = [c for c in a.columns if c.compare and c.key not in keys and _numeric(c.key, a, b)]
    b_rows = {_key(row, keys): row for row in b.rows}
    rows, seen = [], set()
    for row in a.rows:
        key = _key(row, keys)
        seen.add(key)
        rows.append(_pair(keys, key, row, b_rows.get(key), measured))
    rows += [
        _pair(keys, key, None, row, measured) for key, row in b_rows.items() if key not in seen
    ]
    columns = [c for c in a.columns if c.key in keys]
    for c in measured:
        name = c.header or c.key
        columns += [
            Column(f"{c.key} A", f"{name} A", c.unit, c.digits),
            Column(f"{c.key} B", f"{name} B", c.unit, c.digits),
            Column(f"{c.key} B/A", "B/A", "", 3),
        ]
    return BenchResult(
        experiment=f"compare-{a.experiment}",
        title=f"{a.experiment}: B against A",
        keys=keys,
        columns=tuple(columns),
        rows=rows,
        notes=[
            f"A: {label_a}: {_machine(a)}",
            f"B: {label_b}: {_machine(b)}",
            "B/A above 1: B's value is larger (slower for a time, faster for a rate)",
        ],
        parameters={"A": a.parameters, "B": b.parameters},
    )


def _numeric(key: str, a: BenchResult, b: BenchResult) -> bool:
    values = [row.get(key) for row in (*a.rows, *b.rows)]
    numbers = [v for v in values if v is not None]
    return bool(numbers) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers
    )


def _key(row: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(str(row.get(k)) for k in keys)


def _pair(
    keys: tuple[str, ...],
    key: tuple[str, ...],
    row_a: dict[str, Any] | None,
    row_b: dict[str, Any] | None,
    measured: list[Column],
) -> dict[str, Any]:
    source = row_a if row_a is not None else row_b
    assert source is not None
    out: dict[str, Any] = {k: source.get(k) for k in keys}
    for c in measured:
        va = row_a.get(c.key) if row_a is not None else None
        vb = row_b.get(c.key) if row_b is not None else None
        out[f"{c.key} A"], out[f"{c.key} B"] = va, vb
        out[f"{c.key} B/A"] = _ratio(va, vb)
    return out


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0:
        return None
    ratio = b / a
    return None if math.isnan(ratio) else ratio


def _machine(result: BenchResult) -> str:
    env = result.environment
    devices = env.get("devices") or [{"name": env.get("device_name", "?")}]
    names = ", ".join(dict.fromkeys(str(d.get("name")) for d in devices))
    return f"{names}; torch {env.get('torch', '?')}; {env.get('date', '?')}"
