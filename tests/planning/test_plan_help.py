"""`gpukit plan --help` prints its examples as written: a continued line stays two lines."""

from __future__ import annotations

import re

from gpukit.cli.__main__ import build_parser


def test_plan_help_has_no_runs_of_spaces() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["plan"].format_help()  # type: ignore[attr-defined]
    description = re.split(r"\n(?:options|positional arguments):", text)[0]
    runs = [line for line in description.splitlines() if re.search(r"\S {2,}\S", line.strip())]
    assert runs == []


def test_plan_examples_continue_on_the_next_line() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    lines = sub.choices["plan"].format_help().splitlines()  # type: ignore[attr-defined]
    continued = [i for i, line in enumerate(lines) if line.endswith("\\")]
    assert continued, "the plan examples show a command continued on a second line"
    for i in continued:
        assert lines[i + 1].startswith("        --")
