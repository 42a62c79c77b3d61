"""`gpukit bench all --quick --out DIR` on this machine: every experiment's JSON and plot, and
report.md tying them together; `gpukit bench compare`; and the bad input the command refuses."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from gpukit.bench import suite
from gpukit.bench.compare import compare
from gpukit.bench.result import SCHEMA, BenchResult, Column, load_result
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError
from tests.bench.conftest import BENCH_QUICK

pytestmark = BENCH_QUICK
ENVIRONMENT = {"date", "command", "python", "torch", "gpukit", "cpu", "cpu_cores", "device"}


@pytest.fixture(scope="module")
def quick_all(
    tmp_path_factory: pytest.TempPathFactory,
    quick_matmul: BenchResult,
    quick_transfer: BenchResult,
    quick_sync: BenchResult,
    quick_multidevice: BenchResult,
    quick_strategies: BenchResult,
    quick_precision: BenchResult,
    quick_calibration: BenchResult,
    quick_speed: BenchResult,
) -> Path:
    """One `gpukit bench all --quick --out DIR` for the whole module (it takes minutes).
    Without a GPU, the quick runs of the experiments other test modules read are exactly the
    ones they made on this CPU, so those results are handed over rather than measured a second
    time (calibration's with 5 steps instead of its quick 10); overhead, trace, plan and
    restarts run here."""
    out = tmp_path_factory.mktemp("bench") / "results"
    made = {
        "matmul": quick_matmul,
        "transfer": quick_transfer,
        "sync": quick_sync,
        "multidevice": quick_multidevice,
        "strategies": quick_strategies,
        "precision": quick_precision,
        "calibration": quick_calibration,
        "speed": quick_speed,
    }
    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            for name, result in made.items():
                patch.setattr(suite.experiment(name), "run", functools.partial(_made, result))
        assert main(["bench", "all", "--quick", "--out", str(out)]) == 0
    return out


def _made(result: BenchResult, quick: bool = False, **_: object) -> BenchResult:
    assert quick, "only the quick runs are made once for the session"
    return result


@pytest.mark.processes
def test_all_quick_writes_a_json_per_experiment_plots_and_the_report(quick_all: Path) -> None:
    names = suite.names()
    assert {p.stem for p in quick_all.glob("*.json")} == set(names)
    pngs = list(quick_all.glob("*.png"))
    assert len(pngs) >= 4 and all(p.stat().st_size > 5_000 for p in pngs)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    for name in names:
        data = json.loads((quick_all / f"{name}.json").read_text())
        assert data["schema"] == SCHEMA and data["experiment"] == name
        assert data["rows"], f"{name} measured nothing"
        assert set(data["keys"]) <= {c["key"] for c in data["columns"]}
        assert set(data["environment"]) >= ENVIRONMENT, name
        assert data["parameters"]["quick"] is True, name
        assert data["raw"], f"{name} kept no raw timings"
        for row in data["rows"]:
            assert all(k in row for k in data["keys"]), (name, row)
    report = (quick_all / "report.md").read_text()
    for name in names:
        assert f"## {name}" in report and f"[{name}.json]({name}.json)" in report
    assert all(f"![{p.stem}]({p.name})" in report for p in pngs)
    assert "Machine:" in report and "Command: `" in report


@pytest.mark.processes
def test_compare_two_folders_matches_every_row(
    quick_all: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(quick_all, copy)
    capsys.readouterr()
    assert main(["bench", "compare", str(quick_all), str(copy), "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert len(compared) == len(suite.names())
    for c in compared:
        ratios = [v for row in c["rows"] for k, v in row.items() if k.endswith("B/A")]
        assert all(r == 1.0 for r in ratios if r is not None), c["experiment"]


def test_a_row_only_one_run_has_is_kept() -> None:
    cols = (Column("device"), Column("gbps", "bandwidth", "GB/s"))
    a = BenchResult("transfer", "a", ("device",), cols, [{"device": "cpu", "gbps": 10.0}])
    b = BenchResult(
        "transfer",
        "b",
        ("device",),
        cols,
        [{"device": "cpu", "gbps": 12.5}, {"device": "cuda:0", "gbps": 25.0}],
    )
    rows = compare(a, b).rows
    assert rows == [
        {"device": "cpu", "gbps A": 10.0, "gbps B": 12.5, "gbps B/A": 1.25},
        {"device": "cuda:0", "gbps A": None, "gbps B": 25.0, "gbps B/A": None},
    ]


def test_compare_refuses_results_of_two_experiments(tmp_path: Path) -> None:
    a = BenchResult("matmul", "a", ("n",), (Column("n"),), [{"n": 1}])
    b = BenchResult("sync", "b", ("n",), (Column("n"),), [{"n": 1}])
    with pytest.raises(ConfigError, match="cannot compare a 'matmul' result with a 'sync' one"):
        compare(a, b)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("not json", "not a readable JSON file"),
        ('{"a": 1}', "not a gpukit bench result"),
        ('{"experiment": "x", "rows": [], "schema": 99}', "result schema 99"),
        ('{"experiment": "x", "rows": [], "schema": 1}', "broken field"),
    ],
)
def test_a_file_that_is_not_a_result_is_explained(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_result(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["all", "--only", "matmul,nosuch"], "--only 'matmul,nosuch': nosuch not an experiment"),
        (["all", "--only", ","], "no names not an experiment"),
        (["all", "--out", "{tmp}/r.json"], "`bench all` writes a folder"),
        (["sync", "--out", "{tmp}/afile"], "a file is there"),
        (["sync", "--out", "/proc/gpukit-results"], "cannot write there"),
        (["sync", "--out", "/proc/gpukit-results.json"], "cannot write there"),
        (["sync", "--out", "{tmp}/afile/r.json"], "the folder"),
        (["sync", "--out", "{tmp}/afile/results"], "cannot write there (Not a directory)"),
        (["sync", "--out", "/proc/version"], "a file is there"),
        (["compare", "{tmp}/afile", "{tmp}"], "give two NAME.json files or two folders"),
        (["compare", "{tmp}", "{tmp}"], "no NAME.json in common"),
        (["overhead", "--steps", "0"], "--steps 0: give a whole number"),
        (["trace", "--workload", "nosuch"], "nosuch"),
    ],
)
def test_bad_input_is_refused_before_any_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "afile").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("*.png"))


def test_a_failing_experiment_does_not_cost_the_others(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    quick_sync: BenchResult,
) -> None:
    monkeypatch.setattr(suite.experiment("sync"), "run", functools.partial(_made, quick_sync))
    overhead = suite.experiment("overhead")

    def broken(quick: bool = False) -> BenchResult:
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(overhead, "run", broken)
    assert main(["bench", "all", "--quick", "--only", "overhead,sync", "--out", str(tmp_path)]) == 1
    assert (tmp_path / "sync.json").is_file() and not (tmp_path / "overhead.json").exists()
    report = (tmp_path / "report.md").read_text()
    assert "**Failed:**" in report and "the device fell off the bus" in report
    assert "1 of 2 experiments ran" in capsys.readouterr().out
