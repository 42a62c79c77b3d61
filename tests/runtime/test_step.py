"""Out-of-memory recovery: re-split, same result, ranks agree, and an explanation when it ends."""

from __future__ import annotations

import datetime
import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from gpukit.errors import ConfigError, OutOfMemory

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).cos())


def _train(rt: gk.Runtime, batch: int = 32, epochs: int = 2) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(_data(), batch_size=batch // rt.world_size, shuffle=True)
    if rt.world_size == 1:
        # One process keeps a DataLoader's own RandomSampler, as plain PyTorch would; the order
        # the ranks split between them is a DistributedSampler's with the run's seed.
        order = DistributedSampler(_data(), num_replicas=1, rank=0, seed=0)
        loader = DataLoader(_data(), batch_size=batch, sampler=order)
    model, optimizer, loader = rt.setup(model, optimizer, loader)

    def compute_loss(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(b[0]), b[1])

    for _ in range(epochs):
        for xy in loader:
            rt.log(loss=rt.train_step(optimizer, xy, compute_loss))
    rt.flush_logs()
    weights = {k: v.numpy().copy() for k, v in rt.unwrap(model).state_dict().items()}
    return {"weights": weights, "events": rt.oom_events, "split": rt.oom_split}  # type: ignore[dict-item]


def _assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = 1e-5) -> None:
    for name in a:
        diff = np.abs(a[name] - b[name]).max()
        assert diff <= tol, f"{name}: max abs diff {diff}"


def test_single_process_recovers_with_the_same_weights(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean = _train(gk.Runtime(devices="cpu", seed=0, oom="recover"))
    assert clean["events"] == [] and clean["split"] == 1
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    with caplog.at_level(logging.WARNING, logger="gpukit"):
        faulty = _train(gk.Runtime(devices="cpu", seed=0, oom="recover"))
    _assert_close(faulty["weights"], clean["weights"])  # type: ignore[arg-type]
    # 32 -> 2 x 16 (still too big) -> 4 x 8, found at the first step and kept after it.
    assert faulty["split"] == 4
    events = faulty["events"]
    assert [(e["micro_batch_before"], e["micro_batch_after"]) for e in events] == [
        (32, 16),
        (16, 8),
    ]
    assert all(e["step"] == 0 for e in events)
    assert "injected by GPUKIT_FAULT_OOM_ABOVE=8" in events[0]["error"]
    logged = [r.getMessage() for r in caplog.records]
    assert any("retrying the step as 4 micro-batches of at most 8" in m for m in logged)


@pytest.mark.processes
def test_two_ddp_processes_agree_and_match_the_clean_run(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], seed=0, oom="recover").launch(_train)
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")  # per rank: 16 samples -> 2 x 8
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], seed=0, oom="recover")
    faulty = rt.launch(_train)
    _assert_close(faulty["weights"], clean["weights"])
    assert faulty["split"] == 2 and len(faulty["events"]) == 1
    # And both equal the one-process run on the same global batch.
    monkeypatch.delenv("GPUKIT_FAULT_OOM_ABOVE")
    single = _train(gk.Runtime(devices="cpu", seed=0))
    _assert_close(faulty["weights"], single["weights"])  # type: ignore[arg-type]


def _fail_on_rank_one_only(rt: gk.Runtime) -> dict[str, object]:
    """Rank 1 runs out of memory at its first step; rank 0 never does."""
    torch.manual_seed(0)
    # BatchNorm: its buffers are what DDP's forward would broadcast, a collective to avoid.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    failures = {"left": 1 if rt.rank == 1 else 0}

    def compute_loss(b: torch.Tensor) -> torch.Tensor:
        if failures["left"] and b.shape[0] > 4:
            failures["left"] -= 1
            raise OOM("CUDA out of memory. Tried to allocate 8.00 MiB.")
        return model(b).pow(2).mean()

    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rt.rank))
        rt.train_step(optimizer, x, compute_loss)
    user = rt.unwrap(model)
    # Weights only: BatchNorm statistics follow DDP's own rule (rank 0's are shared before
    # each step's first forward, then each rank updates them with its batch), which
    # tests/runtime/test_ddp_fidelity.py compares with a plain DDP program.
    state = [user[0].weight.detach().clone(), user[2].weight.detach().clone()]
    everyone = rt.strategy.all_gather_object(state)
    return {
        "split": rt.oom_split,
        "same": all(
            torch.equal(a, b) for other in everyone for a, b in zip(state, other, strict=True)
        ),
    }


@pytest.mark.processes
def test_one_rank_failing_alone_does_not_leave_the_other_waiting() -> None:
    # A short collective timeout: a rank left waiting fails the test in a minute, not ten.
    ddp = gk.strategies.DDP(timeout=datetime.timedelta(seconds=60))
    rt = gk.Runtime(strategy=ddp, devices=["cpu", "cpu"], oom="recover")
    result = rt.launch(_fail_on_rank_one_only)
    assert result["split"] == 2  # rank 0 re-split too, though it never failed
    assert result["same"]  # gradients averaged over both ranks after the retry


def test_accumulation_and_recovery_compose(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = _train(gk.Runtime(devices="cpu", seed=0, accumulate=2))
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "5")
    faulty = _train(gk.Runtime(devices="cpu", seed=0, accumulate=2, oom="recover"))
    _assert_close(faulty["weights"], clean["weights"])  # type: ignore[arg-type]
    assert faulty["split"] == 4  # 2 x 16 -> 4 x 8 -> 8 x 4


def test_raise_mode_explains_instead_of_recovering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    with pytest.raises(OutOfMemory) as caught:
        _train(gk.Runtime(devices="cpu", seed=0))
    message = str(caught.value)
    assert "out of memory" in message and "micro-batch" in message
    assert isinstance(caught.value.__cause__, OOM)


def test_gives_up_with_the_explanation_when_one_sample_does_not_fit() -> None:
    rt = gk.Runtime(devices="cpu", oom="recover")
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)

    def never_fits(b: torch.Tensor) -> torch.Tensor:
        raise OOM(
            "CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 2.00 GiB is free. Including non-PyTorch memory, this process "
            "has 77.10 GiB memory in use. Of the allocated memory 70.00 GiB is allocated by "
            "PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated."
        )

    with pytest.raises(OutOfMemory, match="30 GiB"):
        rt.train_step(optimizer, torch.ones(4, 2), never_fits)
    assert [e["micro_batch_after"] for e in rt.oom_events] == [2, 1]
    assert all(p.grad is None for p in model.parameters())  # the failed step left nothing


def test_other_errors_pass_through_untouched() -> None:
    rt = gk.Runtime(devices="cpu", oom="recover")
    net = nn.Linear(2, 1)
    _, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=1))

    def broken(b: torch.Tensor) -> torch.Tensor:
        raise KeyError("not memory")

    with pytest.raises(KeyError, match="not memory"):
        rt.train_step(optimizer, torch.ones(4, 2), broken)
    assert rt.oom_events == []


class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise OOM(
            "CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 10.76 GiB total "
            "capacity; 9.12 GiB already allocated; 51.69 MiB free; 9.45 GiB reserved in "
            "total by PyTorch)"
        )


def test_backward_of_the_manual_loop_explains_out_of_memory() -> None:
    rt = gk.Runtime(devices="cpu")
    model = rt.setup(nn.Linear(2, 1))
    loss = _OomInBackward.apply(model(torch.ones(3, 2))).sum()
    with pytest.raises(OutOfMemory, match="64 MiB"):
        rt.backward(loss)


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="oom='retry'"):
        gk.Runtime(devices="cpu", oom="retry")  # type: ignore[arg-type]
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "lots")
    with pytest.raises(ConfigError, match="GPUKIT_FAULT_OOM_ABOVE='lots'"):
        gk.Runtime(devices="cpu")
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "0")
    with pytest.raises(ConfigError, match="at least 1"):
        gk.Runtime(devices="cpu")


def test_a_batch_without_tensors_is_refused() -> None:
    rt = gk.Runtime(devices="cpu")
    net = nn.Linear(2, 1)
    _, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=1))
    with pytest.raises(ConfigError, match="no tensor"):
        rt.train_step(optimizer, ["a", "b"], lambda b: torch.zeros(()))


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_recovered(capsys: pytest.CaptureFixture[str]) -> None:
    """Each sample needs 1/20 of the free memory: 32 samples cannot fit, 8 can."""
    device = torch.device("cuda:0")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    per_sample = free // 20 // 4  # float32 elements

    def run(oom: str, split: int) -> tuple[gk.Runtime, torch.Tensor]:
        torch.manual_seed(0)
        rt = gk.Runtime(devices="cuda:0", precision="32", oom=oom)  # type: ignore[arg-type]
        rt.oom_split = split
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)

        def compute_loss(b: torch.Tensor) -> torch.Tensor:
            scratch = torch.ones(b.shape[0] * per_sample, device=device)
            return model(b).pow(2).mean() + scratch[0] * 0

        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)).to(device)
        rt.train_step(optimizer, x, compute_loss)
        return rt, rt.unwrap(model).weight.detach().clone()

    with pytest.raises(OutOfMemory) as caught:
        run("raise", 1)
    print(caught.value)  # the explanation of a real message, for the record
    assert "what to try" in str(caught.value)
    rt, recovered = run("recover", 1)
    assert rt.oom_events and rt.oom_split >= 2
    _, reference = run("raise", 4)
    assert (recovered - reference).abs().max().item() <= 1e-6


class _Noisy(nn.Module):
    """BatchNorm and dropout: a failed attempt changes buffers and consumes random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _noisy_run(
    split: int, fail_once_on_micro_batch: int | None, accumulate: int = 2
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    rt = gk.Runtime(devices="cpu", accumulate=accumulate, oom="recover")
    rt.oom_split = split
    model = _Noisy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    calls = {"n": 0}

    def compute_loss(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls["n"] += 1
        loss = nn.functional.mse_loss(model(b[0]), b[1])
        if calls["n"] == fail_once_on_micro_batch:  # after a forward: buffers and RNG moved
            raise OOM("CUDA out of memory. Tried to allocate 8.00 MiB.")
        return loss

    data = _data()
    for _ in range(3):
        rt.train_step(optimizer, (data.tensors[0][:32], data.tensors[1][:32]), compute_loss)
    assert rt.oom_split == 2
    return {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()}


def test_a_failed_attempt_leaves_no_trace_in_buffers_or_random_numbers() -> None:
    clean = _noisy_run(split=2, fail_once_on_micro_batch=None)
    # The second micro-batch of the first attempt fails after the first one already updated
    # BatchNorm's statistics and drew dropout masks.
    recovered = _noisy_run(split=1, fail_once_on_micro_batch=2)
    for name, value in clean.items():
        assert torch.allclose(recovered[name].float(), value.float(), atol=1e-6), name


def test_a_whole_batch_that_fails_in_one_process_is_put_back_before_it_is_cut() -> None:
    """One micro-batch per step, recovering in one process: the step runs as a plain loop's
    (the whole batch, no cutting machinery); its failure after the forward is undone (buffers,
    random numbers, gradients) before the batch is cut in two."""
    clean = _noisy_run(split=2, fail_once_on_micro_batch=None, accumulate=1)
    recovered = _noisy_run(split=1, fail_once_on_micro_batch=1, accumulate=1)
    for name, value in clean.items():
        assert torch.equal(recovered[name], value), name


def _ddp_train_step(rt: gk.Runtime) -> dict[str, np.ndarray]:
    return _train(rt)


@pytest.mark.processes
def test_ddp_train_step_without_recovery_keeps_the_overlapped_path() -> None:
    single = _train(gk.Runtime(devices="cpu", seed=0, accumulate=2))
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], seed=0, accumulate=2, oom="raise")
    distributed = rt.launch(_ddp_train_step)
    _assert_close(distributed["weights"], single["weights"], tol=1e-6)  # type: ignore[arg-type]


def test_recovery_refuses_a_forward_that_talks_to_other_ranks() -> None:
    # DDP itself refuses SyncBatchNorm on CPUs, so the check is called as DDP's path would.
    rt = gk.Runtime(devices="cpu", oom="recover")
    rt.setup(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)))
    with pytest.raises(ConfigError, match=r"SyncBatchNorm at 1.*oom='raise'"):
        rt._stepper.retry.refuse_collective_forward()


def test_the_split_found_is_kept_in_checkpoints(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    rt = gk.Runtime(devices="cpu", oom="recover")
    net = nn.Linear(2, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.train_step(optimizer, torch.ones(32, 2), lambda b: model(b).pow(2).mean())
    assert rt.oom_split == 4
    rt.save(tmp_path)  # type: ignore[arg-type]
    fresh = gk.Runtime(devices="cpu", oom="recover")
    other = nn.Linear(2, 1)
    fresh.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
    fresh.load(tmp_path)  # type: ignore[arg-type]
    assert fresh.oom_split == 4


def test_out_of_memory_is_still_caught_as_a_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    with pytest.raises(RuntimeError, match="out of memory"):  # what plain-torch code catches
        _train(gk.Runtime(devices="cpu", seed=0))


def test_a_failed_attempts_graph_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a loss whose backward finished is kept until the next forward; a failed one (its
    graph holds the activations) goes at once, and so does any loss once batches are cut."""
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "8")
    rt = gk.Runtime(devices="cpu", oom="recover")
    net = nn.Linear(2, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.train_step(optimizer, torch.ones(16, 2), lambda b: model(b).pow(2).mean())
    assert rt.oom_split == 2 and rt._stepper._previous_loss is None
    strict = gk.Runtime(devices="cpu")
    model, optimizer = strict.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    strict.train_step(optimizer, torch.ones(4, 2), lambda b: model(b).pow(2).mean())
    assert strict._stepper._previous_loss is not None  # a good step's loss: as a plain loop
    with pytest.raises(gk.OutOfMemory):
        strict.train_step(optimizer, torch.ones(16, 2), lambda b: model(b).pow(2).mean())
    assert strict._stepper._previous_loss is None
    strict.teardown()
    assert strict._stepper._previous_loss is None and not strict._stepper._clip_params


def test_a_split_brought_by_a_checkpoint_is_kept_without_recovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "2")
    rt = gk.Runtime(devices="cpu", oom="raise")  # accumulate=1: the shortest path, unless split
    net = nn.Linear(2, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.oom_split = 4  # as rt.load sets it
    rt.train_step(optimizer, torch.ones(8, 2), lambda b: model(b).pow(2).mean())
    assert rt.global_step == 1


def test_a_buffer_changed_between_steps_does_not_block_recovery(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = gk.Runtime(devices="cpu", oom="recover")
    net = nn.Linear(2, 1)
    net.register_buffer("scale", torch.ones(1))  # never changed by the forward
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loss = lambda b: (model(b) * net.scale).pow(2).mean()  # noqa: E731
    rt.train_step(optimizer, torch.ones(8, 2), loss)
    rt.save(tmp_path)  # type: ignore[arg-type]
    rt.load(tmp_path)  # type: ignore[arg-type]  # writes every buffer in place
    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "4")
    rt._stepper.fault = type(rt._stepper.fault).from_env()
    rt.train_step(optimizer, torch.ones(8, 2), loss)
    assert rt.oom_split == 2


def test_a_buffer_changed_by_a_failed_attempt_without_a_copy_refuses_the_retry() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.register_buffer("calls", torch.zeros(()))
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                self.calls += 1  # a write the first step never made
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
            return self.lin(x)

    rt = gk.Runtime(devices="cpu", oom="recover")
    net = Counting()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.train_step(optimizer, torch.ones(8, 2), lambda b: model(b).pow(2).mean())
    net.fail = True
    with pytest.raises(ConfigError, match="calls changed in place during the failed attempt"):
        rt.train_step(optimizer, torch.ones(8, 2), lambda b: model(b).pow(2).mean())


def test_clipping_follows_a_new_optimizer_even_at_a_reused_address() -> None:
    rt = gk.Runtime(devices="cpu", clip=0.01)
    for _ in range(3):
        net = nn.Linear(4, 1)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
        before = net.weight.detach().clone()
        rt.backward(model(torch.ones(2, 4) * 100).sum())
        rt.step(optimizer)
        # Clipped to a norm of 0.01 with lr=1: no weight moves by more than that.
        assert (net.weight - before).abs().max() <= 0.01 + 1e-6
        assert rt._stepper._params(optimizer)[0] is net.weight
        del optimizer, model


def test_recovery_that_never_cuts_trains_bit_for_bit_as_without_it() -> None:
    """One process, one micro-batch: with oom="recover" the step is the plain loop's (the
    whole batch) after saving what a retry would need, and computes exactly what it does."""

    def run(oom: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        rt = gk.Runtime(devices="cpu", oom=oom)  # type: ignore[arg-type]
        model = _Noisy()
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        data = _data()
        for i in range(4):
            batch = (data.tensors[0][i * 8 : i * 8 + 8], data.tensors[1][i * 8 : i * 8 + 8])
            rt.train_step(optimizer, batch, lambda b: nn.functional.mse_loss(model(b[0]), b[1]))
        return {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()}

    recovering, plain = run("recover"), run("raise")
    for name, value in plain.items():
        assert torch.equal(recovering[name], value), name
