"""``--config FILE``: a command's flags read from a TOML file, the command line over them.

Each key is a flag's long name with underscores (``max_steps = 50`` for ``--max-steps 50``),
its value of the flag's type: a whole number, a number, text, or ``true``/``false`` for a
switch such as ``--resume``. The command line is parsed once to find ``--config``; the file's
values then become the command's defaults, and the command line is parsed again, so a flag
given there wins over the file. A switch set in the file cannot be switched off on the command
line (it has no ``--no-`` form): leave it out of the file instead.

TOML is read with the standard library's ``tomllib`` (Python 3.11+), or on Python 3.10 with
``tomli``, which gpukit requires there.

>>> import argparse, tempfile
>>> from pathlib import Path
>>> parser = argparse.ArgumentParser()
>>> _ = parser.add_argument("--lr", type=float)
>>> _ = parser.add_argument("--resume", action="store_true")
>>> path = Path(tempfile.mkdtemp()) / "run.toml"
>>> _ = path.write_text("lr = 0.5\\nresume = true\\n")
>>> sorted(file_defaults(parser, path).items())
[('lr', 0.5), ('resume', True)]
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpukit.errors import ConfigError

FLAG = "--config"
_SKIP = ("help", "config")  # not keys of a file: no nesting of files


def with_config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``args`` (``parser.parse_args(argv)``) again, with the file of ``--config`` as the
    command's defaults when the command has the flag and it is given. The command's parser is
    found in ``args`` as ``config_parser`` (which the command sets with ``set_defaults``)."""
    path, command = getattr(args, "config", None), getattr(args, "config_parser", None)
    if path is None or command is None:
        return args
    command.set_defaults(**file_defaults(command, Path(path)))
    return parser.parse_args(argv)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by key (their ``dest``), in the order of ``--help``."""
    return {
        a.dest: a
        for a in parser._actions  # argparse keeps no public list of them
        if a.option_strings and a.dest not in _SKIP
    }


def file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The values of the TOML file ``path`` for ``parser``'s options, each as its flag would
    give it; a ConfigError for a file that is missing or not TOML, an unknown key, or a value
    of the wrong type or outside the flag's choices."""
    text = _read(path)
    table = _toml(path, text)
    actions = _actions(parser)
    allowed = ", ".join(actions)
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{path}, line {_line_of(text, key)}"
        action = actions.get(key)
        if action is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(actions), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{where}: unknown key {key!r}: {hint}the keys are the flags' long names with "
                f"underscores: {allowed}"
            )
        values[action.dest] = _value(action, key, value, where)
    return values


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{FLAG} {path}: no such file; give the path of a TOML file of flags, e.g. "
            'run.toml holding: workload = "mlp"'
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{FLAG} {path}: cannot read it ({err}); give a readable TOML file"
        ) from None


def _toml(path: Path, text: str) -> dict[str, Any]:
    toml = _toml_module(path)
    try:
        table: dict[str, Any] = toml.loads(text)
    except toml.TOMLDecodeError as err:
        raise ConfigError(f"{FLAG} {path}: not valid TOML: {err}") from None
    nested = [k for k, v in table.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(
            f"{path}, line {_line_of(text, nested[0], table=True)}: [{nested[0]}] is a table; "
            "the file holds flags only, as key = value lines without [sections]"
        )
    return table


def _toml_module(path: Path) -> Any:
    """tomllib (Python 3.11+), else tomli."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # Python 3.10: gpukit requires tomli there
        import tomli  # type: ignore[import-not-found, unused-ignore]
    except ModuleNotFoundError:
        raise ConfigError(
            f"{FLAG} {path}: reading TOML on Python 3.10 needs the tomli package: "
            "pip install tomli (Python 3.11 and later read it without)"
        ) from None
    return tomli


def _value(action: argparse.Action, key: str, value: object, where: str) -> Any:
    """``value`` as the flag ``action`` would give it, checked against its type and choices."""
    switch = action.nargs == 0  # store_true and its kind take no value
    # A flag that may also be given alone (--compile) takes true and false too, as its type
    # reads them ("True": on).
    optional = action.nargs == "?"
    kind = action.type
    if switch:
        ok, wanted = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif kind is float:
        ok, wanted = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(value, bool) and _takes_bool(kind):
        ok, wanted = True, "true or false"  # an on/off flag: --async-save on
    else:
        ok = isinstance(value, (str, int, float)) and (optional or not isinstance(value, bool))
        wanted = "text (in quotes) or a number"
    if not ok:
        raise ConfigError(
            f"{where}: {key} = {_shown(value)} is {type(value).__name__}: give {wanted}, as "
            f"{action.option_strings[0]} takes"
        )
    if switch:
        return value  # the key is the flag's own value: resume = true is --resume
    if kind is not None and callable(kind):
        try:
            parsed = kind(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            raise ConfigError(f"{where}: {key} = {_shown(value)}: {err}") from None
    else:
        parsed = value
    if action.choices is not None and parsed not in action.choices:
        raise ConfigError(
            f"{where}: {key} = {_shown(value)}: give one of "
            f"{', '.join(repr(c) for c in action.choices)}"
        )
    return parsed


def _takes_bool(kind: Any) -> bool:
    """Whether a flag's type reads "true" as True (an on/off flag, which config.toml writes
    as true or false)."""
    try:
        return callable(kind) and kind("true") is True
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False


def _shown(value: object) -> str:
    """``value`` as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _line_of(text: str, key: str, table: bool = False) -> int | str:
    """The line of ``text`` where ``key`` is set (or its ``[table]`` starts); "?" if not
    found (a quoted or dotted key)."""
    pattern = rf"^\s*\[\s*{re.escape(key)}\s*\]" if table else rf"^\s*{re.escape(key)}\s*="
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(pattern, line):
            return number
    return "?"
