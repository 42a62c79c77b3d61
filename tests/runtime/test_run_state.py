"""The whole state of a run: schedulers, optimizers in containers and the program's own values
(``rt.track``) are checkpointed and restored bit for bit, on one and two processes; what a
checkpoint cannot hold, or a checkpoint that does not fit, is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit._util.tree import map_tensors
from gpukit.errors import ConfigError

STEPS = 12  # 1.5 epochs of 64 samples at a global batch of 8
SAVE_AT = 5  # the periodic save; the crash comes two steps later


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))


def _train(rt: gk.Runtime, crash_at: int | None) -> dict[str, Any] | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = DataLoader(_data(), batch_size=8 // rt.world_size, shuffle=True)
    # Built from the loader before setup, as a one-process program builds it: 1.5 epochs.
    total = len(data) * 3 // 2
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.05, total_steps=total)
    model, [optimizer], loader, scheduler = rt.setup(model, [optimizer], data, scheduler)
    stats = {"best": float("inf"), "patience": 0, "losses": torch.zeros(STEPS)}
    rt.track(stats=stats)
    while rt.global_step < STEPS:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            scheduler.step()
            # The program's own values change after the step, as programs write it: a periodic
            # save is made at the next batch, and holds them.
            stats["losses"][rt.global_step - 1] = loss.detach()
            if loss.item() < stats["best"]:
                stats["best"], stats["patience"] = loss.item(), 0
            else:
                stats["patience"] += 1
            if rt.global_step == crash_at:
                return None  # the process dies: what the last periodic save kept survives
            if rt.global_step == STEPS:
                break
    return {
        "weights": _full(rt.unwrap(model).state_dict()),
        "optimizer": _full(optimizer.state_dict()),
        "lr": scheduler.get_last_lr(),
        "group_lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict(),
        "stats": stats,
    }


def _full(tree: Any) -> Any:
    """fsdp's shards gathered (every rank calls it): plain tensors, comparable anywhere."""
    return map_tensors(tree, lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize(
    "devices, strategy",
    [
        (["cpu"], "auto"),
        pytest.param(["cpu", "cpu"], "ddp", marks=pytest.mark.processes),
        pytest.param(["cpu", "cpu"], "fsdp", marks=[pytest.mark.slow, pytest.mark.processes]),
    ],
    ids=["1-process", "2-process", "2-process-fsdp"],
)
def test_resumed_run_with_scheduler_and_tracked_state_is_bitwise_identical(
    tmp_path: Path, devices: list[str], strategy: str
) -> None:
    def runtime(folder: str) -> gk.Runtime:
        return gk.Runtime(
            strategy=strategy,
            devices=devices,
            seed=0,
            checkpoints=tmp_path / folder,
            save_every=SAVE_AT,
            resume="auto",
        )

    straight = runtime("straight").launch(_train, None)
    assert runtime("crashed").launch(_train, SAVE_AT + 2) is None
    assert (tmp_path / "crashed" / "latest").read_text().strip() == "step-00000005"
    resumed = runtime("crashed").launch(_train, None)
    _same(straight, resumed)
    assert straight["stats"]["patience"] >= 0 and straight["lr"][0] < 0.05


# -- the learning rate follows the samples seen --------------------------------------------------
EPOCHS = 2
BATCH = 4


def _one_cycle(optimizer: torch.optim.Optimizer, batches: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=EPOCHS * batches)


def _plain_curve() -> list[float]:
    """The one-process PyTorch program: the learning rate after each optimizer step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    scheduler = _one_cycle(optimizer, len(loader))
    curve = []
    for _ in range(EPOCHS):
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            curve.append(scheduler.get_last_lr()[0])
    return curve


def _ported_curve(rt: gk.Runtime) -> list[tuple[int, float]]:
    """The same program as an Accelerate example writes it: the scheduler built from
    ``len(loader)`` before setup. (samples seen, learning rate) after each optimizer step."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    scheduler = _one_cycle(optimizer, len(loader))
    model, optimizer, loader, scheduler = rt.setup(model, optimizer, loader, scheduler)
    curve = []
    for _ in range(EPOCHS):
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
            scheduler.step()
            curve.append((rt.global_step * BATCH * rt.world_size, scheduler.get_last_lr()[0]))
    return curve


@pytest.mark.processes
def test_the_learning_rate_follows_the_samples_seen_on_one_and_two_ranks() -> None:
    plain = _plain_curve()  # after each batch of BATCH samples
    one = gk.Runtime(devices="cpu", seed=0).launch(_ported_curve)
    two = gk.Runtime(devices=["cpu", "cpu"], seed=0).launch(_ported_curve)
    assert [lr for _, lr in one] == plain
    assert len(two) == len(plain) // 2
    for samples, lr in two:
        assert lr == plain[samples // BATCH - 1], samples
    assert two[-1][1] == plain[-1]  # the cycle ends where the one-process one does


@pytest.mark.processes
def test_per_optimizer_step_keeps_one_step_per_call_and_travels_to_the_ranks() -> None:
    plain = _plain_curve()
    rt = gk.Runtime(devices=["cpu", "cpu"], seed=0, scheduler_steps="per-optimizer-step")
    two = rt.launch(_ported_curve)
    assert [lr for _, lr in two] == plain[: len(two)]


def _per_epoch_curve(rt: gk.Runtime) -> list[float]:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(_data(), batch_size=BATCH)
    model, optimizer, loader, scheduler = rt.setup(model, optimizer, loader, scheduler)
    curve = []
    for _ in range(3):
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
        scheduler.step()  # once an epoch: the same data on any number of ranks
        curve.append(scheduler.get_last_lr()[0])
    return curve


@pytest.mark.processes
def test_a_scheduler_stepped_once_an_epoch_steps_once_on_two_ranks() -> None:
    two = gk.Runtime(devices=["cpu", "cpu"], seed=0).launch(_per_epoch_curve)
    assert two == [0.05, 0.025, 0.0125]


def _epochs(folder: Path, crash_after: int | None) -> list[float] | None:
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=folder, resume="auto")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(_data(), batch_size=16)
    model, optimizer, loader, scheduler = rt.setup(model, optimizer, loader, scheduler)
    while rt.global_step < 4 * len(loader):
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
        rt.save()  # before the epoch's scheduler call: the checkpoint owes it
        if rt.global_step == crash_after:
            return None
        scheduler.step()
    return [scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"]]


def test_a_save_before_the_epochs_scheduler_call_resumes_with_that_call_made(
    tmp_path: Path,
) -> None:
    straight = _epochs(tmp_path / "straight", None)
    assert _epochs(tmp_path / "crashed", 8) is None
    assert _epochs(tmp_path / "crashed", None) == straight == [0.1 / 16, 0.1 / 16]


def _setup(**options: Any) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer, Any]:
    rt = gk.Runtime(devices="cpu", seed=0, **options)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = rt.setup(model, optimizer, scheduler)
    return rt, model, optimizer, scheduler


def test_a_step_the_guard_skipped_does_not_step_the_scheduler() -> None:
    rt, model, optimizer, scheduler = _setup(nonfinite="skip", log_every=100)
    for loss_scale in (1.0, float("nan"), 1.0):
        rt.backward(model(torch.ones(1, 2)).sum() * loss_scale)
        rt.step(optimizer)
        scheduler.step()
    assert scheduler.last_epoch == 2  # the NaN step left the schedule where it was
    assert rt.skipped_steps() == 1


def test_calls_while_gradients_accumulate_do_not_step_the_scheduler() -> None:
    rt, model, optimizer, scheduler = _setup(accumulate=2)
    for _ in range(4):  # Accelerate's habit: step everything after every micro-batch
        rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(optimizer)
        scheduler.step()
    assert scheduler.last_epoch == 2 and rt.global_step == 2


# -- what cannot be saved is refused at once -----------------------------------------------------
class _Callable:
    def __init__(self) -> None:
        self.fn = lambda step: 1.0

    def __call__(self, step: int) -> float:
        return self.fn(step)


def test_setup_returns_containers_in_their_shape_and_registers_what_they_hold() -> None:
    rt = gk.Runtime(devices="cpu")
    model = nn.Linear(2, 1)
    a, b = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    scaler = torch.amp.GradScaler("cpu")
    data = DataLoader(_data(), batch_size=4)
    _, optimizers, parts = rt.setup(model, (a, b), {"train": data, "scaler": scaler})
    assert optimizers == (a, b) and rt.state.optimizers == [a, b]
    assert isinstance(parts["train"], gk.runtime.data.loader.DeviceLoader)
    assert parts["scaler"] is scaler
    assert rt.state.objects == [scaler]


@pytest.mark.parametrize(
    "given, says",
    [
        (object(), "which a checkpoint cannot hold"),
        (nn.Linear(1, 1), "set up each model with its own call"),
        ([3.0], "rt.track(name=a_dict)"),
    ],
    ids=["object", "second-model", "number-in-a-list"],
)
def test_setup_refuses_what_a_checkpoint_cannot_hold(given: Any, says: str) -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(ConfigError, match="argument 2") as err:
        rt.setup(nn.Linear(2, 1), given)
    assert says in str(err.value)


def test_setup_refuses_a_scheduler_whose_state_is_not_plain_data() -> None:
    rt = gk.Runtime(devices="cpu")
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Callable())
    with pytest.raises(ConfigError, match=r"LambdaLR.state_dict\(\)'s .*lr_lambdas.*function"):
        rt.setup(model, optimizer, scheduler)
    assert rt.state.schedulers == []


@pytest.mark.parametrize(
    "given, says",
    [
        ({"fn": lambda: 0}, "the dict's ['fn'] is a function"),
        (0.5, "cannot be restored in place"),
        (DataLoader(_data()), "is set up with rt.setup"),
    ],
    ids=["lambda", "number", "loader"],
)
def test_track_refuses_what_it_cannot_restore(given: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=r"rt\.track") as err:
        gk.Runtime(devices="cpu").track(value=given)
    assert says in str(err.value)


def test_track_refuses_nothing_and_a_name_taken_twice() -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(ConfigError, match="got nothing"):
        rt.track()
    rt.track(stats={"best": 1.0})
    with pytest.raises(ConfigError, match="already tracked"):
        rt.track(stats={"best": 2.0})


def test_a_save_of_state_that_stopped_being_plain_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    rt, _, _, _ = _setup()
    stats: dict[str, Any] = {"best": 1.0}
    rt.track(stats=stats)
    stats["fn"] = print
    with pytest.raises(ConfigError, match=r"cannot save a checkpoint: .*\['fn'\]"):
        rt.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_scheduler_steps_is_checked() -> None:
    with pytest.raises(ConfigError, match="scheduler_steps='per-epoch': use 'per-sample'"):
        gk.Runtime(devices="cpu", scheduler_steps="per-epoch")  # type: ignore[arg-type]


# -- a checkpoint that does not fit is refused, nothing changed ----------------------------------
def _saved(
    tmp_path: Path, optimizer: str = "adamw", scheduler: bool = True, **tracked: Any
) -> Path:
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(2, 1)
    kinds = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    opt = kinds[optimizer](model.parameters(), lr=0.1)
    objects: list[Any] = [opt]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(opt, 1))
    model, opt, *_ = rt.setup(model, *objects)
    if tracked:
        rt.track(**tracked)
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step(opt)
    return rt.save(tmp_path)


def _fresh(optimizer: Any = torch.optim.AdamW, scheduler: bool = True, **tracked: Any) -> Any:
    rt = gk.Runtime(devices="cpu", seed=1)
    model = nn.Linear(2, 1)
    opt = optimizer(model.parameters(), lr=0.5)
    objects: list[Any] = [opt]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(opt, 1))
    model, *_ = rt.setup(model, *objects)
    if tracked:
        rt.track(**tracked)
    return rt, model, opt


def test_an_adamw_checkpoint_is_refused_by_sgd_and_nothing_changes(tmp_path: Path) -> None:
    _saved(tmp_path)
    rt, model, opt = _fresh(torch.optim.SGD)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"the checkpoint's is torch.optim.adamw.AdamW, this run"):
        rt.load(tmp_path)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert opt.param_groups[0]["lr"] == 0.5 and "betas" not in opt.param_groups[0]


def test_parameter_groups_with_other_keys_are_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    rt, _, opt = _fresh()
    opt.param_groups[0]["name"] = "decay"  # a group key the saved run did not have
    with pytest.raises(ConfigError, match=r"parameter group 0: different keys .*has name"):
        rt.load(tmp_path)


def test_a_checkpoint_without_the_runs_scheduler_is_refused_and_the_other_way(
    tmp_path: Path,
) -> None:
    _saved(tmp_path / "without", scheduler=False)
    rt, _, _ = _fresh()
    with pytest.raises(ConfigError, match=r"0 scheduler\(s\) in the checkpoint .*1 now .*StepLR"):
        rt.load(tmp_path / "without")
    _saved(tmp_path / "with")
    rt, _, _ = _fresh(scheduler=False)
    with pytest.raises(ConfigError, match=r"1 scheduler\(s\) in the checkpoint .*StepLR.*0 now"):
        rt.load(tmp_path / "with")


def test_tracked_names_must_match_and_are_restored_in_place(tmp_path: Path) -> None:
    _saved(tmp_path, stats={"best": 0.25, "seen": torch.arange(3)})
    rt, _, _ = _fresh(other={"best": 0.0})
    with pytest.raises(ConfigError, match="holds stats, this run tracks other"):
        rt.load(tmp_path)
    stats: dict[str, Any] = {"best": 9.0}
    rt, _, _ = _fresh(stats=stats)
    rt.load(tmp_path)
    assert stats["best"] == 0.25 and torch.equal(stats["seen"], torch.arange(3))


def test_a_checkpoint_written_before_these_entries_loads_where_nothing_is_missing(
    tmp_path: Path,
) -> None:
    from gpukit.checkpoint import files

    path = _saved(tmp_path, scheduler=False)
    state = torch.load(path / files.STATE, weights_only=True)
    for key in ("optimizer_types", "optimizer_groups", "schedulers", "objects", "tracked"):
        del state[key]
    torch.save(state, path / files.STATE)
    files.write_manifest(path, 1, [])
    rt, _, opt = _fresh(scheduler=False)
    assert rt.load(tmp_path) == {"epoch": 0, "step": 1}
    assert opt.param_groups[0]["lr"] == 0.1
    rt, _, _ = _fresh()
    with pytest.raises(ConfigError, match="holds no scheduler state"):
        rt.load(tmp_path)


# -- every kind of scheduler, and a scaler of the program's own, round-trips ---------------------
def _half(step: int) -> float:
    return 0.5**step


_S = torch.optim.lr_scheduler
SCHEDULERS: dict[str, Any] = {
    "LambdaLR": lambda o: _S.LambdaLR(o, _half),
    "MultiplicativeLR": lambda o: _S.MultiplicativeLR(o, lambda step: 0.9),
    "StepLR": lambda o: _S.StepLR(o, 2),
    "MultiStepLR": lambda o: _S.MultiStepLR(o, [1, 3]),
    "ConstantLR": lambda o: _S.ConstantLR(o, 0.5, total_iters=3),
    "LinearLR": lambda o: _S.LinearLR(o, 0.1, total_iters=4),
    "ExponentialLR": lambda o: _S.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o: _S.PolynomialLR(o, total_iters=6),
    "CosineAnnealingLR": lambda o: _S.CosineAnnealingLR(o, 6),
    "CosineAnnealingWarmRestarts": lambda o: _S.CosineAnnealingWarmRestarts(o, 2),
    "CyclicLR": lambda o: _S.CyclicLR(o, 0.01, 0.1, step_size_up=2),
    "OneCycleLR": lambda o: _S.OneCycleLR(o, 0.1, total_steps=10),
    "SequentialLR": lambda o: _S.SequentialLR(
        o, [_S.LinearLR(o, 0.1, total_iters=2), _S.ExponentialLR(o, 0.9)], milestones=[2]
    ),
    "ChainedScheduler": lambda o: _S.ChainedScheduler(
        [_S.ConstantLR(o, 0.5, total_iters=2), _S.ExponentialLR(o, 0.9)]
    ),
    "ReduceLROnPlateau": lambda o: _S.ReduceLROnPlateau(o, patience=0),
}


def _scheduled(
    kind: str, steps: int, folder: Path | None = None, load: bool = False
) -> tuple[Any, Any, Any]:
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    model, optimizer, scheduler, scaler = rt.setup(
        model, optimizer, SCHEDULERS[kind](optimizer), scaler
    )
    if load:
        rt.load(folder)
    for i in range(steps):
        rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(optimizer)
        scheduler.step(*([1.0 + i % 2] if kind == "ReduceLROnPlateau" else []))
    if not load and folder is not None:
        scaler.scale(torch.ones(()))  # the scaler makes its scale lazily
        scaler.update(2.0**7)
        rt.save(folder)
    return optimizer, scheduler, scaler


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_every_scheduler_kind_resumes_exactly(tmp_path: Path, kind: str) -> None:
    optimizer, scheduler, _ = _scheduled(kind, 6)
    _scheduled(kind, 3, tmp_path)
    resumed_optimizer, resumed, scaler = _scheduled(kind, 3, tmp_path, load=True)
    state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    _same(state, {k: v for k, v in resumed.state_dict().items() if k != "lr_lambdas"})
    _same(optimizer.state_dict(), resumed_optimizer.state_dict())
    assert scaler.get_scale() == 2.0**7


def test_a_checkpoint_of_another_scheduler_class_or_other_objects_is_refused(
    tmp_path: Path,
) -> None:
    _scheduled("StepLR", 1, tmp_path)
    rt = gk.Runtime(devices="cpu")
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)
    rt.setup(model, optimizer, scheduler, torch.amp.GradScaler("cpu"))
    with pytest.raises(ConfigError, match=r"scheduler 0: the checkpoint's is .*StepLR, this run's"):
        rt.load(tmp_path)
    rt = gk.Runtime(devices="cpu")
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rt.setup(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2))
    with pytest.raises(ConfigError, match=r"1 object\(s\) in the checkpoint \(.*GradScaler\), 0"):
        rt.load(tmp_path)


class _KeepsAMethod(torch.optim.lr_scheduler.StepLR):
    """Holds one of its own bound methods in its state, as OneCycleLR's anneal_func did in
    older torch: made again by the constructor, so not saved."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.anneal = self._anneal
        super().__init__(optimizer, 1)

    def _anneal(self) -> float:
        return 1.0


def test_a_schedulers_own_bound_methods_are_left_to_its_constructor(tmp_path: Path) -> None:
    rt, model, optimizer = _fresh(scheduler=False)
    scheduler = rt.setup(model, _KeepsAMethod(optimizer))[1]
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step(optimizer)
    scheduler.step()
    rt.save(tmp_path)
    rt, model, optimizer = _fresh(scheduler=False)
    scheduler = rt.setup(model, _KeepsAMethod(optimizer))[1]
    rt.load(tmp_path)
    assert scheduler.last_epoch == 1 and scheduler.anneal() == 1.0


def test_a_step_the_scaler_skipped_does_not_step_the_scheduler_and_repeats_stop_at_the_end() -> (
    None
):
    from gpukit.runtime.schedulers import Scheduler

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    wrapped = Scheduler(_S.OneCycleLR(optimizer, 0.1, total_steps=5), repeats=2)
    wrapped.optimizer_stepped(optimizer, ran=False)  # 16-mixed: the gradients overflowed
    wrapped.step()
    assert wrapped.last_epoch == 0
    for _ in range(3):  # 6 steps asked of a 5-step cycle (padded shards): the last is not made
        optimizer.step()
        wrapped.optimizer_stepped(optimizer, ran=True)
        wrapped.step()
    assert wrapped.last_epoch == 5
    # A cycle over epochs whose padded shards asked for more steps than it holds: the last
    # call finds the cycle ended, and makes none (as Accelerate's prepared scheduler).
    optimizer.step()
    wrapped.optimizer_stepped(optimizer, ran=True)
    wrapped.step()
    assert wrapped.last_epoch == 5


def test_a_scheduler_stepped_around_the_wrapper_over_several_ranks_warns_once() -> None:
    from gpukit.runtime.schedulers import Scheduler

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = _S.StepLR(optimizer, 1)
    wrapped = Scheduler(scheduler, repeats=2)  # what rt.setup returned, left unused
    optimizer.step()
    scheduler.step()
    with pytest.warns(UserWarning, match="StepLR was stepped directly, not through what rt.setup"):
        wrapped.optimizer_stepped(optimizer, ran=True)
        scheduler.step()
        wrapped.optimizer_stepped(optimizer, ran=True)  # once
