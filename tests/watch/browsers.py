"""Headless Chromium for the watch tests: it opens a report page from the disk, offline, and
dumps its DOM or takes its screenshot; the tests that need it skip, saying how to install it,
where it is missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium")
# No network, no first-run pages, no background services: the page alone, from the disk.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (make install installs it as root: apt-get install chromium)",
)


def browse(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Chromium run on ``page`` with ``args`` (``--dump-dom``, ``--screenshot=FILE``), its
    profile in ``tmp_path``."""
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
