"""The table of every setting (``docs/settings.md``), rendered from their declarations in
:mod:`gpukit.runtime.settings`. Regenerate the page with::

    PYTHONPATH=src python -m gpukit.runtime.settings_doc > docs/settings.md

>>> "| `log_every` | `50` | `--log-every` | `10` |" in render()
True
"""

from __future__ import annotations

import sys
from typing import Any

from gpukit.runtime import settings as _settings
from gpukit.runtime.settings import Settings

COMMAND = "PYTHONPATH=src python -m gpukit.runtime.settings_doc > docs/settings.md"
HEADER = (
    "setting",
    "gk.Runtime default",
    "gpukit train flag",
    "gpukit train default",
    "allowed values",
    "meaning",
    "why gpukit train's default differs",
)


def render(cls: type[Settings] = Settings) -> str:
    """``docs/settings.md``: a markdown table with a row per setting of ``cls``."""
    rows = [_row(f) for f in _settings.fields(cls)]
    lines = [
        "# Settings",
        "",
        "Every setting of a run: a keyword of `gk.Runtime(...)` and, where it has one, a flag of",
        "`gpukit train`. Each is declared once, in `gpukit.runtime.settings.Settings`; the",
        "keywords, their checks, the flags, the `config` in `metrics.json` and this page come",
        "from there. `gpukit train` uses other defaults than `gk.Runtime` for a few settings;",
        "the last column says why.",
        "",
        f"<!-- generated: {COMMAND} -->",
        "",
        _line(HEADER),
        _line(["---"] * len(HEADER)),
        *(_line(row) for row in rows),
    ]
    return "\n".join(lines) + "\n"


def _row(f: Any) -> list[str]:
    meta = _settings.option(f)
    flag = _settings.flag_name(f)
    differs = meta.train_default is not _settings.SAME
    return [
        f"`{f.name}`",
        _code(f.default),
        f"`{flag}`" if flag is not None else meta.no_flag,
        _code(_settings.train_default(f)) if flag is not None else "",
        meta.allowed,
        meta.help,
        meta.why if differs else "",
    ]


def _code(value: Any) -> str:
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _line(cells: Any) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


if __name__ == "__main__":
    sys.stdout.write(render())
