"""The full weights of a sharded model exported one tensor at a time: the files safetensors
reads back hold exactly ``rt.full_state_dict()``, split into size-capped shards with an index
when they do not fit one, and rank 0 holds about one full tensor at once, not the model.

Memory is rank 0's resident-set high-water mark over the export (``VmHWM``, reset before it
through ``/proc/self/clear_refs``), with glibc told to give every allocation of 64 KiB or more
back on free (``MALLOC_MMAP_THRESHOLD_``), so it counts what is held, not what was cached.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint import export, sharded
from gpukit.strategies import Strategy

LAYERS, WIDTH = 16, 1024  # 16 equal 4 MiB weights: the model is 16 times its largest tensor
LARGEST = WIDTH * WIDTH * 4


def _read(folder: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """What safetensors reads back from ``name`` or from its shards, through the index."""
    if (folder / name).is_file():
        return load_file(str(folder / name))
    index = json.loads((folder / (name + ".index.json")).read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out |= load_file(str(folder / file))
    assert index["weight_map"] == {k: index["weight_map"][k] for k in out}
    return out


def _rank0() -> Strategy:
    return cast(Strategy, SimpleNamespace(rank=0))


class _Odd(nn.Module):
    """Values of several dtypes and shapes, a tied weight, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 3).to(torch.bfloat16)
        self.c = nn.Linear(3, 5)
        self.c.weight = self.a.weight
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("none", torch.zeros(0, 4, dtype=torch.float16))


@pytest.mark.parametrize("cap", [10**9, 16])
def test_the_files_read_back_as_the_state_dict(tmp_path: Path, cap: int) -> None:
    model = _Odd()
    wrote, bad = export.export(model, _rank0(), tmp_path, "model.safetensors", max_shard_bytes=cap)
    want = {k: v for k, v in model.state_dict().items() if k != "c.weight"}
    got = _read(tmp_path)
    assert got.keys() == want.keys() and bad == []
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    if cap > 1000:
        assert wrote == ["model.safetensors"]
    else:  # every value larger than 16 bytes gets its own file
        assert len(wrote) > 3 and wrote[-1] == "model.safetensors.index.json"
        assert not (tmp_path / "model.safetensors").exists()
        assert set(wrote[:-1]) == {p.name for p in tmp_path.glob("model-*-of-*.safetensors")}
        assert json.loads((tmp_path / wrote[-1]).read_text())["metadata"]["total_size"] == sum(
            v.numel() * v.element_size() for v in want.values()
        )


def test_a_nan_is_reported_with_its_file(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    _, bad = export.export(model, _rank0(), tmp_path, "model.safetensors", max_shard_bytes=16)
    assert bad == ["model-00003-of-00004.safetensors: 1.bias has 1 NaN"]


def _vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _vmrss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the most resident memory above the start it held meanwhile."""
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts from here
    start = _vmrss()
    result = fn()
    return result, _vmhwm() - start


def _export_run(rt: gk.Runtime, folder: str) -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    model = rt.setup(model)
    full = rt.full_state_dict()
    cap = 3 * LARGEST  # 3 weights a file: 6 files
    (wrote, bad), new = _peak(
        lambda: export.export(
            model, rt.strategy, Path(folder), "model.safetensors", max_shard_bytes=cap
        )
    )
    old_weights, old = _peak(lambda: sharded.full_weights(model, rt.strategy))
    del old_weights
    return {"full": full, "wrote": wrote, "bad": bad, "new": new, "old": old}


# Cold: glibc reads MALLOC_MMAP_THRESHOLD_ at start, and the peak it measures must start
# from the rank's own pages, not the warm-start server's.
@pytest.mark.cold_start
@pytest.mark.processes
def test_a_sharded_export_holds_one_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=0)
    run = rt.launch(_export_run, str(tmp_path))
    assert run["bad"] == [] and len(run["wrote"]) == 7  # 6 shards and the index
    got = _read(tmp_path)
    assert got.keys() == run["full"].keys()
    for key, value in run["full"].items():
        assert torch.equal(got[key], value), key
    total = LAYERS * LARGEST
    print(
        f"rank 0 peak: full gather {run['old'] / 2**20:.1f} MiB, "
        f"streamed {run['new'] / 2**20:.1f} MiB (model {total / 2**20:.0f} MiB, "
        f"largest tensor {LARGEST / 2**20:.0f} MiB)"
    )
    assert run["old"] >= total  # the measure sees a full gather
    # A few of the largest tensor (the gather's buffers and its result), not the model.
    assert run["new"] <= 4 * LARGEST


@pytest.fixture
def no_process_group_left() -> Any:
    """A one-rank fsdp run joins a process group in the test process: none may outlive it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_export_never_leaves_the_shards_alone_and_they_resume(
    tmp_path: Path, no_process_group_left: Any
) -> None:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu"], seed=0, export="never")
    model = rt.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    path = rt.save(tmp_path / "ck")
    assert not list(path.glob("model*")) and (path / "sharded").is_dir()
    assert "model.safetensors" not in json.loads((path / "manifest.json").read_text())["files"]
    assert rt.load(tmp_path / "ck") == {"epoch": 0, "step": 0}
    last = rt.save(tmp_path / "last", export=True)  # the last one exported anyway
    assert load_file(str(last / "model.safetensors")).keys() == model.state_dict().keys()
    rt.teardown()


def test_an_unknown_export_policy_is_refused() -> None:
    with pytest.raises(gk.ConfigError, match=r"export='final': use 'every' .* or 'never'"):
        gk.Runtime(export="final")
