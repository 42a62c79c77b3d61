"""gpukit train's loop and command line: outputs, resume, DDP, and bad requests."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.workloads.loop import TrainConfig, fit, micro_batch


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
    assert rows[0].keys() == {"step", "loss"} and len(rows) == 64 // 4
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000064"
    summary = capsys.readouterr().out
    assert "Training summary" in summary and "samples/s" in summary
    assert "Memory per device" in summary


def test_the_final_progress_bar_shows_the_last_loss_read_back(capsys) -> None:
    # 3 steps, none at a logging interval: the loss is read back after the loop, and the bar
    # shows it rather than "nan"; before any read-back it shows "-".
    assert main(["train", "--workload", "mlp", "--max-steps", "3", "--log-every", "50"]) == 0
    bar = next(line for line in capsys.readouterr().out.splitlines() if "3/3 steps" in line)
    assert re.search(r"3/3 steps loss \d+\.\d{4} ", bar), bar


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
    assert "out of memory on cuda:0" in err and "what to try" in err and "Traceback" not in err


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
