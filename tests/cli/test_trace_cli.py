"""gpukit trace: scripts and workloads under the trace, JSON schema, failures, bad requests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpukit.cli.__main__ import main

SCRIPT = """\
import torch
x = torch.ones(4)
for _ in range(3):
    value = x.sum().item()
values = x.tolist()
if x.sum():
    pass
if x.mean():
    pass
print(x)
"""


def _script(tmp_path: Path, text: str = SCRIPT) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def test_json_of_a_script_matches_the_schema_with_lines_and_counts(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", "--json", str(_script(tmp_path))]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout is the JSON alone
    assert "tensor([1., 1., 1., 1.])" in captured.err  # the script's own print
    assert set(data) == {"transfers", "syncs", "ops_per_device"}
    assert data["transfers"] == [] and data["ops_per_device"]["cpu"] > 0
    found = {(s["op"], s["line"]): s["count"] for s in data["syncs"]}
    assert found == {
        ("item", 4): 3,
        ("tolist", 5): 1,
        ("bool", 6): 1,
        ("bool", 8): 1,
        ("print", 10): 1,
    }
    for sync in data["syncs"]:
        assert sync["file"].endswith("train.py") and sync["function"] == "<module>"
        assert isinstance(sync["count"], int) and isinstance(sync["line"], int)


PRINTING = """\
import os
import sys

import torch

print("epoch 1 {")
sys.stdout.write("[progress 50%]\\n")
os.system("echo from a child process")
print(torch.ones(2).sum().item())
"""


@pytest.mark.processes
def test_json_stdout_is_only_the_json_when_the_script_prints(tmp_path: Path, capfd) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", "--json", str(_script(tmp_path, PRINTING))]) == 0
    captured = capfd.readouterr()
    data = json.loads(captured.out)  # the whole of stdout
    assert [(s["op"], s["line"]) for s in data["syncs"]] == [("item", 9)]
    for printed in ("epoch 1 {", "[progress 50%]", "from a child process", "2.0"):
        assert printed in captured.err
    print("after the trace")  # stdout is stdout again
    assert capfd.readouterr().out == "after the trace\n"


@pytest.mark.processes
def test_out_writes_the_json_and_keeps_the_report(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "trace.json"
    assert main(["trace", "--out", str(out), str(_script(tmp_path, PRINTING))]) == 0
    printed = capsys.readouterr().out
    assert "epoch 1 {" in printed and ".item() once at " in printed  # as without --out
    written = json.loads(out.read_text())
    assert [(s["op"], s["line"]) for s in written["syncs"]] == [("item", 9)]
    assert main(["trace", "--json", "--out", str(out), str(_script(tmp_path, PRINTING))]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(out.read_text())


def test_the_report_names_the_line_and_the_fix(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", str(_script(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "train.py:4" in out and "rt.log(loss=loss)" in out and "[potential]" in out
    assert "Placement log" in out


def test_the_scripts_arguments_and_exit_code_pass_through(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(tmp_path, "import sys\nprint(sys.argv[1:])\nsys.exit(3)\n")
    assert main(["trace", str(script), "--epochs", "2"]) == 3
    assert "['--epochs', '2']" in capsys.readouterr().out


def test_a_failing_script_still_shows_the_trace_then_the_error_in_words(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    script = _script(
        tmp_path,
        "import torch\ntorch.ones(2).sum().item()\n"
        "raise RuntimeError('CUDA error: device-side assert triggered')\n",
    )
    assert main(["trace", str(script)]) == 1
    captured = capsys.readouterr()
    assert "train.py:2" in captured.out
    assert "the traced program failed" in captured.err and "--blocking" in captured.err


def test_blocking_sets_cuda_launch_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    script = _script(tmp_path, "import os\nassert os.environ['CUDA_LAUNCH_BLOCKING'] == '1'\n")
    assert main(["trace", "--blocking", str(script)]) == 0
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"


def test_a_workload_trace_is_json_too(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", "--json", "--workload", "mlp", "--steps", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"transfers", "syncs", "ops_per_device"}


def test_gpukit_train_reads_back_only_at_its_logging_interval() -> None:
    import gpukit as gk
    from gpukit.train.loop import TrainConfig, fit

    rt = gk.Runtime(devices="cpu", seed=0, log_every=5, oom="recover")
    # The validation pass at the end reads back once (tests/train/test_validation.py).
    config = TrainConfig(workload="mlp", max_steps=20, progress=False, sample=False, validate=False)
    with gk.trace() as t:
        fit(rt, config)
    fit_syncs = [s for s in t.syncs if s.file.endswith("loop.py")]
    by_line = {s.line: s for s in fit_syncs}
    # 20 / 5 = 4 log read-backs (the final flush finds nothing left to read; the check of the
    # targets before the first step is gpukit's own read, not shown). Nothing once per step.
    assert [s.count for s in fit_syncs] == [4], by_line
    assert fit_syncs[0].op == "tolist" and "rt.log" in linecache_line(fit_syncs[0])
    assert sum(s.count for s in t.syncs) == 4


def linecache_line(sync: object) -> str:
    import linecache

    return linecache.getline(sync.file, sync.line)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "nothing to trace"),
        (["--workload", "mlp", "x.py"], "trace one of them"),
        (["missing.py"], "script 'missing.py' not found"),
        (["--steps", "0", "--workload", "mlp"], "--steps 0"),
        (["--workload", "nosuch"], "nosuch"),
        (["--out", "no/such/folder/t.json", "--workload", "mlp"], "does not exist"),
    ],
)
def test_bad_requests_are_one_line_errors(args: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("import torch\ndef f(:\n    pass\n", "line 2 does not compile: invalid syntax (def f(:)"),
        ("x = 1\n  y = 2\n", "line 2 does not compile: unexpected indent"),
        ('x = "\x00"\n', "does not compile"),
    ],
    ids=["syntax", "indent", "null-byte"],
)
def test_a_script_that_does_not_compile_is_one_line_and_no_report(
    tmp_path: Path, capsys, text: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    """Refused before the trace starts: no empty report of a program that never ran."""
    (tmp_path / "out.json").unlink(missing_ok=True)
    args = ["trace", "--out", str(tmp_path / "out.json"), str(_script(tmp_path, text))]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"gpukit trace: error: script '{tmp_path / 'train.py'}' {message}")
    assert "py_compile" in captured.err and not (tmp_path / "out.json").exists()


def test_an_unknown_error_keeps_its_traceback(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(tmp_path, "settings = {}\nprint(settings['missing'])\n")
    assert main(["trace", str(script)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'missing'" in err and "train.py" in err


def test_a_known_error_names_the_scripts_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(
        tmp_path, "x = 1\nraise RuntimeError('CUDA error: no kernel image is available')\n"
    )
    assert main(["trace", str(script)]) == 1
    err = capsys.readouterr().err
    assert "train.py:2)" in err and "kernel" in err


def test_sys_exit_with_a_message_prints_it(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(tmp_path, "import sys\nsys.exit('usage: train.py DATA')\n")
    assert main(["trace", str(script)]) == 1
    assert "usage: train.py DATA" in capsys.readouterr().err


def test_a_script_that_traces_itself_runs_under_gpukit_trace(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(
        tmp_path,
        "import torch, gpukit as gk\nwith gk.trace() as t:\n    torch.ones(1).item()\n"
        "assert [s.op for s in t.syncs] == ['item']\n",
    )
    assert main(["trace", "--json", str(script)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["op"] for s in data["syncs"]] == ["item"]


PLAIN_LOOP = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(7):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.item()
"""

RUNTIME_LOOP = """\
import torch
import gpukit as gk
rt = gk.Runtime(devices="cpu", accumulate=2)
model = torch.nn.Linear(4, 1)
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for micro in range(12):
    rt.backward(model(torch.randn(8, 4)).pow(2).mean())
    rt.step(opt)
"""


def _profile_marks(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return len({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_profile_of_a_plain_loop_counts_optimizer_steps(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = _script(tmp_path, PLAIN_LOOP)
    assert main(["trace", "--json", str(script)]) == 0
    plain = json.loads(capsys.readouterr().out)
    prof = tmp_path / "prof"
    assert main(["trace", "--json", "--profile", str(prof), str(script)]) == 0
    data = json.loads(capsys.readouterr().out)
    path = prof / "gpukit_rank0.5.pt.trace.json"
    assert data["profile"]["steps_counted"] == 7
    assert data["profile"]["windows"] == [
        {
            "first": 3,
            "last": 5,
            "rank": 0,
            "path": str(path),
            "table": str(prof / "gpukit_rank0.5.summary.txt"),
        }
    ]
    assert _profile_marks(path) == 3
    # The trace's counts are the same with the profiler on: exact, not sampled.
    assert {k: v for k, v in data.items() if k != "profile"} == plain
    assert [(s["op"], s["count"]) for s in data["syncs"]] == [("item", 7)]


def test_profile_of_a_runtime_script_counts_its_steps_and_prints_the_table(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "prof"
    args = ["trace", "--profile", str(prof), "--profile-window", "0,1,2"]
    assert main([*args, str(_script(tmp_path, RUNTIME_LOOP))]) == 0
    out = capsys.readouterr().out
    path = prof / "gpukit_rank0.3.pt.trace.json"  # 6 Runtime steps of 2 micro-batches
    assert f"Profile of steps 2-3 (rank 0): {path}" in out
    assert "Self CPU" in out and "Placement log:" in out and "gk.trace:" in out
    assert _profile_marks(path) == 2


def test_profile_window_not_reached_says_so(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["trace", "--profile", str(tmp_path / "p"), "--profile-window", "7,1,3"]
    assert main([*args, str(_script(tmp_path, PLAIN_LOOP))]) == 0
    out = capsys.readouterr().out
    assert "Profile: nothing written: 7 steps ran, the window was steps 9-11" in out


@pytest.mark.parametrize("window", ["1,1", "1,1,0", "a,b,c", "-1,1,3"])
def test_bad_profile_window_is_refused_before_the_script_runs(
    tmp_path: Path, capsys, window: str
) -> None:  # type: ignore[no-untyped-def]
    args = ["trace", "--profile", str(tmp_path / "p"), f"--profile-window={window}"]
    assert main([*args, str(_script(tmp_path, "raise SystemExit(9)"))]) == 2
    err = capsys.readouterr().err
    assert f"--profile-window {window!r}" in err and "WAIT,WARMUP,ACTIVE" in err
    assert not (tmp_path / "p").exists()
