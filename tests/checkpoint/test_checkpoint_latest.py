"""A `latest` file never leads a run outside its checkpoint folder."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import checkpoint


def _run(checkpoints: Path, steps: int) -> gk.Runtime:
    """A Runtime that trained ``steps`` steps and saved after each into ``checkpoints``."""
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=checkpoints, keep=10)
    model = nn.Linear(2, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(optimizer)
        rt.save()
    return rt


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """``run/ckpt`` with the checkpoints of steps 1 and 2, and beside it ``elsewhere`` holding
    a good checkpoint of step 9 that the run must never load."""
    ckpt = tmp_path / "run" / "ckpt"
    _run(ckpt, 2).teardown()
    _run(tmp_path / "other", 9).teardown()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "other" / "step-00000009", elsewhere / "step-00000009")
    return ckpt, elsewhere


@pytest.mark.parametrize("form", ["relative", "absolute", "dot-dot-etc"])
def test_latest_naming_a_folder_outside_is_ignored_with_a_warning(
    folders: tuple[Path, Path], form: str
) -> None:
    ckpt, elsewhere = folders
    named = {
        "relative": "../../elsewhere/step-00000009",
        "absolute": str(elsewhere / "step-00000009"),
        "dot-dot-etc": "../../etc",
    }[form]
    (ckpt / "latest").write_text(named + "\n")
    with pytest.warns(UserWarning, match="is not a checkpoint folder inside") as caught:
        assert checkpoint.latest(ckpt) == ckpt / "step-00000002"
    assert "resuming from step-00000002" in str(caught[0].message)
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=ckpt, resume="auto")
    model = nn.Linear(2, 2)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=re.escape(repr(named))):
        assert rt.resume() == {"epoch": 0, "step": 2}


def test_a_link_to_a_folder_outside_is_no_checkpoint_of_the_run(
    folders: tuple[Path, Path],
) -> None:
    """step-00000009 inside, a link to the good checkpoint elsewhere: neither `latest` naming
    it nor the search for the newest good one loads it."""
    ckpt, elsewhere = folders
    (ckpt / "step-00000009").symlink_to(elsewhere / "step-00000009")
    (ckpt / "latest").write_text("step-00000009\n")
    with pytest.warns(UserWarning, match="'step-00000009', which is not a checkpoint folder"):
        assert checkpoint.latest(ckpt) == ckpt / "step-00000002"
    (ckpt / "latest").unlink()
    with pytest.warns(UserWarning, match="no 'latest' file .* resuming from step-00000002"):
        assert checkpoint.latest(ckpt) == ckpt / "step-00000002"


def test_latest_outside_and_nothing_good_inside_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("/etc\n")
    with pytest.raises(gk.ConfigError, match=r"names '/etc', which is not a checkpoint folder"):
        checkpoint.latest(ckpt)
