"""The screen of `gpukit top`: a job of 2 nodes x 2 ranks with a straggler, a stale node, GPU
readings and NVML notes; and views with fields missing or of the wrong type."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from gpukit._util.text import render_plain
from gpukit.watch.screen import screen
from tests.watch.live_views import STARTED, GiB, two_nodes


def shown(view: dict[str, Any], width: int = 180) -> str:
    return render_plain(screen(view, now=STARTED + 40.2), width=width)


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by their rank (the second column), each split into its cells."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["node", "rank"])
    found = {}
    for line in lines[header + 2 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        found[cells[1]] = cells
    return found


def test_the_header_says_the_job_its_progress_and_its_stragglers() -> None:
    lines = shown(two_nodes()).splitlines()
    assert lines[0] == "gpukit train  2 nodes x 2 ranks  step 37/200 (18%)"
    assert lines[1] == (
        "4,197 samples/s  ETA 2 min 11 s  restarts 1  checkpoint step 30 "
        "(/runs/gpt/checkpoints/step-000030)  updated 200 ms ago"
    )
    assert lines[2] == "stragglers: rank 1 (node 0, node-a) 2.4x slower, mostly in data"


def test_one_row_per_rank_with_its_step_times_shares_memory_and_gpu() -> None:
    text = shown(two_nodes())
    header = next(line for line in text.splitlines() if line.startswith("node"))
    assert header.split() == [
        *("node", "rank", "step", "step", "time", "samples/s", "phase", "data", "coll", "comp"),
        *("alloc", "peak", "reserved", "gpu", "util", "power", "temp", "SM", "MHz", "throttle"),
    ]
    table = rows(text)
    assert sorted(table) == ["0", "1", "2", "3"]
    assert table["0"] == [
        *("0", "0", "40", "52", "/", "52", "ms", "1,231", "backward", "5%", "65%", "30%"),
        *("21", "GiB", "30", "GiB", "32", "GiB", "0", "97%", "650/700", "W", "71", "°C"),
        *("1980/1980", "none"),
    ]
    # The straggler is marked in words as well as in red, with its throttled clock.
    assert table["1"][1:4] == ["1", "slow", "40"]
    assert table["1"][-3:] == ["1410/1980", "power", "cap"]
    # The stale node's ranks have no GPU readings: their GPU cells say so.
    assert table["2"][-6:] == ["-"] * 6


def test_the_straggler_row_is_red() -> None:
    console = Console(width=180, force_terminal=True, color_system="standard", record=True)
    console.print(screen(two_nodes(), now=STARTED + 40.2))
    html = console.export_html(inline_styles=True)
    slow_row = next(line for line in html.splitlines() if "1 slow" in line)
    assert "color: #800000" in slow_row and "font-weight: bold" in slow_row


def test_notes_stale_nodes_and_events_are_lines_under_the_table() -> None:
    lines = shown(two_nodes()).splitlines()
    below = lines[next(i for i, line in enumerate(lines) if line.split()[:2] == ["1", "3"]) + 1 :]
    assert below[:2] == [
        "node 1 (node-b): NVML: not installed (pip install nvidia-ml-py): no GPU readings",
        "node 1 (node-b): no news for 12 s, its ranks show their last known state (no post)",
    ]
    assert below[2] == "last events:"
    assert below[3].endswith("  restart 1 of 3: rank 3 exited with code 1")
    assert "  straggler  rank 1 (node 0, host node-a) is 2.4x slower" in below[4]


def test_the_gpu_notes_of_ranks_are_said_once_for_the_ranks_that_share_them() -> None:
    view = two_nodes()
    for number, rank in enumerate(view["ranks"]):
        rank["gpu_note"] = "NVML refused: Insufficient Permissions" if number != 1 else "odd"
    lines = shown(view).splitlines()
    assert "ranks 0, 2, 3: NVML refused: Insufficient Permissions" in lines
    assert "rank 1: odd" in lines


def test_a_note_the_launcher_gathered_from_its_ranks_and_nodes_is_said_once() -> None:
    # As the launcher writes them: its ranks' notes and its nodes' are in the view's notes too.
    missing = "NVML: not installed (pip install nvidia-ml-py): no GPU readings"
    view = two_nodes(notes=[missing, "node 1: no post"])
    for rank in view["ranks"]:
        rank["gpu_note"] = missing
    text = shown(view)
    assert text.count("NVML: not installed") == 1 and missing in text.splitlines()
    assert text.count("no post") == 1  # in the stale node's own line
    assert "node 1 (node-b): no news for 12 s" in text


def test_ranks_on_cpu_show_their_resident_memory_and_no_gpu_columns() -> None:
    view = two_nodes()
    for rank in view["ranks"]:
        rank["memory"] = {"allocated": None, "peak": None, "reserved": None, "rss": 3 * GiB}
        rank["gpu"] = None
    text = shown(view)
    header = next(line for line in text.splitlines() if line.startswith("node")).split()
    assert header[-4:] == ["data", "coll", "comp", "rss"]
    assert rows(text)["0"][-2:] == ["3", "GiB"]


def test_a_rank_that_exited_says_so() -> None:
    view = two_nodes()
    view["ranks"][3]["alive"] = False
    assert rows(shown(view))["3"][8] == "exited"


def test_an_ended_job_says_how() -> None:
    view = two_nodes(ended={"time": STARTED + 50, "code": 1, "how": "failed"})
    assert "ended: failed, exit code 1 at " in shown(view)


def test_a_view_of_nothing_shows_dashes() -> None:
    lines = shown({}).splitlines()
    assert lines[0] == "gpukit job  - nodes x - ranks  step -"
    assert lines[1] == "- samples/s  ETA -  restarts -  checkpoint -  updated -"


@pytest.mark.parametrize(
    "field, value",
    [
        ("ranks", "four"),
        ("ranks", [None, 3, {"rank": "zero", "step": None, "shares": [1], "memory": 5}]),
        ("stragglers", [{"rank": None}, "x"]),
        ("events", [{"time": "noon"}, 7]),
        ("nodes", [{"stale": True, "age_s": "long"}]),
        ("checkpoint", {"step": "x"}),
        ("total_steps", 0),
        ("eta_s", -3),
        ("samples_per_s", True),
        ("step", float("nan")),
        ("eta_s", float("inf")),
        ("ranks", [{"rank": float("nan"), "step_s": float("nan"), "phase": "[/oops]"}]),
        ("name", "[/bold]"),
    ],
)
def test_a_field_of_the_wrong_type_shows_a_dash_never_an_error(field: str, value: Any) -> None:
    view = two_nodes()
    view[field] = value
    assert shown(view)


def test_markup_in_the_view_is_shown_as_text() -> None:
    view = two_nodes()
    view["ranks"][0]["phase"] = "[red]x[/red]"
    assert rows(shown(view))["0"][8] == "[red]x[/red]"


def test_a_narrow_terminal_leaves_out_the_last_columns_and_says_which() -> None:
    text = shown(two_nodes(), width=100)
    assert rows(text)["0"][:2] == ["0", "0"] and len(rows(text)) == 4
    assert "(widen the terminal to see reserved, gpu, util, power, temp, SM MHz, throttle)" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_a_view_not_rewritten_for_seconds_says_the_launcher_is_late() -> None:
    second = shown(two_nodes(updated=STARTED + 30)).splitlines()[1]
    assert second.endswith("  updated 10 s ago: the launcher is late")
