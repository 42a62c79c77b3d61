"""dp and dp-balanced on lists of CPU devices: the same scatter/replicate/apply path as on GPUs."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError
from gpukit.strategies import PerDevice
from gpukit.strategies._parallel import parallel_apply, replicate

CPUS = {2: ["cpu", "cpu"], 3: ["cpu", "cpu", "cpu"]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss_and_grads(strategy: str, devices: object, n: int) -> tuple[float, list[torch.Tensor]]:
    rt = gk.Runtime(strategy=strategy, devices=devices)
    model = rt.setup(_model())
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    x, y = _batch(n)
    loss = criterion(model(x), y)
    rt.backward(loss)
    return loss.item(), [p.grad.clone() for p in rt.unwrap(model).parameters()]


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("n", [10, 7, 2])  # 10 and 7 do not divide evenly; 2 < 3 devices
def test_loss_and_gradients_equal_one_device(strategy: str, count: int, n: int) -> None:
    ref_loss, ref_grads = _loss_and_grads("single", "cpu", n)
    loss, grads = _loss_and_grads(strategy, CPUS[count], n)
    assert abs(loss - ref_loss) <= 1e-6
    for ref, got in zip(ref_grads, grads, strict=True):
        assert (ref - got).abs().max().item() <= 1e-6


def _train(strategy: str, devices: object, use_train_step: bool) -> dict[str, torch.Tensor]:
    rt = gk.Runtime(strategy=strategy, devices=devices, seed=0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = _batch(23)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)  # 8, 8, 7: the last one is uneven
    model, opt, loader = rt.setup(model, opt, loader)
    criterion = rt.setup_criterion(nn.functional.cross_entropy)
    for _ in range(3):
        for xb, yb in loader:
            if use_train_step:
                rt.train_step(opt, (xb, yb), lambda b: criterion(model(b[0]), b[1]))
            else:
                rt.backward(criterion(model(xb), yb))
                rt.step(opt)
    assert rt.global_step == 9
    return {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()}


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
@pytest.mark.parametrize("use_train_step", [False, True])
def test_several_steps_give_the_same_parameters(strategy: str, use_train_step: bool) -> None:
    reference = _train("single", "cpu", use_train_step)
    for devices in CPUS.values():
        trained = _train(strategy, devices, use_train_step)
        for name, value in reference.items():
            assert (trained[name] - value).abs().max().item() <= 1e-6, name


class _Structured(nn.Module):
    """Returns its output as a tuple, a dict, or a dataclass."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> object:
        out = self.linear(x)
        if self.kind == "tuple":
            return out, out.sum(1)
        if self.kind == "dict":
            return {"logits": out, "aux": out.mean(1), "name": "head"}
        if self.kind == "namedtuple":
            return Pair(out, out.sum(1))
        return Output(out, out.sum(1))


Pair = namedtuple("Pair", ["logits", "aux"])


@dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor


def _structured_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple):
        logits, aux = out
    elif isinstance(out, dict):
        assert out["name"] == "head"
        logits, aux = out["logits"], out["aux"]
    else:
        logits, aux = out.logits, out.aux  # type: ignore[attr-defined]
    return nn.functional.cross_entropy(logits, y) + (aux**2).mean()


@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple", "dataclass"])
@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
def test_structured_outputs_with_a_plain_function_loss(kind: str, strategy: str) -> None:
    results = {}
    for name, devices in (("single", "cpu"), (strategy, CPUS[3])):
        torch.manual_seed(0)
        rt = gk.Runtime(strategy=name, devices=devices)
        model = rt.setup(_Structured(kind))
        criterion = rt.setup_criterion(_structured_loss)
        x, y = _batch(10)
        out = model(x)
        if strategy == "dp" and name == "dp":
            assert type(out) is type(model.module(x))  # gathered into the same structure
        loss = criterion(out, y)
        rt.backward(loss)
        results[name] = (loss.item(), rt.unwrap(model).linear.weight.grad.clone())
    (ref_loss, ref_grad), (loss, grad) = results["single"], results[strategy]
    assert abs(loss - ref_loss) <= 1e-6
    assert (grad - ref_grad).abs().max().item() <= 1e-6


def test_balanced_outputs_stay_per_device_and_gather_on_request() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[3])
    model = rt.setup(_model())
    x, _ = _batch(10)
    out = model(x)
    assert isinstance(out, PerDevice)
    assert out.sizes == (4, 3, 3) and len(out.outputs) == 3
    full = out.gather()
    assert full.shape == (10, 3)
    assert torch.allclose(full, rt.unwrap(model)(x), atol=1e-6)


def test_balanced_module_loss_with_weights_is_replicated() -> None:
    weight = torch.tensor([1.0, 2.0, 0.5])
    results = []
    for name, devices in (("single", "cpu"), ("dp-balanced", CPUS[3])):
        rt = gk.Runtime(strategy=name, devices=devices)
        model = rt.setup(_model())
        # Summed, a weighted loss splits exactly (a weighted mean would divide by per-chunk
        # weight totals).
        criterion = rt.setup_criterion(nn.CrossEntropyLoss(weight=weight, reduction="sum"))
        x, y = _batch(10)
        loss = criterion(model(x), y)
        rt.backward(loss)
        results.append((loss.item(), rt.unwrap(model)[0].weight.grad.clone()))
    assert abs(results[0][0] - results[1][0]) <= 1e-5
    assert (results[0][1] - results[1][1]).abs().max().item() <= 1e-5


def test_one_device_has_the_same_call_convention() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=["cpu"])
    model = rt.setup(_model())
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    x, y = _batch(6)
    out = model(x)
    assert isinstance(out, torch.Tensor)  # nothing to split: the plain output
    assert criterion(out, y).shape == ()


def test_loss_lands_on_the_configured_device() -> None:
    strategy = gk.strategies.DPBalanced(loss_device=2)
    rt = gk.Runtime(strategy=strategy, devices=CPUS[3])
    assert rt.strategy.loss_device == torch.device("cpu")
    with pytest.raises(ConfigError, match="loss_device=5"):
        gk.Runtime(strategy=gk.strategies.DPBalanced(loss_device=5), devices=CPUS[2])


class _FailsOnSmallChunks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 4:
            raise ValueError("chunk too small")
        return self.linear(x)


def test_a_worker_error_names_its_replica_and_device() -> None:
    rt = gk.Runtime(strategy="dp", devices=CPUS[3])
    model = rt.setup(_FailsOnSmallChunks())
    with pytest.raises(ValueError, match=r"replica 1 on cpu: chunk too small"):
        model(_batch(10)[0])


def test_out_of_memory_in_a_worker_keeps_its_type() -> None:
    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise oom_type("CUDA out of memory. Tried to allocate 2.00 MiB.")

    cpu = torch.device("cpu")
    with pytest.raises(oom_type, match="replica 0 on cpu"):
        parallel_apply([boom, boom], [((torch.ones(1),), {})] * 2, [cpu, cpu])


def test_workers_inherit_grad_mode_and_autocast() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[2])
    model = rt.setup(_model())
    x, _ = _batch(6)
    with torch.no_grad():
        out = model(x)
    assert not any(o.requires_grad for o in out.outputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert all(o.dtype == torch.bfloat16 for o in out.outputs)


def test_bf16_mixed_gives_float32_outputs_on_every_device() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[2], precision="bf16-mixed")
    model = rt.setup(_model())
    out = model(_batch(6)[0])
    assert all(o.dtype == torch.float32 for o in out.outputs)


def test_host_replicas_share_weights_and_copy_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    cpu = torch.device("cpu")
    first, second = replicate(model, [cpu, cpu])
    assert first is model
    assert second[0].weight is model[0].weight
    assert second[1].running_mean is not model[1].running_mean
    assert second[1] is not model[1] and second[0] is not model[0]


def test_batchnorm_statistics_come_from_the_first_chunk_as_in_dataparallel() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    rt = gk.Runtime(strategy="dp", devices=CPUS[2])
    model = rt.setup(net)
    x, _ = _batch(10)
    expected = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    expected.load_state_dict(net.state_dict())
    model(x)
    expected(x[:5])
    assert torch.allclose(net[1].running_mean, expected[1].running_mean, atol=1e-6)


def test_checkpoint_holds_the_users_model(tmp_path: object) -> None:
    rt = gk.Runtime(strategy="dp", devices=CPUS[2])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    x, y = _batch(10)
    rt.train_step(opt, (x, y), lambda b: nn.functional.cross_entropy(model(b[0]), b[1]))
    rt.save(tmp_path)  # type: ignore[arg-type]
    fresh = gk.Runtime(strategy="dp", devices=CPUS[2])
    other = _model()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other, other_opt = fresh.setup(other, other_opt)
    fresh.load(tmp_path)  # type: ignore[arg-type]
    for a, b in zip(rt.unwrap(model).parameters(), fresh.unwrap(other).parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_configurations_are_refused(fake_gpus, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake_gpus(2)
    with pytest.raises(ConfigError, match="devices of one kind"):
        gk.Runtime(strategy="dp", devices=["cuda:0", "cpu"])
    with pytest.raises(ConfigError, match="same GPU twice"):
        gk.Runtime(strategy="dp", devices=["cuda:0", "cuda:0"])
    with pytest.raises(ConfigError, match="output_device='cuda:1' is not one of"):
        gk.Runtime(strategy=gk.strategies.DP(output_device="cuda:1"), devices=["cuda:0"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one rank of a launched job"):
        gk.Runtime(strategy="dp-balanced", devices=["cpu", "cpu"])


def test_a_loss_that_does_not_reduce_is_refused() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[2])
    with pytest.raises(ConfigError, match="reduction 'none'"):
        rt.setup_criterion(nn.CrossEntropyLoss(reduction="none"))
    model = rt.setup(_model())
    per_sample = rt.setup_criterion(lambda out, y: (out - 0).sum(1))
    with pytest.raises(ConfigError, match=r"returned \(5,\) on replica 0"):
        per_sample(model(_batch(10)[0]), _batch(10)[1])
    # Other strategies leave the loss alone: reducing later is the user's business.
    single = gk.Runtime(devices="cpu")
    fn = nn.CrossEntropyLoss(reduction="none")
    assert single.setup_criterion(fn) is fn


def test_unknown_strategy_lists_the_new_names() -> None:
    with pytest.raises(ConfigError, match="dp, dp-balanced, ddp"):
        gk.Runtime(strategy="data-parallel")


def _imbalance_after_training(strategy: str) -> float:
    from gpukit.train.loop import TrainConfig, fit

    gk.memory.reset_peaks([0, 1])
    rt = gk.Runtime(strategy=strategy, devices=2, precision="32", seed=0)
    metrics = rt.launch(fit, TrainConfig(workload="cnn", max_steps=20, batch_size=512))
    peaks = [row["peak"] for row in metrics["memory"]["devices"]]
    assert len(peaks) == 2 and min(peaks) > 0
    return float(metrics["memory"]["imbalance"])


@pytest.mark.multigpu
def test_balanced_dp_spreads_memory_better_than_dp() -> None:
    imbalance = {s: _imbalance_after_training(s) for s in ("dp", "dp-balanced", "ddp")}
    print("imbalance (max/min peak) per strategy:", imbalance)
    assert imbalance["dp-balanced"] < imbalance["dp"]
    assert imbalance["ddp"] < imbalance["dp"]


@pytest.mark.multigpu
def test_cuda_dp_matches_one_gpu() -> None:
    ref_loss, ref_grads = _loss_and_grads("single", "cuda:0", 10)
    for strategy in ("dp", "dp-balanced"):
        loss, grads = _loss_and_grads(strategy, ["cuda:0", "cuda:1"], 10)
        assert abs(loss - ref_loss) <= 1e-5
        for ref, got in zip(ref_grads, grads, strict=True):
            assert (ref - got).abs().max().item() <= 1e-5


def test_out_of_memory_in_a_worker_thread_keeps_its_type() -> None:
    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def fine(x: torch.Tensor) -> torch.Tensor:
        return x

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise oom_type("CUDA out of memory. Tried to allocate 2.00 MiB.")

    cpu = torch.device("cpu")
    with pytest.raises(oom_type, match="replica 1 on cpu"):  # replica 1 runs in a worker
        parallel_apply([fine, boom], [((torch.ones(1),), {})] * 2, [cpu, cpu])


class _TakesKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, device: str = "", i: int = 0, fn: object = None) -> object:
        return self.linear(x) * i


def test_keyword_arguments_never_clash_with_the_machinery() -> None:
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[2])
    model = rt.setup(_TakesKeywords())
    out = model(_batch(6)[0], device="cpu", i=2, fn=len)
    crit = rt.setup_criterion(lambda o, y, device="", i=1: nn.functional.cross_entropy(o, y) * i)
    assert crit(out, _batch(6)[1], device="cpu", i=3).shape == ()


def test_a_defaultdict_batch_keeps_its_type() -> None:
    from collections import defaultdict

    class Reads(nn.Module):
        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            assert isinstance(batch, defaultdict) and batch.default_factory is list
            return batch["x"] * 2

    rt = gk.Runtime(strategy="dp", devices=CPUS[2])
    model = rt.setup(Reads())
    batch = defaultdict(list, {"x": torch.arange(4.0)})
    assert model(batch).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_summing_partial_is_added_not_averaged() -> None:
    import functools

    summed = functools.partial(nn.functional.cross_entropy, reduction="sum")
    ref_loss, _ = _loss_and_grads("single", "cpu", 10)
    rt = gk.Runtime(strategy="dp-balanced", devices=CPUS[3])
    model = rt.setup(_model())
    x, y = _batch(10)
    loss = rt.setup_criterion(summed)(model(x), y)
    assert abs(loss.item() - 10 * ref_loss) <= 1e-5


def test_mfu_counts_the_gpus_of_one_dp_process() -> None:
    from types import SimpleNamespace

    import gpukit as gk
    from gpukit.train.report import gpu_count
    from gpukit.workloads.flops import mfu

    one_process = gk.Runtime(strategy="dp", devices=["cpu", "cpu"])
    # Each of two DDP processes drives one device.
    two_processes = SimpleNamespace(world_size=2, strategy=SimpleNamespace(driven_devices=[1]))
    assert gpu_count(one_process) == gpu_count(two_processes) == 2  # type: ignore[arg-type]
    assert mfu(989e12, "NVIDIA H100 80GB HBM3", gpus=2) == 0.5


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
@pytest.mark.parametrize("devices", ["all", "auto"])
def test_one_process_over_the_only_cpu_is_refused_without_gpus(
    fake_gpus,
    strategy: str,
    devices: str,  # type: ignore[no-untyped-def]
) -> None:
    fake_gpus(0)
    with pytest.raises(ConfigError) as caught:
        gk.Runtime(strategy=strategy, devices=devices)
    message = str(caught.value)
    assert f"strategy={strategy!r} drives 2 or more GPUs from one process" in message
    assert f"devices={devices!r}" in message and "no GPU" in message
    assert "--strategy ddp --devices N" in message and "strategy='single'" in message
    # Devices given explicitly are the user's choice: CPUs rehearse dp in one process.
    assert len(gk.Runtime(strategy=strategy, devices=["cpu", "cpu"]).strategy.devices) == 2


def test_auto_or_all_must_find_several_gpus_for_dp(fake_gpus) -> None:  # type: ignore[no-untyped-def]
    fake_gpus(1)
    with pytest.raises(ConfigError, match="it names 1 of this machine's 1 GPU"):
        gk.Runtime(strategy="dp", devices="all")
    fake_gpus(2)
    with pytest.raises(ConfigError, match="devices='auto' gives 1 device"):
        gk.Runtime(strategy="dp", devices="auto")  # the best device: one GPU of two
    assert [str(d) for d in gk.Runtime(strategy="dp", devices="all").strategy.devices] == [
        "cuda:0",
        "cuda:1",
    ]


def test_gpukit_train_refuses_dp_over_the_only_cpu(
    fake_gpus,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    fake_gpus(0)
    args = ["train", "--workload", "mlp", "--strategy", "dp-balanced", "--devices", "all"]
    assert main([*args, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "drives 2 or more GPUs from one process" in err and "--strategy ddp" in err
