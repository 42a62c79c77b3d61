"""Which step is saved, with saves written in the background (``async_save``): a step counts
as saved once its write has landed, the one being written is in flight, and a stop during a
slow write names the step that is really there."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.checkpoint import writer
from gpukit.errors import Preempted
from gpukit.lifecycle import preemption


@pytest.fixture
def step_5_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background write of step 5 waits at its first file until the event is set."""
    go = threading.Event()
    real = writer.save_file

    def held(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        if (
            "step-00000005" in filename
            and threading.current_thread() is not threading.main_thread()
        ):
            go.wait(30)
        real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(writer, "save_file", held)
    yield go
    go.set()


class _Beats:
    """The part of a heartbeat the lifecycle writes (no launcher here)."""

    def __init__(self) -> None:
        self.saved_step = -1

    def beat(self, phase: str, step: int) -> None:
        pass

    def saved(self, step: int) -> None:
        self.saved_step = step


def _setup(folder: Path) -> tuple[gk.Runtime, Any, Any, Any]:
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=folder, async_save=True)
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    data = DataLoader(TensorDataset(torch.randn(80, 4), torch.randn(80, 1)), batch_size=8)
    model, opt, loader = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1), data)
    return rt, model, opt, loader


def test_a_step_is_saved_when_its_write_lands_not_when_it_starts(
    tmp_path: Path, step_5_held: threading.Event
) -> None:
    rt, model, opt, loader = _setup(tmp_path)
    beats = _Beats()
    rt.lifecycle.heartbeat = beats  # type: ignore[assignment]  # what a launcher would read
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
        if rt.global_step in (3, 5):
            rt.save()
        if rt.global_step == 5:
            break
    lifecycle = rt.lifecycle
    assert lifecycle.saved_step == 3 and lifecycle.in_flight == 5  # held: not there yet
    assert lifecycle.made(5)  # a periodic save of step 5 is not made again
    assert beats.saved_step == 3
    step_5_held.set()
    rt.wait_for_save()
    assert lifecycle.saved_step == 5 and lifecycle.in_flight is None  # told by the thread
    assert beats.saved_step == 5  # recorded with the next beat
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"


@pytest.mark.parametrize("lands", [True, False])
def test_a_stop_during_a_slow_background_write_names_the_step_saved(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step_5_held: threading.Event,
    capsys: pytest.CaptureFixture[str],
    lands: bool,
) -> None:
    """SIGTERM at step 5, whose own save the program wrote in the background: the stop waits
    for it (half of a 2 s grace); a write that lands is the one the stop names, one that does
    not is named as not saved, with the newest one that is."""
    monkeypatch.setenv("GPUKIT_FAULT", "sigterm:0:5")
    monkeypatch.setenv("GPUKIT_STOP_GRACE", "2")
    rt, model, opt, loader = _setup(tmp_path)
    timer = None
    with pytest.raises(Preempted) as caught:
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(opt)
            if rt.global_step in (3, 5):
                rt.save()
            if rt.global_step == 5 and lands:
                timer = threading.Timer(0.2, step_5_held.set)
                timer.start()
    if timer is not None:
        timer.join()
    said = str(caught.value)
    assert said.startswith("SIGTERM received: stopped after step 5 on every rank and "), said
    if lands:
        assert f"saved {tmp_path / 'step-00000005'}." in said, said
        assert rt.lifecycle.saved_step == 5
        assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    else:
        assert (
            "the checkpoint of step 5 was still being written at the end of the grace period "
            f"and is not saved (the newest checkpoint is {tmp_path / 'step-00000003'})"
        ) in said, said
        assert rt.lifecycle.saved_step == 3 and rt.lifecycle.in_flight is None
        assert not rt.lifecycle.made(5)  # given up: no checkpoint of step 5 after all
        assert (tmp_path / "latest").read_text().strip() == "step-00000003"
        assert "the checkpoint of step 5 was still being written after" in capsys.readouterr().out
    rt.teardown()


def test_a_stop_with_no_step_end_names_the_write_it_cuts_short(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Exited(Exception):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(preemption.os, "_exit", exit_)
    stop = preemption.Preemption(0, 1, lambda: None, None, newest=lambda: 2, writing=lambda: 4)
    stop.requested = "SIGTERM received"
    with pytest.raises(Exited):
        stop._give_up(1.0)
    said = capsys.readouterr().err
    assert "(the newest checkpoint is step 2; the one of step 4, still being written, is lost)" in (
        said
    ), said


def test_a_rank_with_nothing_to_write_records_its_part_at_once(tmp_path: Path) -> None:
    """Whole weights in the background: rank 0 alone writes; the other ranks' part of the
    save is done when it returns (the launcher reads the smallest step over the ranks)."""
    rt, _, _, _ = _setup(tmp_path)
    beats = _Beats()
    rt.lifecycle.heartbeat = beats  # type: ignore[assignment]
    rt.lifecycle.save_made(7, in_place=False, own_write=False)
    assert beats.saved_step == 7
    assert rt.lifecycle.saved_step == -1 and rt.lifecycle.in_flight == 7  # not landed here
    rt.lifecycle.save_made(8, in_place=False, own_write=True)
    assert beats.saved_step == 7  # this rank's thread writes: recorded when it lands
    rt.lifecycle.landed(8)
    assert beats.saved_step == 8 and rt.lifecycle.saved_step == 8
    rt.teardown()
