"""The page as a browser shows it: headless Chromium opens it from the disk, offline, and its
DOM holds the figures and the run's headline."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukit.watch.report import write_report
from tests.watch.browsers import browse, needs_chromium
from tests.watch.run_folders import two_rank_run

pytestmark = [pytest.mark.processes, needs_chromium]


def test_chromium_shows_the_figures_and_the_headline(tmp_path: Path) -> None:
    page = write_report(two_rank_run(tmp_path / "run"), plan_method="closed-form").path
    dom = browse(tmp_path, page, "--dump-dom").stdout
    for figure in ("loss", "throughput", "memory", "data-wait", "timeline"):
        assert f'<figure id="{figure}"><svg' in dom
    assert "<th>final loss</th><td>0.4321</td>" in dom
    assert "<th>ranks</th><td>2</td>" in dom
    shot = tmp_path / "report.png"
    browse(tmp_path, page, f"--screenshot={shot}", "--window-size=1280,4000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
