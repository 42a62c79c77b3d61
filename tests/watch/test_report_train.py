"""The page ``gpukit train --out DIR`` writes at the end of its run: a real run of one
process, finished or failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.cli.__main__ import main
from gpukit.watch.report import REPORT

SRC = str(Path(__file__).resolve().parents[2] / "src")

FAILING = """
import torch
from torch import nn


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 12:
            raise RuntimeError("the model broke at its 13th forward")
        return self.linear(x)


def make():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return Failing(), data, nn.MSELoss()
"""


def test_a_finished_run_writes_its_page_with_its_plots(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--workload", "mlp", "--max-steps", "20", "--out", str(out)]
    assert main([*args, "--log-every", "5"]) == 0
    page = (out / REPORT).read_text()
    assert set(re.findall(r'<figure id="([^"]+)"><svg', page)) == {"loss", "data-wait"}
    assert 'class="status-finished">finished<' in page
    assert "<th>steps</th><td>20 of 20</td>" in page
    assert "no per-rank records (ranks.jsonl): this run was one process" in page
    # The run's end plans it with the closed form, at once.
    assert re.search(r"planned: single on 1 x [^<]+\(closed-form\)", page)


def test_a_failed_run_writes_its_page_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "failing_model.py").write_text(FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    args = ["train", "--workload", "failing_model:make", "--batch-size", "16", "--out", str(out)]
    with pytest.raises(RuntimeError, match="13th forward"):
        main([*args, "--log-every", "5"])
    page = (out / REPORT).read_text()
    assert 'class="status-failed">failed<' in page
    assert "failed: the model broke at its 13th forward" in page
    assert '<figure id="loss"><svg' in page  # the losses read back before it broke


def test_a_request_refused_before_training_writes_no_page(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--workload", "mlp", "--lr", "0", "--out", str(out)]) == 2
    assert not (out / REPORT).exists()


def _launched(args: list[str], cwd: Path, fault: str = "") -> tuple[int, str]:
    """``gpukit train`` as a user runs it, over two gloo ranks under gpukit's launcher."""
    env = {**os.environ, "PYTHONPATH": SRC, "GPUKIT_FAULT": fault}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "gpukit", "train", "--workload", "mlp", "--devices", "2"]
    done = subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.processes
def test_the_launcher_writes_the_page_of_the_whole_job_finished_or_failed(tmp_path: Path) -> None:
    code, output = _launched(["--max-steps", "6", "--log-every", "2", "--out", "ok"], tmp_path)
    assert code == 0, output
    page = (tmp_path / "ok" / REPORT).read_text()
    assert 'class="status-finished">finished<' in page
    assert "<th>ranks</th><td>2</td>" in page and "<th>strategy</th><td>ddp</td>" in page
    code, output = _launched(
        ["--max-steps", "6", "--log-every", "2", "--out", "broke"], tmp_path, "raise:0:4"
    )
    assert code == 1, output
    page = (tmp_path / "broke" / REPORT).read_text()
    assert 'class="status-failed">failed<' in page
    assert "failed or hung (exit code 1)" in page


def test_a_page_that_cannot_be_written_is_a_warning_not_a_failed_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / REPORT).mkdir(parents=True)  # a folder where the page goes
    args = ["train", "--workload", "mlp", "--max-steps", "4", "--out", str(out)]
    with pytest.warns(UserWarning, match=r"no report\.html in .*a folder stands where the file"):
        assert main([*args, "--log-every", "2"]) == 0
    assert (out / "metrics.json").exists()
