"""Memory reports: the CPU row for real, pretend GPUs through mocked readers and a fake NVML,
model breakdowns in exact bytes, and a real 2-process gloo gather."""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpukit.devices import hw as _hw
from gpukit.devices import nvml as _nvml
from gpukit.diagnostics.memory import DeviceMemory, MemoryReport, memory, report
from gpukit.diagnostics.memory_breakdown import CATEGORIES, breakdown
from gpukit.errors import ConfigError, DeviceError
from gpukit.launch.ports import free_port
from tests.fakes import GiB, NVMLError_LibraryNotFound, fake_pynvml, install_pynvml
from tests.ranks import start_processes

# The module itself: once gpukit exports the `memory` tool, `gpukit.memory` names the tool.
mem = importlib.import_module("gpukit.diagnostics.memory")


def row(dev: str, peak: int, rank: int | None = None, **kw: Any) -> DeviceMemory:
    base = dict(allocated=peak, reserved=peak, total=None, free=None, other_processes=None)
    return DeviceMemory(dev, rank, peak=peak, **{**base, **kw})


# -- the CPU row ---------------------------------------------------------------------------


def test_cpu_only_process_gets_one_real_cpu_row(cpu_only: None) -> None:
    (cpu,) = report().rows
    assert cpu.device == "cpu" and cpu.rank is None and cpu.other_processes is None
    assert cpu.allocated > 0 and cpu.reserved == cpu.allocated and cpu.peak >= cpu.allocated
    assert cpu.total == _hw.ram_total() and cpu.total is not None
    assert cpu.free is not None and 0 < cpu.free <= cpu.total


def test_cpu_peak_covers_a_big_allocation_and_reset_lowers_it_where_linux_allows() -> None:
    block = torch.ones(256 * 1024**2 // 4)  # 256 MiB, written, so it is resident
    (held,) = report(["cpu"]).rows
    assert held.peak >= held.allocated >= 256 * 1024**2
    del block  # a block this large goes back to the OS at once
    memory.reset_peaks(["cpu"])  # where /proc/self/clear_refs is not writable, nothing happens
    if os.access("/proc/self/clear_refs", os.W_OK):
        assert report(["cpu"]).rows[0].peak < held.peak - 128 * 1024**2


# -- imbalance, to_dict, str, table --------------------------------------------------------


@pytest.mark.parametrize(
    ("peaks", "expected"),
    [([3, 1, 0], 3.0), ([2, 2], 1.0), ([5, 4], 1.25), ([7], None), ([0, 0], None), ([], None)],
)
def test_imbalance_is_max_over_min_of_the_peaks_above_zero(
    peaks: list[int], expected: float | None
) -> None:
    rows = tuple(row(f"cuda:{i}", p * GiB) for i, p in enumerate(peaks))
    assert MemoryReport(rows).imbalance == expected


def test_to_dict_str_and_table_without_ranks() -> None:
    rep = MemoryReport((row("cuda:0", 3 * GiB, total=80 * GiB), row("cuda:1", 2 * GiB)))
    data = rep.to_dict()
    assert data["imbalance"] == 1.5
    assert data["devices"][0] == {
        "device": "cuda:0",
        "rank": None,
        "allocated": 3 * GiB,
        "reserved": 3 * GiB,
        "peak": 3 * GiB,
        "total": 80 * GiB,
        "free": None,
        "other_processes": None,
        "peak_tensors": None,
    }
    headers = [c.header for c in rep.table().columns]
    assert headers == [
        "device",
        "allocated",
        "reserved",
        "peak",
        "total",
        "free",
        "other processes",
    ]
    text = str(rep)
    assert "Memory per device" in text and "80 GiB" in text and "3 GiB" in text
    assert text.splitlines()[-1] == "imbalance (max/min peak): 1.50x"
    assert " - " in text  # None shows as a dash


def test_rank_column_appears_when_rows_have_ranks_and_no_imbalance_line_for_one_row() -> None:
    rep = MemoryReport((row("cpu", GiB, rank=1),))
    assert [c.header for c in rep.table(title=None).columns][:2] == ["device", "rank"]
    assert "imbalance" not in str(rep) and rep.to_dict()["imbalance"] is None


# -- a pretend machine with 2 GPUs ---------------------------------------------------------


@pytest.fixture
def two_gpus(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """GPU 0 holds 6 GiB (peak 10 GiB); GPU 1 is untouched. Returns mem_get_info's calls."""
    fake_gpus(2)
    stats = {0: (6 * GiB, 8 * GiB, 10 * GiB, 12 * GiB), 1: (0, 0, 0, 0)}
    calls: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        calls.append(index)
        return 70 * GiB, 80 * GiB

    monkeypatch.setattr(mem, "_cuda_stats", lambda i: stats[i])
    monkeypatch.setattr(mem, "_cuda_mem_get_info", mem_get_info)
    return calls


def _nvml_gpus() -> list[dict[str, Any]]:
    # NVML's order differs from CUDA's (as under CUDA_VISIBLE_DEVICES), and it sees a third GPU.
    return [
        {"name": "H100", "uuid": "GPU-00000009", "processes": [(1, GiB)]},
        {"name": "H100", "uuid": "GPU-00000001", "used": 3 * GiB, "processes": [(55, 3 * GiB)]},
        {
            "name": "H100",
            "uuid": "GPU-00000000",
            "processes": [(os.getpid(), 9 * GiB), (4242, 2 * GiB)],
            "graphics": [(4242, 2 * GiB), (777, GiB)],
        },
    ]


def test_only_the_gpu_in_use_is_listed_and_the_untouched_one_gets_no_context(
    two_gpus: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    install_pynvml(monkeypatch, fake_pynvml(_nvml_gpus()))
    (gpu,) = report().rows
    assert (gpu.device, gpu.allocated, gpu.reserved, gpu.peak) == (
        "cuda:0",
        6 * GiB,
        8 * GiB,
        10 * GiB,
    )
    assert gpu.total == 80 * GiB and gpu.free == 70 * GiB  # from CUDA: a context exists
    assert gpu.other_processes == 3 * GiB  # 4242 counted once, 777 too, our own pid not
    assert two_gpus == [0]


def test_explicit_devices_include_the_untouched_gpu_with_nvml_numbers_by_uuid(
    two_gpus: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    install_pynvml(monkeypatch, fake_pynvml(_nvml_gpus()))
    rep = report(["cuda:0", "gpu:1", 0, "cpu"])
    assert [r.device for r in rep.rows] == ["cuda:0", "cuda:1", "cpu"]
    idle = rep.rows[1]
    assert (idle.allocated, idle.peak, idle.free, idle.other_processes) == (0, 0, 77 * GiB, 3 * GiB)
    assert two_gpus == [0]  # never mem_get_info on the untouched GPU
    assert rep.imbalance is not None  # cuda:0 and the cpu peaked; the idle GPU does not count


def test_without_nvml_the_untouched_gpu_has_no_free_and_no_other_processes(
    two_gpus: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    install_pynvml(monkeypatch, None)
    used, idle = report([0, 1]).rows
    assert used.free == 70 * GiB and used.other_processes is None
    assert idle.free is None and idle.other_processes is None and idle.total == 80 * GiB


def test_reset_peaks_resets_the_gpus_in_use(
    two_gpus: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    reset: list[int] = []
    monkeypatch.setattr(mem, "_cuda_reset_peak", reset.append)
    memory.reset_peaks()
    memory.reset_peaks(["cuda:1"])
    assert reset == [0, 1]


def test_real_cuda_readers_start_nothing_on_this_machine() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process")
    assert mem._cuda_stats(0) == (0, 0, 0, 0)
    mem._cuda_reset_peak(0)
    assert not torch.cuda.is_initialized()


# -- NVML: free memory and other processes -------------------------------------------------


def test_gpu_memory_matches_uuids_and_excludes_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_pynvml(monkeypatch, fake_pynvml(_nvml_gpus()))
    found = _nvml.gpu_memory(["GPU-00000000", "GPU-00000001", "GPU-missing"])
    assert found == {"GPU-00000000": (79 * GiB, 3 * GiB), "GPU-00000001": (77 * GiB, 3 * GiB)}


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ({"processes": [(4242, None)]}, None),  # NVML hides its usage: the total is unknown
        ({"processes": [(os.getpid(), None)]}, 0),  # our own hidden usage does not matter
        ({"processes": None}, None),  # compute query unsupported
        ({"processes": [(9, GiB)], "graphics": None}, GiB),  # compute-only GPU
        ({}, 0),  # nobody else
    ],
)
def test_other_processes_when_nvml_cannot_tell(
    gpu: dict[str, Any], expected: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_pynvml(monkeypatch, fake_pynvml([{"name": "A100", "uuid": "GPU-a", **gpu}]))
    assert _nvml.gpu_memory(["GPU-a"]) == {"GPU-a": (79 * GiB, expected)}


def test_gpu_memory_without_nvml_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    install_pynvml(monkeypatch, None)
    assert _nvml.gpu_memory(["GPU-a"]) == {}
    error = NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    install_pynvml(monkeypatch, fake_pynvml([], init_error=error))
    assert _nvml.gpu_memory(["GPU-a"]) == {}


# -- arguments -----------------------------------------------------------------------------


def test_explicit_cpu_in_every_spelling_and_the_tool_is_report(cpu_only: None) -> None:
    for spec in ("cpu", ["cpu"], ("/cpu:0", "CPU:0"), [torch.device("cpu")]):
        assert [r.device for r in memory(spec).rows] == ["cpu"]
    assert memory.report is report and repr(memory) == "gk.memory"


def test_bad_devices_raise_errors_that_say_what_to_pass(
    cpu_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeviceError, match="gpu:3"):
        report(["gpu:3"])
    for bad in (3.5, True, {"cpu"}):
        with pytest.raises(ConfigError, match="is not a device list: pass None") as err:
            report(bad)  # type: ignore[arg-type]
        assert type(bad).__name__ in str(err.value)
    with pytest.raises(ConfigError, match="names no device"):
        report([])
    with pytest.raises(ConfigError, match=r"all_ranks=True but torch.distributed"):
        report(all_ranks=True)
    with pytest.raises(ConfigError, match="pass True, False or None"):
        report(all_ranks="yes")  # type: ignore[arg-type]
    monkeypatch.setattr(_hw, "mps_available", lambda: True)
    with pytest.raises(ConfigError, match="no memory report for mps: pass cpu or cuda"):
        report(["mps"])


# -- breakdown -----------------------------------------------------------------------------


class Tied(nn.Module):
    """Embedding and head share one weight (40 floats); a BatchNorm adds 8 floats and buffers
    of 4 + 4 floats and one int64."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(idx)))


PARAMS, BUFFERS = (40 + 8) * 4, (4 + 4) * 4 + 8


def test_breakdown_counts_tied_weights_once_without_an_optimizer() -> None:
    b = breakdown(Tied())
    assert (b.parameters, b.gradients, b.optimizer_state, b.buffers) == (PARAMS, 0, 0, BUFFERS)
    assert b.total == 232 and list(b.by_device) == ["cpu"]


def test_breakdown_with_adam_after_one_step() -> None:
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.arange(6)).sum().backward()
    optimizer.step()
    # Adam: exp_avg and exp_avg_sq per parameter, and a float32 scalar step for each of 3.
    b = memory.breakdown(model, optimizer)
    assert (b.parameters, b.gradients, b.optimizer_state, b.buffers) == (192, 192, 396, 40)
    assert b.by_device == {
        "cpu": {"parameters": 192, "gradients": 192, "optimizer_state": 396, "buffers": 40}
    }
    assert b.to_dict()["total"] == 820 and b.to_dict()["by_device"] == b.by_device
    text = str(b)
    assert "Memory breakdown" in text and "396 B" in text and "820 B" in text


def test_shared_memory_and_parameters_in_optimizer_state_count_once() -> None:
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(4))
    model.b = nn.Parameter(model.a.data)  # another Parameter over the same memory
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model.a]["master"] = [model.a, {"copy": torch.zeros(2)}]
    b = breakdown(model, optimizer)
    assert (b.parameters, b.optimizer_state) == (16, 8)


def test_breakdown_of_a_meta_model_sizes_it_without_memory() -> None:
    with torch.device("meta"):
        model = Tied()
    b = breakdown(model)
    assert (b.parameters, b.buffers) == (PARAMS, BUFFERS) and list(b.by_device) == ["meta"]


def test_breakdown_across_devices_shows_a_total_row() -> None:
    with torch.device("meta"):
        head = nn.Linear(2, 2)
    model = nn.Sequential(nn.Linear(2, 2), head)
    b = breakdown(model)
    assert b.by_device["cpu"]["parameters"] == b.by_device["meta"]["parameters"] == 24
    assert any("total" in line and "48 B" in line for line in str(b).splitlines())


def test_breakdown_refuses_what_is_not_a_model_or_optimizer() -> None:
    with pytest.raises(ConfigError, match=r"got a dict as model: pass an nn.Module"):
        breakdown({"w": torch.ones(2)})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"got a list as optimizer: pass a torch.optim"):
        breakdown(nn.Linear(1, 1), [])  # type: ignore[arg-type]


# -- every rank, for real ------------------------------------------------------------------


def _gather_on_rank(rank: int, port: int, outbox: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        gathered, local = report(), report(all_ranks=False)  # every rank calls the collective
        result = (gathered.to_dict(), local.to_dict(), str(gathered))
        Path(outbox, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_all_ranks_gathers_every_ranks_rows_over_two_gloo_processes(tmp_path: Path) -> None:
    start_processes(_gather_on_rank, (free_port(), str(tmp_path)), 2)
    for rank in (0, 1):
        gathered, local, text = pickle.loads((tmp_path / f"{rank}.pkl").read_bytes())
        assert [(r["device"], r["rank"]) for r in gathered["devices"]] == [("cpu", 0), ("cpu", 1)]
        assert all(r["allocated"] > 0 for r in gathered["devices"])
        assert gathered["imbalance"] is not None
        assert [(r["device"], r["rank"]) for r in local["devices"]] == [("cpu", rank)]
        assert text.splitlines()[-1].startswith("imbalance (max/min peak): ")


# -- sharded models (fsdp): this rank's shards, and the full size -------------------------


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    # 6 rows split 3/3 over two ranks; 3 rows split 2/1: an uneven shard as well.
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _one_adamw_step(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def _breakdown_on_rank(rank: int, port: int, outbox: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _small_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        b = breakdown(model, _one_adamw_step(model))
        Path(outbox, f"{rank}.pkl").write_bytes(pickle.dumps((b.to_dict(), str(b))))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_breakdown_of_an_fsdp_model_counts_this_ranks_shards_and_the_full_size(
    tmp_path: Path,
) -> None:
    model = _small_model()
    plain = breakdown(model, _one_adamw_step(model))  # the same model and step, unsharded
    assert plain.unsharded is None
    start_processes(_breakdown_on_rank, (free_port(), str(tmp_path)), 2)
    ranks = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in (0, 1)]
    for got, text in ranks:
        # The full size is what one process holds without sharding...
        assert got["unsharded"] == {c: getattr(plain, c) for c in CATEGORIES}
        # ...and each rank holds less: its shards (and a scalar step per parameter).
        assert got["parameters"] < plain.parameters
        assert "this rank" in text and "unsharded (full size)" in text
    # Rank 0 holds rows 0-2 and 0-1 of the two layers, rank 1 the rest: (3*4+3 + 2*6+2) floats
    # and (3*4+3 + 1*6+1). Together: every parameter and gradient once.
    assert [got["parameters"] for got, _ in ranks] == [29 * 4, 22 * 4]
    assert sum(got["parameters"] for got, _ in ranks) == plain.parameters
    assert sum(got["gradients"] for got, _ in ranks) == plain.gradients
    steps = 4 * 4  # AdamW's step counter: one float32 per parameter, on every rank
    states = sum(got["optimizer_state"] for got, _ in ranks)
    assert states == plain.optimizer_state + steps
