"""gpukit train's loop and command line: outputs, resume, DDP, and bad requests."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.train import report
from gpukit.train.loop import ProgressLines, TrainConfig, fit, micro_batch
from gpukit.workloads import Workload


def test_train_writes_metrics_csv_plot_and_checkpoints(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert (
        main(["train", "--workload", "mlp", "--epochs", "2", "--out", str(out), "--log-every", "4"])
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["workload"] == "mlp" and metrics["steps"] == 64 and metrics["world_size"] == 1
    assert metrics["strategy"] == "single" and metrics["precision"] == "32"
    assert metrics["samples_per_s"] > 0 and metrics["final_loss"] < 1.0
    assert list(metrics["peak_memory"]) == ["cpu"] and metrics["mfu"] is None
    (row,) = metrics["memory"]["devices"]
    assert row["device"] == "cpu" and row["peak"] > 0 and row["total"] > row["peak"]
    assert metrics["memory"]["imbalance"] is None and metrics["oom_retries"] == []
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert list(rows[0]) == [
        "step",
        "epoch",
        "elapsed",
        "lr",
        "loss",
        "val_accuracy",
        "val_loss",
        "data_wait",
        "data_wait_fraction",
    ]
    trained = [r for r in rows if r["loss"]]
    # Each training row's window says how long its steps waited for their batches; the run's
    # total is in metrics.json, over the training time samples_per_s is measured over.
    waits = [float(r["data_wait"]) for r in trained]
    assert all(w >= 0 for w in waits) and all(
        0 <= float(r["data_wait_fraction"]) <= 1 for r in trained
    )
    assert metrics["data_wait"] == pytest.approx(sum(waits))
    assert metrics["data_wait_fraction"] == pytest.approx(sum(waits) / metrics["seconds"])
    assert metrics["data_wait_device"] is None  # CUDA only
    assert len(trained) == 64 // 4 and all(float(r["lr"]) == 3e-3 for r in rows)
    # A validation row at the end of each epoch, after that step's training row.
    checked = [(int(r["step"]), int(r["epoch"])) for r in rows if r["val_loss"]]
    assert checked == [(32, 1), (64, 2)] and rows[-1]["val_loss"] and not rows[-1]["loss"]
    elapsed = [float(r["elapsed"]) for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert metrics["final_val_loss"] == float(rows[-1]["val_loss"])
    assert [v["step"] for v in metrics["validation"]] == [32, 64]
    assert 0.5 < metrics["final_val_accuracy"] <= 1.0
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000064"
    summary = capsys.readouterr().out
    assert "Training summary" in summary and "samples/s" in summary
    assert re.search(r"waiting for data +│ \d+\.\d\d s \(\d+\.\d% of the time\)", summary)
    assert "Memory per device" in summary


def test_the_final_progress_line_shows_the_last_loss_read_back(capsys) -> None:
    # 3 steps, none at a logging interval: the loss is read back after the loop, and the last
    # line shows it rather than "nan"; before any read-back it shows "-".
    assert main(["train", "--workload", "mlp", "--max-steps", "3", "--log-every", "50"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train ")]
    assert lines[0].startswith("train 0/3 steps") and "loss -," in lines[0]
    assert re.search(r"^train 3/3 steps \(100%\), epoch 1/1, loss \d+\.\d{4}, ", lines[-1])


def test_max_steps_then_resume_continues_to_the_same_end(tmp_path: Path) -> None:
    straight = gk.Runtime(devices="cpu", seed=0).launch(
        fit, TrainConfig(workload="mlp", epochs=1, out=str(tmp_path / "a"))
    )
    gk.Runtime(devices="cpu", seed=0).launch(
        fit, TrainConfig(workload="mlp", epochs=1, max_steps=10, out=str(tmp_path / "b"))
    )
    resumed = gk.Runtime(devices="cpu", seed=0).launch(
        fit, TrainConfig(workload="mlp", epochs=1, out=str(tmp_path / "b"), resume=True)
    )
    assert resumed["steps"] == straight["steps"] == 32
    weights = [
        (tmp_path / run / "checkpoints" / "step-00000032" / "model.safetensors")
        for run in ("a", "b")
    ]
    assert weights[0].read_bytes() == weights[1].read_bytes()  # bitwise the same model


# A workload whose loss fails at a chosen step: a run that dies between two checkpoints.
_DIE_AT: list[int] = []


class _MseThatDies(torch.nn.MSELoss):
    calls = 0

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if _DIE_AT and type(self).calls == _DIE_AT[0]:
            raise RuntimeError("the machine went away")
        return super().forward(output, target)


def small_workload(seed: int) -> Workload:
    """4 steps of 16 samples per epoch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return Workload("small", torch.nn.Linear(4, 1), data, _MseThatDies(), 16, 0.05, 3, 0.0)


def _csv_rows(path: Path) -> list[dict[str, str]]:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("step,epoch,elapsed,lr,loss")
    assert lines.count(lines[0]) == 1  # one header
    return list(csv.DictReader(lines))


def _csv_steps(path: Path) -> list[int]:
    """The steps of the training rows (those with a loss; validation rows have none)."""
    return [int(r["step"]) for r in _csv_rows(path) if r["loss"]]


def test_resume_appends_to_metrics_csv_after_a_run_that_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plotted: list[list[float]] = []
    real_plot = report._plot_loss

    def spy(path: Path, history: list[dict[str, float]], *args: object) -> None:
        plotted.append([r["step"] for r in history])
        real_plot(path, history, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(report, "_plot_loss", spy)
    config = TrainConfig(
        workload="tests.train.test_loop:small_workload", out=str(tmp_path), progress=False
    )
    # Dies in the 7th step: the checkpoint of epoch 1 (step 4) is the newest, but metrics.csv,
    # written as the run goes, already has the rows of steps 2, 4 and 6.
    monkeypatch.setattr(_MseThatDies, "calls", 0)
    monkeypatch.setattr(sys.modules[__name__], "_DIE_AT", [7])
    with pytest.raises(RuntimeError, match="went away"):
        gk.Runtime(devices="cpu", seed=0, log_every=2).launch(fit, config)
    assert _csv_steps(tmp_path / "metrics.csv") == [2, 4, 6]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    before = (tmp_path / "metrics.csv").read_text().splitlines()[1:3]

    monkeypatch.setattr(sys.modules[__name__], "_DIE_AT", [])
    resumed = gk.Runtime(devices="cpu", seed=0, log_every=2).launch(
        fit, TrainConfig(**{**asdict(config), "resume": True})
    )
    # Step 6 of the run that died is dropped (it is trained again), every step is there once,
    # and the rows of steps 2 and 4 are the first run's own.
    steps = _csv_steps(tmp_path / "metrics.csv")
    assert steps == [2, 4, 6, 8, 10, 12]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1:3] == before
    assert plotted == [[2, 4, 6, 8, 10, 12]]  # loss.png: the whole run
    assert resumed["steps"] == 12 and resumed["resumed_from_step"] == 4
    assert resumed["final_loss"] == float(_csv_rows(tmp_path / "metrics.csv")[-1]["loss"])
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["steps"] == 12 and on_disk["resumed_from_step"] == 4


def test_resume_from_the_end_of_a_finished_run_keeps_its_rows(tmp_path: Path) -> None:
    args = ["train", "--workload", "mlp", "--max-steps", "8", "--log-every", "4"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    first = (tmp_path / "metrics.csv").read_text()
    assert main([*args, "--max-steps", "12", "--out", str(tmp_path), "--resume"]) == 0
    text = (tmp_path / "metrics.csv").read_text()
    assert text.startswith(first) and _csv_steps(tmp_path / "metrics.csv") == [4, 8, 12]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert metrics["final_loss"] == float(rows[-2]["loss"])  # the last row: validation's
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [8, 12]
    assert metrics["final_val_loss"] == float(rows[-1]["val_loss"])
    assert metrics["steps"] == 12 and metrics["resumed_from_step"] == 8


def test_a_fresh_run_replaces_metrics_csv(tmp_path: Path) -> None:
    args = ["train", "--workload", "mlp", "--log-every", "2", "--out", str(tmp_path)]
    assert main([*args, "--max-steps", "6"]) == 0
    assert main([*args, "--max-steps", "2", "--overwrite"]) == 0
    assert _csv_steps(tmp_path / "metrics.csv") == [2]


def test_ddp_on_one_device_trains_as_one_process(tmp_path: Path) -> None:
    args = ["train", "--workload", "mlp", "--strategy", "ddp", "--devices", "1"]
    assert main([*args, "--max-steps", "4", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "ddp" and metrics["world_size"] == 1 and metrics["steps"] == 4
    import torch.distributed as dist

    assert not dist.is_initialized()  # the process group of one is gone with the run


def _progress_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("train ")]


@pytest.mark.processes
def test_off_a_terminal_progress_is_plain_lines(tmp_path: Path) -> None:
    # stdout is a pipe: no bar, a line per step with --progress-every 0. The loss is the one
    # last read back (every 2 steps), never one read for the line.
    args = ["--workload", "mlp", "--max-steps", "6", "--log-every", "2", "--progress-every", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    progress = done.stdout[: done.stdout.index("Training summary")]
    assert "━" not in progress and "\r" not in progress and "\x1b" not in progress  # no bar
    lines = _progress_lines(done.stdout)
    assert len(lines) == len(progress.splitlines())
    assert [line.split()[1] for line in lines] == ["0/6", "1/6", "2/6", "3/6", "4/6", "5/6", "6/6"]
    assert all(", epoch 1/1, " in line for line in lines)
    losses = [re.search(r"loss ([^,]+),", line).group(1) for line in lines]  # type: ignore[union-attr]
    assert losses[:2] == ["-", "-"] and all(re.fullmatch(r"\d+\.\d{4}", v) for v in losses[2:])
    assert losses[2] == losses[3] and losses[4] == losses[5]  # changes only when read back
    assert re.search(r", \d+ samples/s, ETA \d+:\d\d:\d\d$", lines[-1])


def test_off_a_terminal_each_epoch_starts_and_ends_with_a_line(capsys) -> None:
    # mlp: 32 steps per epoch. A long interval leaves only the epochs' lines.
    args = ["--epochs", "2", "--progress-every", "100000"]
    assert main(["train", "--workload", "mlp", *args]) == 0
    lines = _progress_lines(capsys.readouterr().out)
    assert [(line.split()[1], line.split(", ")[1]) for line in lines] == [
        ("0/64", "epoch 1/2"),
        ("32/64", "epoch 1/2"),
        ("32/64", "epoch 2/2"),
        ("64/64", "epoch 2/2"),
    ]


def test_progress_lines_come_every_n_seconds_of_the_clock() -> None:
    ticks = iter([0.0, 0.0, 5.0, 29.0, 30.0, 45.0, 61.0, 62.0, 70.0])
    out = io.StringIO()
    lines = ProgressLines(10, 1, 4, 0, every=30, clock=ticks.__next__, out=out)
    history: list[dict[str, float]] = []
    with lines:
        lines.epoch_start(1, 0, history)  # 0 s
        for step, _ in zip(range(1, 7), range(6), strict=True):  # 5, 29, 30, 45, 61, 62 s
            if step == 3:
                history.append({"step": 3.0, "loss": 0.75})
            lines.advance(step, history)
        lines.finish(10, history)  # 70 s
    shown = [
        (line.split()[1], line.split("loss ")[1].split(",")[0])
        for line in out.getvalue().splitlines()
    ]
    assert shown == [("0/10", "-"), ("3/10", "0.7500"), ("5/10", "0.7500"), ("10/10", "0.7500")]


def test_progress_lines_read_nothing_back_from_the_device(capsys) -> None:
    # A line after every step, and metrics.csv written as the run goes: still only rt.log's
    # read-backs (20 steps / 5).
    rt = gk.Runtime(devices="cpu", seed=0, log_every=5)
    config = TrainConfig(
        workload="mlp", max_steps=20, progress_every=0, sample=False, validate=False
    )
    with gk.trace() as t:
        fit(rt, config)
    assert len(_progress_lines(capsys.readouterr().out)) == 21
    assert sum(s.count for s in t.syncs) == 4, [(s.file, s.line, s.count) for s in t.syncs]


@pytest.mark.processes
def test_on_a_terminal_the_progress_bar_stays(tmp_path: Path) -> None:
    import os
    import pty

    controller, terminal = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    done = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "train", "--workload", "mlp", "--max-steps", "3"],
        stdout=terminal,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the other end closed: the process is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert done.wait(timeout=180) == 0, done.stderr.read() if done.stderr else ""
    output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert re.search(r"train .*━.* 3/3 steps loss \d+\.\d{4}", output), output
    assert "train 0/3 steps (0%)" not in output  # no plain lines on a terminal


@pytest.mark.processes
def test_two_process_ddp_training(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpukit",
            "train",
            "--workload",
            "mlp",
            "--devices",
            "2",
            "--epochs",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "ddp" and metrics["world_size"] == 2
    assert sorted(metrics["peak_memory"]) == ["cpu (rank 0)", "cpu (rank 1)"]
    assert [r["rank"] for r in metrics["memory"]["devices"]] == [0, 1]
    assert metrics["memory"]["imbalance"] >= 1.0
    assert all(r["peak"] > 0 and r["total"] > 0 for r in metrics["memory"]["devices"])


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
def test_single_process_data_parallel_training(strategy: str, tmp_path: Path, capsys) -> None:
    args = ["train", "--workload", "mlp", "--strategy", strategy, "--devices", "cpu,cpu,cpu"]
    assert main([*args, "--max-steps", "6", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == strategy and metrics["world_size"] == 1
    assert metrics["devices"] == ["cpu", "cpu", "cpu"] and metrics["steps"] == 6


def _final_weights(folder: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(folder / "checkpoints" / "step-00000006" / "model.safetensors"))


def test_train_recovers_from_out_of_memory_with_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    base = ["train", "--workload", "mlp", "--batch-size", "32", "--max-steps", "6"]
    assert main([*base, "--out", str(tmp_path / "clean")]) == 0
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    assert main([*base, "--out", str(tmp_path / "faulty")]) == 0
    metrics = json.loads((tmp_path / "faulty" / "metrics.json").read_text())
    assert [e["micro_batch_after"] for e in metrics["oom_retries"]] == [16, 8]
    assert metrics["micro_batch"] == 8 and metrics["global_batch"] == 32
    assert "out-of-memory retries" in capsys.readouterr().out
    clean, faulty = _final_weights(tmp_path / "clean"), _final_weights(tmp_path / "faulty")
    for name, value in clean.items():
        assert (faulty[name] - value).abs().max().item() <= 1e-5, name  # type: ignore[operator]


def test_train_with_oom_raise_explains_and_exits_one(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    args = [
        "train",
        "--workload",
        "mlp",
        "--batch-size",
        "32",
        "--max-steps",
        "2",
        "--oom",
        "raise",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "out of memory on cpu" in err and "what to try" in err and "Traceback" not in err


def test_a_raw_out_of_memory_error_is_explained_by_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import torch

    from gpukit.cli import train

    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def boom(args: object) -> int:
        raise oom_type(
            "CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 10.76 GiB total capacity; "
            "9.12 GiB already allocated; 51.69 MiB free; 9.45 GiB reserved in total by PyTorch)"
        )

    monkeypatch.setattr(train, "run", boom)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert "64 MiB" in err and "what to try" in err


def test_gpt_prints_a_text_sample(capsys) -> None:
    assert main(["train", "--workload", "gpt", "--max-steps", "3"]) == 0
    assert "Sample of generated text" in capsys.readouterr().out


def test_gpt_samples_with_the_model_inside_the_dp_wrapper() -> None:
    # The sampler takes the user's model as it is: fit hands it rt.unwrap(model).
    config = TrainConfig(workload="gpt", max_steps=1, progress=False)
    metrics = gk.Runtime(strategy="dp", devices="cpu,cpu").launch(fit, config)
    assert metrics["devices"] == ["cpu", "cpu"] and len(metrics["sample"]) == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "zero3"], "unknown strategy 'zero3'"),
        (["--precision", "16-mixed"], "'16-mixed' needs a CUDA GPU"),
        (["--devices", "2", "--batch-size", "1"], "batch size 1 cannot be split over 2 rank"),
        (["--batch-size", "4096"], "use a smaller --batch-size"),
        (["--resume"], "--resume needs --out DIR"),
        (["--resume", "--out", "OUT"], "no checkpoint in"),
        (["--workload", "no_such_module:build"], "cannot import module 'no_such_module'"),
        (["--epochs", "0"], "--epochs 0: give 1 or more"),
        (["--progress-every", "-1"], "progress_every=-1.0: give the seconds"),
    ],
)
def test_bad_requests_are_one_line_errors_with_exit_code_two(
    tmp_path: Path, args: list[str], message: str, capsys
) -> None:
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    workload = [] if "--workload" in args else ["--workload", "mlp"]
    assert main(["train", *workload, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_micro_batch_splits_the_global_batch() -> None:
    assert micro_batch(64, 2, 4) == 8
    with pytest.raises(gk.ConfigError, match=r"use a multiple of 8, e\.g\. 56 or 64"):
        micro_batch(60, 2, 4)
