"""gk.placement: counts and bytes per device, and where a model is split."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from tests.ranks import start_processes


def test_single_device_model_counts_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = gk.placement(model)
    d = report.to_dict()
    assert list(d["devices"]) == ["cpu"]
    cpu = d["devices"]["cpu"]
    assert cpu["parameters"] == {"count": 4, "elements": 4 * 3 + 3 + 3 + 3, "bytes": 21 * 4}
    # running_mean, running_var (float32) and num_batches_tracked (int64)
    assert cpu["buffers"] == {"count": 3, "elements": 7, "bytes": 3 * 4 * 2 + 8}
    assert cpu["total_bytes"] == 21 * 4 + 32
    assert d["split_modules"] == []
    text = str(report)
    assert "Placement of Sequential" in text and "cpu" in text and "84 B" in text


def test_tied_weights_count_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    report = gk.placement(nn.ModuleList([emb, head]))
    assert report.to_dict()["devices"]["cpu"]["parameters"]["count"] == 1


def test_model_split_across_devices_warns_and_names_the_split() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.warns(UserWarning, match="split across devices cpu, meta"):
        report = gk.placement(model)
    d = report.to_dict()
    assert set(d["devices"]) == {"cpu", "meta"}
    assert d["devices"]["meta"]["parameters"]["count"] == 2
    assert d["split_modules"] == [
        {"module": "(model)", "devices": ["cpu", "meta"], "parts": {"cpu": ["0"], "meta": ["1"]}}
    ]
    assert "split across devices: (model) -> cpu: 0; meta: 1" in str(report)


def test_layer_with_weight_and_bias_apart_is_the_split_reported() -> None:
    inner = nn.Linear(2, 2)
    inner.bias = nn.Parameter(torch.zeros(2, device="meta"))
    model = nn.Sequential(nn.Sequential(inner), nn.ReLU())
    with pytest.warns(UserWarning):
        report = gk.placement(model)
    assert [s.module for s in report.split] == ["0.0"]
    assert report.split[0].parts == {"cpu": ["weight"], "meta": ["bias"]}


def test_tensors_in_containers_are_reported_as_tensors() -> None:
    report = gk.placement({"x": torch.ones(2, 3), "y": [torch.ones(4, dtype=torch.float16)]})
    cpu = report.to_dict()["devices"]["cpu"]
    assert cpu["tensors"] == {"count": 2, "elements": 10, "bytes": 6 * 4 + 4 * 2}
    assert cpu["parameters"]["count"] == 0
    assert gk.placement(torch.ones(3)).to_dict()["devices"]["cpu"]["tensors"]["count"] == 1


def test_tensors_in_a_dataclass_batch_are_found() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        extra: dict[str, torch.Tensor]

    batch = Batch(torch.ones(2), {"mask": torch.ones(3, dtype=torch.bool)})
    cpu = gk.placement([batch]).to_dict()["devices"]["cpu"]
    assert cpu["tensors"] == {"count": 2, "elements": 5, "bytes": 2 * 4 + 3}


def test_placement_of_something_without_tensors_is_an_error() -> None:
    with pytest.raises(gk.GpukitError, match=r"got a str: pass an nn\.Module, a tensor"):
        gk.placement("model.pt")


def _placement_on_rank(rank: int, port: int, outbox: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        report = gk.placement(model)
        Path(outbox, f"{rank}.pkl").write_bytes(pickle.dumps((report.to_dict(), str(report))))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_placement_of_an_fsdp_model_shows_each_shard_over_two_gloo_ranks(tmp_path: Path) -> None:
    from gpukit.launch.ports import free_port

    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    whole = {name: tuple(p.shape) for name, p in plain.named_parameters()}
    start_processes(_placement_on_rank, (free_port(), str(tmp_path)), 2)
    got = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in (0, 1)]
    for rank, (d, text) in enumerate(got):
        sharded = {t["name"]: t for t in d["sharded"]}
        assert {n: tuple(t["global_shape"]) for n, t in sharded.items()} == whole
        assert all(t["placements"] == "Shard(0)" and t["mesh"] == [2] for t in sharded.values())
        # Dim 0 split in order, the first rank taking the larger part: 6 -> 3/3, 3 -> 2/1.
        assert sharded["0.weight"]["local_shape"] == [3, 4]
        assert sharded["2.weight"]["local_shape"] == [[2, 6], [1, 6]][rank]
        assert sharded["2.bias"]["local_bytes"] == [2, 1][rank] * 4
        assert sharded["2.bias"]["global_bytes"] == 3 * 4
        # The counts are this rank's: what its shards hold, not the whole tensors.
        local = sum(t["local_bytes"] for t in sharded.values())
        assert d["devices"]["cpu"]["parameters"]["bytes"] == local
        assert d["devices"]["cpu"]["buffers"]["count"] == 3  # buffers stay whole, unsharded
        assert "Shard(0) over 2 ranks" in text and "(6, 4)" in text and "(3, 4)" in text
    total = sum(p.numel() * 4 for p in plain.parameters())
    assert sum(d["devices"]["cpu"]["parameters"]["bytes"] for d, _ in got) == total
