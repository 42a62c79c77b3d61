"""The simulation: gpukit's training code over fake tensors predicts the peak of live tensors
that the same code measures over real ones, to the byte; and it leaves nothing behind."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.errors import GpukitError
from gpukit.planning.simulate import STEPS, SimulationUnsupported, simulate
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import load_workload


def measured_single(name: str, micro_batch: int) -> int:
    """The same sequence as the simulation, on real tensors, in this process."""
    workload = load_workload(name, seed=0)
    rt = Runtime(devices="cpu", precision="32", seed=0, log_every=STEPS + 1)
    model = workload.model
    live = LiveTensors()
    with live:
        optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
        live.watch(model, [optimizer])
        model, optimizer = rt.setup(model, optimizer)
        live.watch(rt.unwrap(model), [optimizer])
        live.file_made("communication")
        criterion = rt.setup_criterion(workload.loss)
        items = [workload.dataset[i] for i in range(micro_batch)]
        for _ in range(STEPS):
            batch = torch.utils.data.default_collate(items)
            loss = rt.train_step(optimizer, batch, lambda b: criterion(model(b[0]), b[1]))
            rt.log(loss=loss)
            del batch, loss
    rt.teardown()
    return live.peak["cpu"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_single_device_prediction_equals_the_measured_peak_to_the_byte(name: str) -> None:
    micro = 16
    (predicted,) = simulate(name, strategy="single", devices=1, micro_batch=micro)
    assert predicted.peak_bytes == measured_single(name, micro)


def test_more_ranks_hold_less_under_fsdp_and_no_more_under_ddp() -> None:
    fsdp = [
        simulate("gpt", strategy="fsdp", devices=n, micro_batch=4)[0].peak_bytes
        for n in (1, 2, 8, 64)
    ]
    ddp = [
        simulate("gpt", strategy="ddp", devices=n, micro_batch=4)[0].peak_bytes
        for n in (1, 2, 8, 64)
    ]
    assert fsdp == sorted(fsdp, reverse=True) and fsdp[0] > fsdp[-1]
    assert len(set(ddp)) == 1  # a replica per rank: the same whatever the count
    assert all(f < d for f, d in zip(fsdp[1:], ddp[1:], strict=True))


def test_ddp_holds_its_buckets_as_communication() -> None:
    (single,) = simulate("mlp", strategy="single", devices=1, micro_batch=8)
    ddp = simulate("mlp", strategy="ddp", devices=2, micro_batch=8)
    params = sum(p.numel() * 4 for p in load_workload("mlp").model.parameters())
    assert ddp[0].breakdown["communication"] == params
    assert ddp[0].peak_bytes == single.peak_bytes + params
    assert [d.device for d in ddp] == ["rank 0", "rank 1"]


def test_granularity_rounds_each_storage_up() -> None:
    exact = simulate("mlp", strategy="single", devices=1, micro_batch=8)[0]
    rounded = simulate("mlp", strategy="single", devices=1, micro_batch=8, granularity=512)[0]
    assert rounded.peak_bytes > exact.peak_bytes and rounded.peak_bytes % 512 == 0


def test_it_leaves_random_state_process_group_and_patches_as_they_were() -> None:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    resize = torch.UntypedStorage.resize_
    simulate("mlp", strategy="fsdp", devices=2, micro_batch=4)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])
    assert not dist.is_initialized()
    assert torch.UntypedStorage.resize_ is resize
    assert torch.ones(2).tolist() == [1.0, 1.0]  # no fake mode left active


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"strategy": "dp", "devices": 2}, "threads"),
        ({"strategy": "ddp", "devices": 2, "activation_checkpointing": "full"}, "fsdp setting"),
        ({"strategy": "single", "devices": 1, "micro_batch": 10**9}, "at most"),
    ],
)
def test_what_it_cannot_run_it_says(kwargs: dict, said: str) -> None:
    kwargs.setdefault("micro_batch", 4)
    with pytest.raises(SimulationUnsupported, match=said):
        simulate("mlp", **kwargs)


def test_a_process_already_in_a_group_is_refused() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SimulationUnsupported, match="already joined"):
            simulate("mlp", strategy="ddp", devices=2, micro_batch=4)
    finally:
        dist.destroy_process_group()


def test_a_model_that_reads_values_in_its_forward_is_refused_with_the_reason() -> None:
    from torch import nn

    from gpukit.workloads.base import Workload

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x) if x.sum() > 0 else -self.layer(x)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    workload = Workload("branchy", Branchy(), data, nn.MSELoss(), 4, 0.1, 1, 0.0)
    with pytest.raises(SimulationUnsupported, match="could not run on fake tensors"):
        simulate(workload, strategy="single", devices=1, micro_batch=4)
    assert isinstance(SimulationUnsupported("x"), GpukitError)


def test_the_same_case_twice_gives_the_same_peak() -> None:
    """Nothing the first simulation leaves cached (DTensor's sharding, the optimizer's
    choices) changes the next one's count."""
    first = [
        simulate("mlp", strategy="fsdp", devices=n, micro_batch=8)[0].peak_bytes for n in (1, 2)
    ]
    again = [
        simulate("mlp", strategy="fsdp", devices=n, micro_batch=8)[0].peak_bytes for n in (1, 2)
    ]
    assert first == again


def test_a_program_under_no_grad_or_a_trace_can_plan() -> None:
    import gpukit as gk

    expected = simulate("mlp", strategy="single", devices=1, micro_batch=8)[0].peak_bytes
    with torch.no_grad():
        assert (
            simulate("mlp", strategy="single", devices=1, micro_batch=8)[0].peak_bytes == expected
        )
    with torch.inference_mode():
        assert (
            simulate("mlp", strategy="single", devices=1, micro_batch=8)[0].peak_bytes == expected
        )
    with gk.trace() as t:
        simulate("mlp", strategy="fsdp", devices=2, micro_batch=8)
    assert not t.syncs and not t.transfers  # the simulation's own reads are not the program's


def test_gpus_that_have_not_started_are_not_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)
    simulate("gpt", strategy="single", devices=1, micro_batch=4)
    assert calls == []  # seeding them would be queued for when CUDA starts, after the program's
    assert torch.cuda.manual_seed_all == calls.append  # and the program's own function is back


def test_a_huge_micro_batch_costs_no_memory_and_little_time() -> None:
    (peak,) = simulate("cnn", strategy="single", devices=1, micro_batch=50_000)
    assert peak.peak_bytes > 10 * 2**30  # far beyond this machine's 2-core CI box's budget


def test_launch_and_fault_variables_of_this_process_do_not_steer_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = simulate("mlp", strategy="ddp", devices=2, micro_batch=8)[0].peak_bytes
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert simulate("mlp", strategy="ddp", devices=2, micro_batch=8)[0].peak_bytes == expected
    import os

    assert os.environ["RANK"] == "1" and os.environ["GPUKIT_FAULT_OOM_ABOVE"] == "1"
