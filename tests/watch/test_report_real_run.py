"""The page of a real run that went wrong twice: `gpukit train` over 2 gloo ranks, one rank
killed (SIGKILL) and later the other hung, restarted after each, finished; its report.html
names both restarts with their causes, holds the hang's report and the per-rank figures, and
headless Chromium shows them."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.watch.report import REPORT
from tests.watch.browsers import browse, needs_chromium

# A hang timeout: one at a time under `make test`, as the other runs with timed faults.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("timing")]

SRC = str(Path(__file__).resolve().parents[2] / "src")
FIGURES = ("loss", "throughput", "memory", "data-wait", "timeline")
# Rank 1 is killed as it begins step 6 (resumed from step 4), rank 0 hangs as it begins
# step 14 (resumed from step 12). The hang timeout is well above any healthy stretch between
# two beats of this small model on a loaded machine, its start-up included: the clock runs
# from a rank's first beat, and a rank started cold (--cold-start) still imports for seconds
# after it (6 s was overrun so on a loaded machine).
FAULTS = "sigkill:1:6,hang:0:14"
TRAIN = [
    *("--workload", "mlp", "--devices", "2", "--max-steps", "30", "--save-every", "4"),
    *("--max-restarts", "2", "--hang-timeout", "10"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's --out folder, once `gpukit train` finished it (exit code 0)."""
    folder = tmp_path_factory.mktemp("faulty")
    env = {**os.environ, "PYTHONPATH": SRC, "GPUKIT_FAULT": FAULTS}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPUKIT_JOB_DIR"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", *TRAIN, "--out", "run"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "restart 1/2 after rank 1 was killed by SIGKILL" in said, said
    assert "restart 2/2 after rank 0 hung" in said, said
    return folder / "run"


def test_the_page_names_each_restart_with_its_cause_and_holds_the_hang_report(run: Path) -> None:
    page = (run / REPORT).read_text()
    assert 'class="status-finished">finished<' in page
    assert "<th>restarts</th><td>2</td>" in page and "<th>steps</th><td>30 of 30</td>" in page
    events = page[page.index('<table id="events">') :]
    events = events[: events.index("</table>")]
    kinds = re.findall(r"<tr><td>[\d.]+</td><td>([a-z-]+)</td>", events)
    assert kinds == ["restart", "hang", "restart", "ended"], events
    assert html.escape("restart 1/2 after rank 1 was killed by SIGKILL at step 5") in events
    assert html.escape("restart 2/2 after rank 0 hung at step 13") in events
    report = re.search(r"<h3>hang report \(attempt 1\)</h3><pre>(.*?)</pre>", page, re.S)
    assert report and "rank 0 hung: no heartbeat for 10 s at step 13" in report.group(1)
    assert "faults.py:" in report.group(1)  # the line it hung on: the injected sleep


@needs_chromium
def test_chromium_shows_every_figure_with_a_line_per_rank(run: Path, tmp_path: Path) -> None:
    dom = browse(tmp_path, run / REPORT, "--dump-dom").stdout
    assert dom.count("<svg") == len(FIGURES)
    for figure in FIGURES:
        assert f'<figure id="{figure}"><svg' in dom
    memory = dom[dom.index('<figure id="memory">') :]
    memory = memory[: memory.index("</figure>")]
    # matplotlib draws the legend's words as paths and names each in a comment.
    assert "<!-- rank 0 rss -->" in memory and "<!-- rank 1 rss -->" in memory
    assert "<th>ranks</th><td>2</td>" in dom
