"""Helpers the subcommands share: JSON output and the rich console."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console


def add_command(sub: Any, name: str, help: str, manual: str | None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` prints ``manual`` (its module docstring) as written."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=manual, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def console() -> Console:
    """A console on stdout; plain text, 140 columns wide, when stdout is not a terminal
    (rich would otherwise wrap tables at 80 columns in logs and pipes)."""
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=140)
    return out
