"""The Runtime's collectives, with 1 process and 2 gloo processes: tensors on any device and
numbers, main_process_first, a rank-0-only save that fails fast, and the last logging window."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.strategies.collectives import all_gather, all_reduce, broadcast

DDP2 = {"strategy": "ddp", "devices": ["cpu", "cpu"], "seed": 0}


def test_one_process_collectives_give_back_what_they_got() -> None:
    rt = gk.Runtime(devices="cpu")
    assert rt.all_reduce(3) == 3 and rt.all_reduce(2.5, "max") == 2.5
    assert torch.equal(rt.all_reduce(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert torch.equal(rt.all_gather(7), torch.tensor([7]))
    assert rt.all_gather(torch.ones(2)).shape == (1, 2)
    assert rt.broadcast({"vocab": 5}) == {"vocab": 5}
    with rt.main_process_first():
        pass


def test_an_accelerate_evaluation_loop_sums_what_all_gather_returns() -> None:
    """``accelerator.gather(correct).sum()`` and ``fabric.all_gather(n).sum()``, line for
    line: a number or a tensor comes back as a tensor with one row per rank, in a dict too."""
    rt = gk.Runtime(devices="cpu")
    outputs, labels = torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])
    correct = (outputs.argmax(1) == labels).sum()
    assert rt.all_gather(correct).sum().item() == 1  # a 0-d tensor: shape [1]
    assert rt.all_gather(len(labels)).sum().item() == 2  # a number: a 1-d tensor
    assert rt.all_gather(0.5).dtype == torch.float64  # exact, as the number was
    totals = rt.all_gather({"correct": correct, "seen": (len(labels),)})
    assert totals["correct"].shape == (1,) and torch.equal(totals["seen"][0], torch.tensor([2]))


def test_a_value_that_is_no_tensor_or_number_is_refused_where_it_is() -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(gk.ConfigError, match=r"got None at data\.names\[1\]: it gathers"):
        rt.all_gather({"names": [1, None]})
    with pytest.raises(gk.ConfigError, match="or a dict, list or tuple of them"):
        rt.all_gather(object())


def test_anything_else_is_a_clear_error() -> None:
    single = gk.Runtime(devices="cpu").strategy
    for call in (
        lambda: all_reduce(single, [1, 2], "sum"),  # type: ignore[arg-type]
        lambda: all_gather(single, "text"),  # type: ignore[arg-type]
    ):
        with pytest.raises(gk.ConfigError, match=r"give a tensor \(on any device\) or a Python"):
            call()
    assert broadcast(single, ["any", "object"], 0) == ["any", "object"]


def _collectives(rt: gk.Runtime, folder: str) -> dict[str, Any]:
    cpu = torch.tensor([float(rt.rank + 1)])  # a CPU tensor, as NCCL would refuse
    out: dict[str, Any] = {
        "sum_int": rt.all_reduce(rt.rank + 1, "sum"),
        "mean_float": rt.all_reduce(float(rt.rank), "mean"),
        "max_tensor": rt.all_reduce(cpu, "max"),
        "gather_numbers": rt.all_gather(rt.rank * 10),
        "gather_tensor": rt.all_gather(torch.full((2,), float(rt.rank))),
        # Accelerate's and Fabric's idiom: the gathered count summed over the ranks
        "gather_sum": rt.all_gather(rt.rank + 1).sum().item(),
        "gather_nested": rt.all_gather({"n": rt.rank, "x": [torch.tensor([rt.rank, 1.0])]}),
        "broadcast_object": rt.broadcast({"from": rt.rank}, src=1),
        "broadcast_tensor": rt.broadcast(torch.tensor([rt.rank + 5]), src=0),
    }
    marker = Path(folder) / "downloaded"
    with rt.main_process_first():
        if rt.rank == 0:
            marker.write_text("data")  # the "download"
        out["saw_download"] = marker.read_text() == "data"
    out["saw_on_every_rank"] = rt.all_gather(int(out["saw_download"])).tolist()
    out["input_left_alone"] = torch.equal(cpu, torch.tensor([float(rt.rank + 1)]))
    return out


@pytest.mark.processes
def test_two_processes_combine_tensors_on_any_device_and_numbers(tmp_path: Path) -> None:
    out = gk.Runtime(**DDP2).launch(_collectives, str(tmp_path))
    assert out["sum_int"] == 3 and isinstance(out["sum_int"], int)
    assert out["mean_float"] == 0.5
    assert torch.equal(out["max_tensor"], torch.tensor([2.0]))
    assert out["max_tensor"].device.type == "cpu"
    assert torch.equal(out["gather_numbers"], torch.tensor([0, 10]))
    assert out["gather_sum"] == 3
    assert torch.equal(out["gather_nested"]["n"], torch.tensor([0, 1]))
    assert torch.equal(out["gather_nested"]["x"][0], torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    assert torch.equal(out["gather_tensor"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert out["broadcast_object"] == {"from": 1}
    assert torch.equal(out["broadcast_tensor"], torch.tensor([5]))
    assert out["saw_download"] and out["saw_on_every_rank"] == [1, 1]
    assert out["input_left_alone"]


def _save_on_rank_zero_only(rt: gk.Runtime, folder: str) -> None:
    model = torch.nn.Linear(2, 1)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if rt.rank == 0:  # the common habit that hangs a collective save
        rt.save(folder)
    else:
        # Rank 1 goes on to its next collective, as a training loop would.
        rt.barrier()


@pytest.mark.processes
def test_a_save_called_on_rank_zero_only_fails_naming_the_other_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_COLLECTIVE_CHECK_TIMEOUT", "2")
    with pytest.raises(gk.DistributedError) as err:
        gk.Runtime(**DDP2).launch(_save_on_rank_zero_only, str(tmp_path / "ckpt"))
    message = str(err.value)
    assert "rank 0: rt.save is collective" in message
    assert "rank(s) 1 did not call it within 2 s" in message
    assert "not under `if rank == 0:`" in message
    assert not (tmp_path / "ckpt").exists()  # nothing half-written


def _train_and_read_history(rt: gk.Runtime, rank_zero_only: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model = torch.nn.Linear(4, 1)
    model, optimizer, loader = rt.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)
    )
    for _ in range(2):  # 5 steps per rank and epoch; log_every=50 never fills a window
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            rt.log(loss=loss)
    out: dict[str, Any] = {}
    if rank_zero_only:
        if rt.is_global_zero:  # safe: each pass's end closed its window on every rank
            out["history"] = list(rt.history)
        return out
    rt.log(extra=1.0)  # logged after the loop: the window closes when this function returns
    out["before_return"] = list(rt.history)
    if rt.world_size == 1:
        out["runtime"] = rt  # (runs in this process: its history is seen after the return)
    return out


@pytest.mark.processes
@pytest.mark.parametrize("rank_zero_only", [True, False])
def test_the_last_partial_window_is_read_back(rank_zero_only: bool) -> None:
    for settings in ({"devices": "cpu"}, DDP2):
        rt = gk.Runtime(**settings, log_every=50)
        out = rt.launch(_train_and_read_history, rank_zero_only)
        per_epoch = 10 // rt.world_size
        if rank_zero_only:
            history = out["history"]
            assert [r["step"] for r in history] == [per_epoch, 2 * per_epoch]
            assert all("loss" in r for r in history)
        else:
            assert len(out["before_return"]) == 2
        if "runtime" in out:
            assert out["runtime"].history[2] == {"step": 2.0 * per_epoch, "extra": 1.0}


def _steps_then_history(rt: gk.Runtime) -> list[dict[str, float]]:
    for step in range(7):  # nanoGPT-style: no loader, a step count, log_every=5
        rt.log(loss=float(step))
    return rt.history


def _steps_launched_then_history(rt: gk.Runtime) -> list[dict[str, float]]:
    rt.launch(_steps_then_history)
    return rt.history


@pytest.mark.processes
def test_the_window_left_open_at_the_end_of_the_launched_function_is_read_back() -> None:
    rt = gk.Runtime(devices="cpu", log_every=5)
    rt.launch(_steps_then_history)
    assert [r["step"] for r in rt.history] == [0.0, 0.0] and rt.history[1]["loss"] == 5.5
    ranks = gk.Runtime(**DDP2, log_every=5)
    history = ranks.launch(_steps_launched_then_history)  # a nested launch runs in place
    assert [r["loss"] for r in history] == [2.0, 5.5]


def test_a_bad_check_timeout_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpukit import _env

    for bad in ("soon", "-1", "0", "inf"):
        monkeypatch.setenv("GPUKIT_COLLECTIVE_CHECK_TIMEOUT", bad)
        with pytest.raises(gk.ConfigError, match="give a positive number of seconds"):
            _env.collective_check_timeout()
    monkeypatch.delenv("GPUKIT_COLLECTIVE_CHECK_TIMEOUT")
    assert _env.collective_check_timeout() == 30.0
    assert os.environ.get("GPUKIT_COLLECTIVE_CHECK_TIMEOUT") is None
