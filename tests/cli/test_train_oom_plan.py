"""`gpukit train` out of memory: the explanation ends with the planner's figures for the run
and its remedies, the same as gk.plan's; a planner that fails leaves the explanation alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gpukit as gk
from gpukit._util.text import format_bytes
from gpukit.cli import train
from gpukit.cli.__main__ import build_parser, main
from gpukit.diagnostics.oom_message import OOM_ERROR
from gpukit.planning import remedies

GiB = 2**30
# The pretend out-of-memory error: micro-batches above 16 samples fail, worded as the
# allocator of the device the run uses (this machine's CPU: the tests run without a GPU).
COMMAND = ["train", "--workload", "mlp", "--max-steps", "2", "--oom", "raise"]
HEADING = "the planner's figures for this run (per device, tensors"


def test_the_figures_follow_the_explanation_with_the_planners_numbers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "16")
    assert main(COMMAND) == 1
    err = capsys.readouterr().err
    assert os.environ["GPUKIT_FAULT_OOM_ABOVE"] == "16"  # put back after planning
    explanation, _, figures = err.partition(HEADING)
    assert explanation.startswith("gpukit train: out of memory on cpu") and figures
    assert "what to try, best first" in explanation and "Traceback" not in err
    monkeypatch.delenv("GPUKIT_FAULT_OOM_ABOVE")  # gk.plan itself would obey it
    # mlp's batch of 64 on this machine's one device, as gpukit train ran it; the CPU's
    # message has no capacity, so the planner's is this machine's.
    asked = {"devices": 1, "strategies": ["single"]}
    run = gk.plan("mlp", **asked).plans[0]  # type: ignore[arg-type]
    halved = gk.plan("mlp", batch=64, accumulate=2, **asked).plans[0]  # type: ignore[arg-type]
    assert halved.fits
    assert "; this device holds " in figures.splitlines()[0]  # the machine's memory
    figures = " ".join(figures.split())  # as one line: long ones are wrapped
    assert (
        f" as run: single on 1, micro-batch 64: {format_bytes(run.peak_bytes)} peak "
        f"({run.method.replace('-', ' ')}) — fits by the planner's count" in figures
    )
    assert (
        f" micro-batch 32, accumulate 2 (--accumulate 2): {format_bytes(halved.peak_bytes)}"
        " — fits " in figures
    )
    assert "(--strategy fsdp --activation-checkpointing selective)" in figures


def test_a_planner_that_fails_leaves_the_plain_explanation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the planner broke")

    monkeypatch.setattr(remedies, "plan", broken)
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "16")
    assert main(COMMAND) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpukit train: out of memory on cpu")
    assert "what to try, best first" in err and "injected by GPUKIT_FAULT_OOM_ABOVE=16" in err
    assert HEADING not in err and "planner broke" not in err and "Traceback" not in err


def test_an_error_outside_a_training_step_is_explained_with_figures_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = (
        "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of "
        "10.00 GiB of which 20.00 MiB is free."
    )

    def setup_fails(rt: object, config: object) -> None:
        raise OOM_ERROR(message)  # torch's own error, as model.to(device) raises it

    monkeypatch.setattr(train, "fit", setup_fails)
    with pytest.raises(gk.OutOfMemory) as caught:
        train.run(build_parser().parse_args(COMMAND))
    assert isinstance(caught.value.__cause__, OOM_ERROR)  # the original, as gk.OutOfMemory keeps
    text = str(caught.value)
    assert text.startswith("out of memory on cuda:0: asked for 64 MiB with 20 MiB free of 10 GiB")
    assert f"{HEADING}; this device holds 10 GiB):\n  as run: single on 1, micro-batch 64" in text


@pytest.mark.processes
@pytest.mark.slow
def test_each_launched_rank_adds_the_figures_and_the_launcher_report_is_unchanged() -> None:
    env = {**os.environ, "GPUKIT_FAULT_OOM_ABOVE": "16"}
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", *COMMAND, "--devices", "2", "--strategy", "ddp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    # One per rank, each ran out. Each rank works its figures out after its error, and the
    # launcher gives the others 1.5 s after the first failure: on a loaded machine the second
    # rank may still be at it when it is stopped, which the launcher then says.
    said = done.stderr.count(HEADING)
    assert said == 2 or (said == 1 and "stopped by the launcher" in done.stderr), done.stderr
    assert "  as run: ddp on 2, micro-batch 32: " in done.stderr
    assert "  fsdp on 2 (--strategy fsdp): " in done.stderr
    # The simulation's Runtime stayed out of the job: the launcher still sees where it failed.
    assert "at step 0 (phase forward) — the first failure" in done.stderr
