"""`gpukit train --resume` on a run that has nothing left to train says so, exits 0 and
leaves its --out folder as it was (no empty run's metrics, no 0 samples/s summary)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.train.loop import TrainConfig, fit

RUN = ["train", "--workload", "mlp", "--log-every", "2"]


def _files(out: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(out).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(("asked", "said"), [("4", "step 4 of the 4"), ("2", "step 4 past the 2")])
def test_resuming_a_finished_run_says_it_is_complete_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], asked: str, said: str
) -> None:
    assert main([*RUN, "--max-steps", "4", "--out", str(tmp_path)]) == 0
    before = _files(tmp_path)
    assert "metrics.json" in before and "metrics.csv" in before
    capsys.readouterr()
    assert main([*RUN, "--max-steps", asked, "--out", str(tmp_path), "--resume"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, however the console wrapped it
    assert "already complete" in out and said in out, out
    assert "raise --max-steps" in out and "--overwrite" in out
    assert "Training summary" not in out and "samples/s" not in out
    assert _files(tmp_path) == before  # metrics, plot and checkpoints as they were


def test_fit_raises_run_complete_for_a_program(tmp_path: Path) -> None:
    config = TrainConfig(workload="mlp", max_steps=2, out=str(tmp_path), progress=False)
    gk.Runtime(devices="cpu").launch(fit, config)
    with pytest.raises(gk.RunComplete, match="at step 2 of the 2 steps asked for"):
        gk.Runtime(devices="cpu").launch(fit, TrainConfig(**{**config.__dict__, "resume": True}))
    # Asking for more trains on from the checkpoint.
    more = TrainConfig(**{**config.__dict__, "resume": True, "max_steps": 3})
    assert gk.Runtime(devices="cpu").launch(fit, more)["steps"] == 3
