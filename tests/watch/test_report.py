"""gpukit report: the page of a run's folder, from each of its records, and what it says
where a record is missing, corrupt or the folder is no run."""

from __future__ import annotations

import html
import json
import os
import re
import socket
from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError, OutputWriteError
from gpukit.watch.plan_check import plan_check
from gpukit.watch.report import REPORT, write_report
from gpukit.watch.report_plots import EVENT_STYLES, timeline
from gpukit.watch.run_records import Ended, read_run
from tests.watch.run_folders import HANG_REPORT, metrics, rank, two_rank_run

SVG_NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


def page_of(folder: Path, **kwargs: object) -> str:
    written = write_report(folder, plan_method="closed-form", **kwargs)  # type: ignore[arg-type]
    return written.path.read_text()


def figure_ids(page: str) -> set[str]:
    return set(re.findall(r'<figure id="([^"]+)"><svg', page))


def test_a_two_rank_run_has_every_figure_its_events_and_the_hang_report(tmp_path: Path) -> None:
    page = page_of(two_rank_run(tmp_path / "run"))
    assert figure_ids(page) == {"loss", "throughput", "memory", "data-wait", "timeline"}
    assert "0.4321" in page  # final loss
    assert 'class="status-finished">finished<' in page
    # Every event in the table, the restart with its cause, the hang's report in a <pre>.
    events = page[page.index('<table id="events">') :]
    events = events[: events.index("</table>")]
    for kind in ("straggler", "hang", "restart", "straggler-recovered", "ended"):
        assert f"<td>{kind}</td>" in events
    assert html.escape("rank 1 hung in rt.backward at train.py:20") in events
    assert f"<pre>{html.escape(HANG_REPORT)}</pre>" in page
    assert "<td>restarts</td>" not in page and "<th>restarts</th><td>1</td>" in page


def test_the_page_needs_nothing_outside_it(tmp_path: Path) -> None:
    page = page_of(two_rank_run(tmp_path / "run"))
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    # The SVG figures reuse their own markers and clip paths, by id (href="#..."): nothing else.
    targets = re.findall(r"\b(?:src|href)\s*=\s*\"([^\"]*)\"", page)
    assert targets and all(t.startswith("#") for t in targets), set(targets)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= SVG_NAMESPACES
    assert "<!DOCTYPE svg" not in page and "@font-face" not in page


def test_the_plan_is_set_against_what_was_measured_with_the_ratio(tmp_path: Path) -> None:
    page = page_of(two_rank_run(tmp_path / "run"))
    plan = page[page.index('<table id="plan">') :]
    plan = plan[: plan.index("</table>")]
    assert "step time" in plan and "peak of tensors" in plan
    assert re.search(r"<td>\d+\.\d\dx</td>", plan)  # measured / planned
    assert re.search(r"planned: ddp on 2 x [^,]+, micro-batch 32 x 1, 32 \(closed-form\)", page)


def test_a_running_run_is_reported_from_what_it_recorded_so_far(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run", finished=False)
    (folder / ".gpukit.lock").write_text(
        f'{{"pid": {os.getpid()}, "host": "{os.uname().nodename}", '
        '"started": "2026-11-29 10:00:00", "command": "gpukit train"}'
    )
    page = page_of(folder)
    assert 'class="status-running">running<' in page
    assert "not planned: no metrics.json" in page
    assert {"loss", "throughput", "memory"} <= figure_ids(page)


def test_a_run_resumed_in_a_folder_whose_last_run_ended_is_running(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run", finished=True)  # its events end with "ended"
    assert read_run(folder).status == "finished"
    (folder / ".gpukit.lock").write_text(
        f'{{"pid": {os.getpid()}, "host": "{socket.gethostname()}", '
        '"started": "2026-11-29 11:00:00", "command": "gpukit train --resume"}'
    )
    run = read_run(folder)
    assert run.status == "running" and "gpukit train --resume" in run.status_why


@pytest.mark.parametrize(
    ("ended", "said"),
    [
        (Ended.of_code(0), "finished; no checkpoint"),
        (Ended.of_error(RuntimeError("boom")), "failed: boom; no checkpoint"),
        (Ended.of_code(143), "stopped on request (SIGTERM or Ctrl-C), after saving; no"),
        (None, "finished: gpukit train: finished (exit code 0); no checkpoint"),  # events
    ],
)
def test_how_the_run_ended_is_said_once(tmp_path: Path, ended: Ended | None, said: str) -> None:
    page = page_of(two_rank_run(tmp_path / "run"), **({"ended": ended} if ended else {}))
    assert f'<p class="sub">{html.escape(said)}' in page


def test_a_run_whose_process_is_gone_is_failed(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run", finished=False)
    assert read_run(folder).status == "failed"
    assert read_run(folder, Ended.of_code(143)).status == "stopped"


def test_corrupt_lines_are_skipped_and_counted_in_the_page(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run", corrupt=True)
    run = read_run(folder)
    assert run.skipped == {"ranks.jsonl": 2, "events.jsonl": 1}
    assert len(run.samples) == 12 and len(run.events) == 5
    page = page_of(folder)
    assert "ranks.jsonl: 2 line(s) that did not parse were skipped" in page
    assert "events.jsonl: 1 line(s) that did not parse were skipped" in page


def test_a_one_process_run_says_it_has_no_per_rank_records(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    (folder / "ranks.jsonl").unlink()
    (folder / "events.jsonl").unlink()
    page = page_of(folder)
    assert "no per-rank records (ranks.jsonl): this run was one process" in page
    assert "no events.jsonl" in page
    assert figure_ids(page) == {"loss", "data-wait"}


def test_a_run_the_planner_cannot_plan_says_why(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    text = (folder / "metrics.json").read_text().replace('"mlp"', '"nosuchmodule:make"')
    (folder / "metrics.json").write_text(text)
    page = page_of(folder)
    assert "not planned: the planner could not plan this run:" in page


def test_profile_summaries_are_shown(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    (folder / "profile").mkdir()
    (folder / "profile" / "gpukit_rank0.5.summary.txt").write_text("aten::addmm  41.0%\n")
    (folder / "profile" / "gpukit_rank0.5.pt.trace.json").write_text("{}")
    trace = {"transfers": [{"count": 3}], "syncs": [{"count": 20}, {"count": 5}]}
    (folder / "trace.json").write_text(json.dumps({**trace, "ops_per_device": {"cpu": 90}}))
    page = page_of(folder)
    assert "<pre>aten::addmm  41.0%\n</pre>" in page
    assert "gpukit_rank0.5.pt.trace.json" in page
    assert "3 host-device copies (1 kind(s) and line(s)), 25 host reads" in page


def test_the_command_writes_the_page_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = two_rank_run(tmp_path / "run")
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [str(folder / REPORT), "finished: mlp, 60 of 60 steps, final loss 0.4321"]
    other = tmp_path / "elsewhere.html"
    assert main(["report", str(folder), "--output", str(other)]) == 0
    assert other.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: p / "missing", "does not exist: give the folder a run wrote"),
        (lambda p: p, "is not a run's folder: it holds none of metrics.json"),
    ],
)
def test_a_folder_that_is_no_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, said: str
) -> None:
    folder = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=said):
        write_report(folder)
    assert main(["report", str(folder)]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_a_folder_it_cannot_write_is_said_with_the_fix(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    folder.chmod(0o555)
    try:
        with pytest.raises(OutputWriteError, match=r"report\.html: permission denied.*Fix"):
            write_report(folder, plan_method="closed-form")
    finally:
        folder.chmod(0o755)


def test_an_output_in_a_missing_folder_is_said_with_the_fix(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    with pytest.raises(OutputWriteError, match=r"could not write .*nowhere.*--output"):
        write_report(folder, tmp_path / "nowhere" / "r.html", plan_method="closed-form")


def test_a_folder_standing_where_the_page_goes_is_said_with_the_fix(tmp_path: Path) -> None:
    folder = two_rank_run(tmp_path / "run")
    (folder / REPORT).mkdir()
    with pytest.raises(OutputWriteError, match=r"a folder stands where the file goes.*Fix: move"):
        write_report(folder, plan_method="closed-form")


def test_a_gpu_run_is_planned_for_its_gpu_by_the_name_it_recorded() -> None:
    recorded = {**metrics(cpu=False), "device_name": "NVIDIA H100 80GB HBM3"}
    checked = plan_check(recorded, method="closed-form")
    assert checked.planned_for.startswith("ddp on 2 x H100"), checked.why
    memory = checked.rows[0]
    assert memory.comparable and memory.ratio is not None
    # Without the name, on a machine without a GPU: said, not guessed.
    checked = plan_check(metrics(cpu=False), method="closed-form")
    if not checked.rows:
        assert "does not record" in checked.why


def test_a_long_run_of_many_ranks_stays_a_small_page(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    samples = [
        {"time": 1e9 + 10 * i, "attempt": 0, "ranks": [rank(r, i) for r in range(16)]}
        for i in range(2000)
    ]
    (folder / "ranks.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    page = page_of(folder)
    assert {"throughput", "memory", "data-wait"} <= figure_ids(page)
    assert "median of 16 ranks" in page  # one band for the ranks, not 16 lines
    assert len(page) < 2_000_000


def test_a_hang_stays_visible_over_the_restart_at_the_same_moment() -> None:
    events = [
        {"time": 8.0, "kind": "hang", "rank": 1},
        {"time": 8.0, "kind": "restart", "rank": 1},
    ]
    svg = timeline(events, start=0.0)
    assert svg is not None
    purple, red = EVENT_STYLES["hang"][1], EVENT_STYLES["restart"][1]
    hang, restart = (svg.index(f"fill: {to_hex(colour)}") for colour in (purple, red))
    assert restart < hang  # drawn first, so under
