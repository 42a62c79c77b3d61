"""The Runtime in one process: choices, accumulation, logging, bad input."""

from __future__ import annotations

import fractions
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.runtime.properties import Delegate
from gpukit.runtime.settings_checks import resolve_devices
from gpukit.strategies.ddp import DDP


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _train(accumulate: int, batch: int, steps_expected: int) -> nn.Module:
    rt = gk.Runtime(devices="cpu", accumulate=accumulate, log_every=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = rt.setup(model, opt, DataLoader(_data(), batch_size=batch))
    stepped = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        stepped.append(rt.step(opt))
        rt.log(loss=loss)
    assert rt.global_step == steps_expected and sum(stepped) == steps_expected
    assert len(rt.history) == len(loader) // 2
    return model


def test_accumulation_equals_the_big_batch() -> None:
    big = _train(accumulate=1, batch=16, steps_expected=2)
    small = _train(accumulate=4, batch=4, steps_expected=2)
    for a, b in zip(big.parameters(), small.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_auto_strategy_and_device() -> None:
    rt = gk.Runtime()
    assert rt.strategy.name == "single" and rt.world_size == 1 and rt.is_global_zero
    assert rt.device == gk.device().torch and rt.device_info == gk.device()
    assert rt.rank == 0 and rt.local_rank == 0
    assert gk.Runtime(devices=2).strategy.name == ("ddp")


def test_device_is_a_torch_device_that_tensors_accept() -> None:
    rt = gk.Runtime(devices="cpu")
    assert isinstance(rt.device, torch.device)
    assert torch.ones(2).to(rt.device).device == rt.device
    assert torch.zeros(2, device=rt.device).device == rt.device
    assert torch.nn.Linear(2, 1).to(rt.device).weight.device == rt.device
    assert rt.device_info.type == "cpu" and str(rt.device_info) == str(rt.device)


def test_auto_picks_ddp_under_a_launcher(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    joined: list[int] = []  # one rank of a launched job joins its process group at once
    monkeypatch.setattr(DDP, "setup_environment", lambda self: joined.append(self.rank))
    rt = gk.Runtime()
    assert rt.strategy.name == "ddp" and rt.rank == 1 and rt.world_size == 2
    assert not rt.strategy.needs_launch and joined == [1]


def test_devices_cpu_under_a_launcher_puts_every_local_rank_on_the_cpu(
    monkeypatch, fake_gpus
) -> None:
    """Accelerate's ``cpu=True`` and Fabric's ``accelerator="cpu"``: rank 1 of 2 trains on
    the CPU over gloo, on a machine with GPUs too."""
    fake_gpus(2)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [str(d) for d in resolve_devices("cpu", launched=True)] == ["cpu", "cpu"]
    assert [str(d) for d in resolve_devices("cuda:1", launched=True)] == ["cuda:1"]
    monkeypatch.setattr(DDP, "setup_environment", lambda self: None)
    rt = gk.Runtime(devices="cpu")
    assert rt.strategy.name == "ddp" and rt.rank == 1 and rt.world_size == 2
    assert rt.device == torch.device("cpu") and rt.strategy.backend == "gloo"
    monkeypatch.setenv("WORLD_SIZE", "100000")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    with pytest.raises(gk.ConfigError, match="devices='cpu' with LOCAL_WORLD_SIZE=100000 asks"):
        resolve_devices("cpu", launched=True)


def test_log_reads_back_only_every_n_calls() -> None:
    rt = gk.Runtime(devices="cpu", log_every=3)
    for value in (1.0, 2.0, torch.tensor(6.0)):
        assert rt.history == []
        rt.log(loss=value)
    assert rt.history == [{"step": 0.0, "loss": 3.0}]


def test_print_only_on_rank_zero(capsys) -> None:
    gk.Runtime(devices="cpu").print("hello")
    assert capsys.readouterr().out == "hello\n"


def test_clipping_limits_the_gradient_norm() -> None:
    rt = gk.Runtime(devices="cpu", clip=0.5)
    model = nn.Linear(2, 1)
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
            return super().step(closure)

    opt = Spy(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    rt.backward((model(torch.full((1, 2), 100.0)) * 100).sum())
    rt.step(opt)
    assert seen[0] == pytest.approx(0.5, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_resolve_devices_spellings(fake_gpus) -> None:
    fake_gpus(2)
    assert [str(d) for d in resolve_devices("all")] == ["cuda:0", "cuda:1"]
    assert [str(d) for d in resolve_devices(2)] == ["cuda:0", "cuda:1"]
    assert [str(d) for d in resolve_devices("0,1")] == ["cuda:0", "cuda:1"]
    assert [str(d) for d in resolve_devices(["/gpu:1"])] == ["cuda:1"]
    assert [str(d) for d in resolve_devices("auto")] == ["cuda:0"]


def test_cpu_machine_counts_mean_cpu_processes(cpu_only) -> None:
    assert [str(d) for d in resolve_devices(3)] == ["cpu", "cpu", "cpu"]
    assert [str(d) for d in resolve_devices("all")] == ["cpu"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"strategy": "fsdp2"},
            r"unknown strategy 'fsdp2': use one of auto, single, dp, dp-balanced, ddp",
        ),
        ({"strategy": "single", "devices": ["cpu", "cpu"]}, r"'single' trains on one device"),
        ({"accumulate": 0}, r"accumulate=0: give a whole number of at least 1"),
        ({"log_every": 1.5}, r"log_every=1.5"),
        ({"clip": -1.0}, r"clip=-1.0: give a positive max gradient norm"),
        ({"devices": 0}, r"devices=0: give at least 1"),
        ({"devices": []}, r"devices=\[\]"),
        ({"devices": "tpu"}, r"invalid device 'tpu'"),
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(gk.GpukitError, match=message):
        gk.Runtime(**kwargs)


def test_more_gpus_than_exist(fake_gpus) -> None:
    fake_gpus(2)
    with pytest.raises(gk.ConfigError, match=r"devices=4, but this machine has 2 GPU\(s\)"):
        gk.Runtime(devices=4)


def test_ddp_without_launch_says_how_to_start_it() -> None:
    rt = gk.Runtime(devices=["cpu", "cpu"])
    with pytest.raises(gk.ConfigError, match=r"needs 2 processes.*rt\.launch\(fn\).*--nproc 2"):
        rt.setup(nn.Linear(1, 1))


def test_step_without_backward_is_an_error() -> None:
    rt = gk.Runtime(devices="cpu")
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    with pytest.raises(gk.ConfigError, match=r"without rt\.backward\(loss\)"):
        rt.step(opt)
    rt.backward(model(torch.ones(1, 1)).sum())
    assert rt.step(opt) is True
    with pytest.raises(gk.ConfigError, match="since the last step"):
        rt.step(opt)


def test_saving_inside_an_accumulation_window_warns(tmp_path) -> None:
    rt = gk.Runtime(devices="cpu", accumulate=2)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    rt.backward(model(torch.ones(1, 1)).sum())
    rt.step(opt)
    with pytest.warns(UserWarning, match="middle of an accumulation window"):
        rt.save(tmp_path)


def test_targets_out_of_range_are_caught_before_the_first_step() -> None:
    rt = gk.Runtime(devices="cpu")
    model = rt.setup(nn.Linear(3, 4))
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    with pytest.raises(gk.ConfigError, match=r"targets hold 9 but the model has 4 classes"):
        criterion(model(torch.ones(2, 3)), torch.tensor([1, 9]))
    ignoring = rt.setup_criterion(nn.CrossEntropyLoss(ignore_index=-1))
    assert ignoring(model(torch.ones(2, 3)), torch.tensor([1, -1])).shape == ()


def test_known_raw_errors_inside_a_step_come_out_in_words() -> None:
    from gpukit.errors import DeviceAssertError

    rt = gk.Runtime(devices="cpu")
    net = nn.Linear(2, 1)
    _, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def asserts(batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "CUDA error: device-side assert triggered\nCUDA kernel errors might be "
            "asynchronously reported at some other API call"
        )

    with pytest.raises(DeviceAssertError, match="gpukit trace --blocking") as caught:
        rt.train_step(optimizer, torch.ones(4, 2), asserts)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value, RuntimeError)  # old `except RuntimeError` still catches it


def test_a_logged_tensor_counts_with_the_value_it_had_when_logged() -> None:
    rt = gk.Runtime(devices="cpu", log_every=4)
    seen = torch.zeros(())
    for _ in range(4):
        seen += 1  # changed in place after each log
        rt.log(seen=seen)
    assert rt.history == [{"step": 0.0, "seen": 2.5}]


def test_log_takes_numbers() -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(gk.ConfigError, match=r"rt.log\(acc=...\) got a tensor of shape \(3,\)"):
        rt.log(acc=torch.ones(3))
    with pytest.raises(gk.ConfigError, match="got no metrics"):
        rt.log()


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("abc", "'abc', a str"),
        (None, "None, a NoneType"),
        ([1.0], r"\[1.0\], a list"),
        ((0.5,), r"\(0.5,\), a tuple"),
        (1 + 2j, r"\(1\+2j\), a complex"),
        (torch.tensor(1 + 1j), "a torch.complex64 tensor"),
        (torch.ones(2, 2), r"a tensor of shape \(2, 2\)"),
        (np.ones(1), r"array\(\[1.\]\), a ndarray"),
    ],
    ids=["str", "none", "list", "tuple", "complex", "complex-tensor", "matrix", "ndarray"],
)
def test_log_refuses_what_is_not_a_number_at_the_call(value: object, shown: str) -> None:
    """Refused where it was logged, naming the metric and what it got, and nothing of the
    call is kept: the window holds only the good values logged around it."""
    rt = gk.Runtime(devices="cpu", log_every=2)
    rt.log(loss=1.0)
    with pytest.raises(gk.ConfigError, match=rf"rt.log\(acc=...\) got {shown}: log numbers"):
        rt.log(acc=value)
    rt.log(loss=3.0)
    assert rt.history == [{"step": 0.0, "loss": 2.0}]


def test_log_takes_real_numbers_of_every_kind() -> None:
    """Bools count as 0 and 1 (their mean is a fraction); NumPy scalars and one-element
    tensors of any real dtype are numbers too."""
    rt = gk.Runtime(devices="cpu", log_every=4)
    rt.log(ok=True, n=np.int64(2), x=np.float32(0.5), t=torch.tensor([[4]]))
    rt.log(ok=False, n=4, x=1.5, t=torch.tensor(True))
    rt.log(ok=np.bool_(True), n=0, x=0.25, t=torch.tensor(1.0, dtype=torch.float64))
    rt.log(ok=torch.tensor(False), n=2, x=fractions.Fraction(3, 4), t=torch.tensor(2.0))
    assert rt.history == [{"step": 0.0, "n": 2.0, "ok": 0.5, "t": 2.0, "x": 0.75}]


def test_teardown_collects_garbage_only_where_something_waits_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The collection frees DDP's reducer while its group exists, and GPU memory held in
    # reference cycles; on a CPU alone it would only cost time in proportion to the program.
    import gpukit.runtime.runtime as runtime

    collected: list[str] = []
    real = runtime.gc.collect
    monkeypatch.setattr(runtime.gc, "collect", lambda *a: collected.append("gc") or real(*a))
    cases = (
        ("single", "cpu", False, []),
        ("ddp", 1, False, ["gc"]),
        ("single", "cpu", True, ["gc"]),
    )
    for strategy, devices, cuda_started, expected in cases:
        collected.clear()
        rt = gk.Runtime(strategy=strategy, devices=devices, seed=0)
        model = _model()  # its optimizer over its own parameters: another's is refused
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        rt.backward(model(torch.ones(2, 3)).sum())
        opt.step()
        with monkeypatch.context() as cuda:
            cuda.setattr(torch.cuda, "is_initialized", lambda started=cuda_started: started)
            rt.teardown()
        assert collected == expected, (strategy, cuda_started)
        assert not torch.distributed.is_initialized()


def test_history_steps_are_integers_and_log_metrics_records_values_as_given():
    rt = gk.Runtime(devices="cpu", log_every=1)
    rt.log(loss=torch.tensor(2.0))
    record = rt.log_metrics(val_loss=torch.tensor(0.5), acc=1)
    assert record == {"step": 0, "acc": 1.0, "val_loss": 0.5}
    assert all(type(r["step"]) is int for r in rt.history)
    assert rt.history == [{"step": 0, "loss": 2.0}, record]
    assert rt.log_metrics(third=1 / 3)["third"] == 1 / 3  # a Python float is kept, not rounded


def test_log_metrics_at_a_step_of_its_own_as_accelerate_and_fabric_log() -> None:
    """``accelerator.log({"val_loss": v}, step=epoch)`` and ``fabric.log_dict(m, step=n)``,
    ported line for line: the record carries the given step; the run's step is untouched."""
    rt = gk.Runtime(devices="cpu", log_every=1)
    model = torch.nn.Linear(2, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in range(2):
        for _ in range(3):
            loss = model(torch.ones(4, 2)).pow(2).mean()
            rt.backward(loss)
            rt.step(optimizer)
        rt.log_metrics(val_loss=loss, step=epoch)  # accelerator.log(..., step=epoch)
    rt.log_metrics(acc=0.5, step=np.int64(100))  # a NumPy integer, as from a counter array
    assert rt.global_step == 6
    assert [r["step"] for r in rt.history] == [0, 1, 100]
    assert all(type(r["step"]) is int for r in rt.history)
    assert rt.log_metrics(acc=0.25, step=0)["step"] == 0  # backwards: recorded as given
    assert rt.log_metrics(acc=0.75)["step"] == 6  # without step=: the run's own


def test_rt_log_with_a_step_points_to_log_metrics() -> None:
    rt = gk.Runtime(devices="cpu", log_every=1)
    with pytest.raises(gk.ConfigError, match=r"use rt\.log_metrics\(step=n, \*\*values\)"):
        rt.log(loss=1.0, step=3)
    assert rt.history == []


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "got no metrics"),
        ({"step": -1, "acc": 1}, "step=...) got -1, below 0: give the step"),
        ({"step": 2.0, "acc": 1}, "got 2.0, a float"),
        ({"step": True, "acc": 1}, "got True, a bool"),
        ({"step": torch.tensor(2), "acc": 1}, "step=int(t) for a tensor"),
        ({"acc": torch.ones(2)}, "shape (2,)"),
        ({"name": "x"}, "log numbers"),
    ],
)
def test_log_metrics_refuses_what_it_cannot_record(kwargs, needle):
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(gk.GpukitError, match=re.escape(needle)):
        rt.log_metrics(**kwargs)
    assert rt.history == []


def test_every_method_a_part_does_is_that_parts_own_method() -> None:
    # A Delegate names its part by attribute: a misspelt one fails here, not at a user's call.
    rt = gk.Runtime(devices="cpu")
    delegates = {n: d for n, d in vars(gk.Runtime).items() if isinstance(d, Delegate)}
    assert {"gather_for_metrics", "progress", "profile", "track", "barrier"} <= set(delegates)
    checkpoints = {"save", "load", "load_weights", "full_state_dict", "resume", "wait_for_save"}
    assert {n for n, d in delegates.items() if d.part == "_checkpointing"} == checkpoints
    assert gk.Runtime.__bases__ == (object,)  # its parts are held, never inherited
    for name, delegate in delegates.items():
        bound = getattr(rt, name)
        assert bound.__func__ is delegate.method and bound.__self__ is getattr(rt, delegate.part)
        assert bound.__name__ == name and bound.__doc__ == getattr(gk.Runtime, name).__doc__
