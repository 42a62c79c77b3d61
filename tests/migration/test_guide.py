"""docs/migrating.md and ``gpukit check`` say the same: every row of the guide's tables is a
row of the check's table, every row of that table is in the guide, and so is every behaviour
the check can say."""

from __future__ import annotations

import re
from pathlib import Path

from gpukit.migration.behaviours import BEHAVIOURS
from gpukit.migration.table import TABLE

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
HEADER = "| the program writes | gpukit | what differs |"


def guide_rows() -> list[tuple[str, str, str]]:
    rows, in_table = [], False
    for line in GUIDE.read_text().splitlines():
        if line == HEADER:
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("| ---"):
            call, gpukit, note = (cell.strip() for cell in line.strip("|").split(" | "))
            assert call.startswith("`") and call.endswith("`"), line
            rows.append((call[1:-1], gpukit, note))
    return rows


def test_every_row_of_the_guide_is_a_row_of_the_check() -> None:
    table = {(r.call, r.gpukit, r.note) for r in TABLE}
    rows = guide_rows()
    assert len(rows) >= len(TABLE)
    assert [row for row in rows if row not in table] == []


def test_every_row_of_the_check_is_in_the_guide() -> None:
    rows = set(guide_rows())
    assert [r.call for r in TABLE if (r.call, r.gpukit, r.note) not in rows] == []


def test_every_behaviour_the_check_says_is_in_the_guide() -> None:
    bullets = set(re.findall(r"^- (.*)$", GUIDE.read_text(), flags=re.M))
    assert [b.text for b in BEHAVIOURS if b.text not in bullets] == []
