"""Evaluation in the program's own loop: rt.gather_for_metrics counts every sample once (the
sampler's repeats left out), rt.all_gather of tensors that differ fails on every rank,
rt.pad_across_processes, rt.evaluating, and an evaluation pass that leaves the training's
logging window open. In one process where possible; 2 gloo ranks for what needs them."""

from __future__ import annotations

import datetime
import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import gpukit as gk
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.data.padding import describe, trailing_padding

CPU = torch.device("cpu")
SAMPLES = 513
# A collective left waiting fails within a minute instead of hanging the suite.
DDP2 = {"strategy": gk.strategies.DDP(timeout=datetime.timedelta(seconds=60)), "seed": 0}
TWO = ["cpu", "cpu"]


def _data(n: int = SAMPLES) -> TensorDataset:
    # Whole numbers: the model below computes them exactly however the batches are cut, so a
    # metric over 2 ranks can be compared bit for bit with one process.
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, torch.arange(n) % 3)


def _model() -> nn.Module:
    model = nn.Linear(1, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0], [0.0], [-1.0]]))
        model.bias.copy_(torch.tensor([0.0, 100.0, 400.0]))
    return model


# -- where the padding is: the sampler's arithmetic, checked against what it hands out ---------
def _real_positions(shuffle: bool, batch_size: int, drop_last: bool, by_batch: bool) -> list[int]:
    """Every index the 2 ranks hand out, less what describe() calls padding."""
    seen: list[int] = []
    for rank in (0, 1):
        if by_batch:
            batches = BatchSampler(SequentialSampler(range(SAMPLES)), batch_size, drop_last)
            given = DataLoader(torch.arange(SAMPLES), batch_sampler=batches)
        else:
            given = DataLoader(
                torch.arange(SAMPLES), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last
            )
        loader = DeviceLoader(given, CPU, 2, rank, seed=3)
        for position, batch in enumerate(loader, start=1):
            rows = describe(loader, position, batch, None)
            assert rows.rows == len(batch)
            seen += batch[: len(batch) - rows.padding].tolist()
    return seen


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, 8, 257])
def test_the_samples_left_after_padding_are_each_sample_once(
    shuffle: bool, batch_size: int
) -> None:
    assert sorted(_real_positions(shuffle, batch_size, False, False)) == list(range(SAMPLES))


def test_padding_of_batch_samplers_and_drop_last() -> None:
    assert sorted(_real_positions(False, 8, False, True)) == list(range(SAMPLES))
    # drop_last cuts instead of repeating: nothing is padding, each sample at most once.
    kept = _real_positions(True, 8, True, False)
    assert len(kept) == len(set(kept)) == 512


def test_trailing_padding_of_each_sampler() -> None:
    from torch.utils.data import DistributedSampler

    from gpukit.runtime.data.sampling import Strided

    def padded(n: int, ranks: int, **kw: Any) -> list[int | None]:
        return [
            trailing_padding(DistributedSampler(range(n), ranks, r, **kw)) for r in range(ranks)
        ]

    assert padded(513, 2) == padded(513, 2, shuffle=False) == [0, 1]
    assert padded(10, 4) == [0, 0, 1, 1]
    assert padded(513, 2, drop_last=True) == [0, 0]
    assert padded(2, 4) == [0, 0, 1, 1]  # fewer samples than ranks: repeats all round
    assert [trailing_padding(Strided(range(7), 3, r, False)) for r in range(3)] == [0, 1, 1]
    assert trailing_padding(SequentialSampler(range(5))) == 0

    class OwnSharding(SequentialSampler):  # type: ignore[type-arg]
        num_replicas, rank = 2, 0

    assert trailing_padding(OwnSharding(range(5))) is None


# -- one process -------------------------------------------------------------------------------
class Pair(NamedTuple):
    logits: torch.Tensor
    ids: list[Any]


def test_one_process_gives_back_every_row_in_the_same_structure() -> None:
    rt = gk.Runtime(devices="cpu")
    logits = torch.randn(4, 3, requires_grad=True)
    out = rt.gather_for_metrics(
        {"pair": Pair(logits, [torch.arange(4), 7]), "loss": torch.tensor(0.5), "n": 4, "x": None}
    )
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].logits, logits)
    assert not out["pair"].logits.requires_grad  # metrics, not a graph
    assert torch.equal(out["pair"].ids[0], torch.arange(4)) and out["pair"].ids[1] == [7]
    assert torch.equal(out["loss"], torch.tensor([0.5])) and out["n"] == [4] and out["x"] is None
    # Numbers equal by chance (Python shares their objects) stay apart.
    assert rt.gather_for_metrics({"correct": 3, "count": 3, "other": 4}) == {
        "correct": [3],
        "count": [3],
        "other": [4],
    }


def test_one_process_evaluation_over_a_set_up_loader_counts_each_sample_once() -> None:
    rt = gk.Runtime(devices="cpu")
    model, loader = rt.setup(_model(), DataLoader(_data(), batch_size=8))
    preds = []
    with gk.trace() as t, rt.evaluating(model):
        for x, _ in loader:
            preds.append(rt.gather_for_metrics(model(x).argmax(1)))
    assert len(torch.cat(preds)) == SAMPLES
    assert sum(s.count for s in t.syncs) == 0, t.syncs  # noting each batch reads nothing


def test_a_trace_counts_no_read_for_a_gather_in_one_process() -> None:
    rt = gk.Runtime(devices="cpu")
    with gk.trace() as t:
        rt.gather_for_metrics({"pred": torch.ones(8), "y": torch.zeros(8, dtype=torch.long)})
    assert sum(s.count for s in t.syncs) == 0, t.syncs


def _bad(rt: gk.Runtime) -> list[Any]:
    return [
        (lambda: rt.gather_for_metrics({"name": "cat"}), r"type str at data.name \(rank 0\)"),
        (lambda: rt.gather_for_metrics([np.ones(2)]), r"type ndarray at data\[0\]"),
        (lambda: rt.gather_for_metrics((1, object())), r"type object at data\[1\]"),
        (lambda: rt.evaluating().__enter__(), r"rt.evaluating\(\) got no model"),
        (lambda: rt.evaluating("model").__enter__(), r"rt.evaluating got 'model'"),
        (lambda: rt.pad_across_processes([1, 2]), r"pad_across_processes got \[1, 2\]"),
        (lambda: rt.pad_across_processes(torch.ones(2), dim="0"), r"dim='0'"),
        (lambda: rt.pad_across_processes(torch.ones(2), pad_index=None), r"pad_index=None"),
        (lambda: rt.pad_across_processes(torch.ones(2), dim=1), r"from -1 to 0"),
        (lambda: rt.pad_across_processes(torch.tensor(1.0)), r"at least one"),
    ]


def test_bad_inputs_are_clear_errors() -> None:
    rt = gk.Runtime(devices="cpu")
    for call, message in _bad(rt):
        with pytest.raises(gk.ConfigError, match=message):
            call()


def test_evaluating_restores_every_submodule_mode_even_after_an_error() -> None:
    rt = gk.Runtime(devices="cpu")
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(), nn.BatchNorm1d(2))
    net[1].eval()  # the program's own choice, kept afterwards
    head = nn.Linear(2, 1).eval()
    model = rt.setup(net)
    with pytest.raises(RuntimeError, match="boom"), rt.evaluating(model, head):
        assert not any(m.training for m in model.modules()) and not torch.is_grad_enabled()
        assert not model(torch.ones(3, 2)).requires_grad
        raise RuntimeError("boom")
    assert [m.training for m in net.modules()] == [True, True, False, True]
    assert not head.training and torch.is_grad_enabled()


def test_evaluating_works_on_the_wrapper_dp_returns() -> None:
    rt = gk.Runtime(strategy="dp", devices=TWO)
    model = rt.setup(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    assert model is not rt.unwrap(model)
    with rt.evaluating(model):
        assert not rt.unwrap(model)[1].training
        out = model(torch.ones(4, 2))
    assert torch.equal(out, model.eval()(torch.ones(4, 2)).detach())
    model.train()


def _train_then_evaluate(
    rt: gk.Runtime, stop_after: int | None, evaluate: bool = True
) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    data = _data(40)
    # A sampler that shards by rank (here 1 of 1), as under several processes: reseeded by
    # gpukit every epoch of the training loader.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=5)
    model, optimizer, sched, train, val = rt.setup(
        net,
        optimizer,
        sched,
        DataLoader(data, batch_size=4, sampler=sampler),
        DataLoader(_data(10), batch_size=4),
    )
    orders = []
    for _ in range(2):
        order = []
        for i, (x, _) in enumerate(train):
            order += x[:, 0].tolist()
            rt.backward(model(x).pow(2).mean() * 1e-3)
            rt.step(optimizer)
            rt.log(loss=x.mean())
            if stop_after is not None and i + 1 == stop_after:
                break  # a step limit per epoch: the pass does not end, its window stays
            if i == 1 and evaluate:
                with rt.evaluating(model):  # mid-epoch evaluation
                    for vx, _ in val:
                        rt.gather_for_metrics(model(vx))
        orders.append(order)
    history_before = len(rt.history)
    with rt.evaluating(model):
        for vx, _ in val:
            rt.gather_for_metrics(model(vx))
    return {
        "flushed": rt.flush_logs(),
        "history_before": history_before,
        "history": list(rt.history),
        "orders": orders,
        "pass_ended": sched.pass_ended,
    }


def test_an_evaluation_pass_leaves_the_training_window_open() -> None:
    out = _train_then_evaluate(gk.Runtime(devices="cpu", seed=0, log_every=100), stop_after=5)
    assert out["history_before"] == 0  # neither epoch's window was closed by an evaluation
    assert set(out["flushed"]) == {"step", "loss"} and out["flushed"]["step"] == 10
    assert not out["pass_ended"]  # evaluation passes are not epochs for the scheduler
    # A training pass run to its end still closes its window: one record per epoch.
    full = _train_then_evaluate(gk.Runtime(devices="cpu", seed=0, log_every=100), stop_after=None)
    assert [r["step"] for r in full["history"]] == [10, 20] and full["flushed"] == {}


def test_evaluation_passes_do_not_change_the_training_order() -> None:
    def orders(evaluate: bool) -> list[list[float]]:
        rt = gk.Runtime(devices="cpu", seed=0, log_every=100)
        return _train_then_evaluate(rt, None, evaluate)["orders"]  # type: ignore[no-any-return]

    with_evaluation = orders(True)
    assert with_evaluation == orders(False)
    first, second = with_evaluation
    assert sorted(first) == sorted(second) and first != second  # reshuffled each epoch


# -- two processes -------------------------------------------------------------------------------
def _evaluate(rt: gk.Runtime, shuffle: bool, batch_size: int) -> dict[str, Any]:
    model, loader = rt.setup(_model(), DataLoader(_data(), batch_size=batch_size, shuffle=shuffle))
    preds, labels, inputs, mine = [], [], [], []
    with rt.evaluating(model), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for x, y in loader:
            # "n", one number per rank, counts the repeated sample in the last batch: it warns.
            out = rt.gather_for_metrics(
                {"pred": model(x).argmax(1), "io": (x[:, 0], y), "n": len(x)}
            )
            preds.append(out["pred"])
            inputs.append(out["io"][0])
            labels.append(out["io"][1])
            mine.append(model(x))
    pred, label = torch.cat(preds), torch.cat(labels)
    return {
        "count": len(pred),
        "correct": int((pred == label).sum()),
        "inputs": torch.cat(inputs),
        "mse": torch.nn.functional.mse_loss(torch.cat(inputs), label.float()).item(),
        "whole_pass": rt.gather_for_metrics(torch.cat(mine)),  # after the loop, all at once
        "warned": [str(w.message) for w in warned if "one value per rank" in str(w.message)],
    }


@pytest.mark.processes
@pytest.mark.parametrize("shuffle", [False, True])
def test_513_samples_on_2_ranks_count_513_and_the_metric_is_the_one_process_one(
    shuffle: bool,
) -> None:
    one = gk.Runtime(devices="cpu", seed=0).launch(_evaluate, shuffle, 8)
    two = gk.Runtime(devices=TWO, **DDP2).launch(_evaluate, shuffle, 8)
    assert one["count"] == two["count"] == SAMPLES
    assert two["correct"] == one["correct"]
    assert len(two["whole_pass"]) == SAMPLES
    assert not one["warned"] and len(two["warned"]) == 1 and "data.n" in two["warned"][0]
    assert torch.equal(two["inputs"].sort().values, torch.arange(float(SAMPLES)))
    if not shuffle:  # the dataset's order, as one process sees it: the same sums, bit for bit
        assert torch.equal(two["inputs"], one["inputs"])
        assert two["mse"] == one["mse"]
        assert torch.equal(two["whole_pass"], one["whole_pass"])


def _uneven(rt: gk.Runtime) -> dict[str, Any]:
    rows = 3 if rt.rank == 0 else 1
    x = torch.full((rows, 2), float(rt.rank))
    out: dict[str, Any] = {}
    for name, call in {
        "all_gather_rows": lambda: rt.all_gather(x),
        "all_gather_dims": lambda: rt.all_gather(torch.zeros(2, 2 + rt.rank)),
        "all_gather_dtype": lambda: rt.all_gather(
            torch.zeros(2, dtype=[torch.int64, torch.float32][rt.rank])
        ),
        "numbers_kind": lambda: rt.all_gather(1 if rt.rank == 0 else 1.0),
        "all_gather_structure": lambda: rt.all_gather({"a" if rt.rank else "b": 1}),
        "all_gather_leaf": lambda: rt.all_gather({"y": [torch.zeros(1 + rt.rank)]}),
        "gather_dims": lambda: rt.gather_for_metrics(torch.zeros(2, 2 + rt.rank)),
        "gather_structure": lambda: rt.gather_for_metrics({"a" if rt.rank else "b": x}),
    }.items():
        try:
            call()
            out[name] = "no error"
        except gk.ConfigError as err:
            out[name] = str(err)
    out["gathered"] = rt.gather_for_metrics({"x": x, "n": rows, "t": torch.tensor(rows)})
    out["padded"] = rt.all_gather(rt.pad_across_processes(x, dim=0, pad_index=-1))
    out["same"] = rt.all_gather(torch.ones(2))
    return out


def _uneven_on_both(rt: gk.Runtime) -> list[dict[str, Any]]:
    return rt.strategy.all_gather_object(_uneven(rt))  # type: ignore[no-any-return]


@pytest.mark.processes
def test_tensors_that_differ_between_ranks() -> None:
    both = gk.Runtime(devices=TWO, **DDP2).launch(_uneven_on_both)
    for out in both:  # the same verdicts on both ranks: no crash, no hang
        assert "only the first dimension differs" in out["all_gather_rows"]
        assert "rt.gather_for_metrics(x)" in out["all_gather_rows"]
        assert "same dtype and shape" in out["all_gather_dims"]
        assert "int64" in out["all_gather_dtype"] and "float32" in out["all_gather_dtype"]
        assert "numbers of different kinds" in out["numbers_kind"]
        assert "different structure on each rank" in out["all_gather_structure"]
        assert "rank 0: data.b; rank 1: data.a" in out["all_gather_structure"]
        assert "they differ at data.y[0]" in out["all_gather_leaf"]
        assert "beyond the first dimension" in out["gather_dims"]
        assert "different structures" in out["gather_structure"]
        gathered = out["gathered"]
        assert torch.equal(gathered["x"], torch.tensor([[0.0] * 2] * 3 + [[1.0] * 2]))
        assert gathered["n"] == [3, 1] and torch.equal(gathered["t"], torch.tensor([3, 1]))
        assert out["padded"].shape == (2, 3, 2) and out["padded"][1, 1:].eq(-1).all()
        assert out["same"].shape == (2, 2)
    assert both[0]["all_gather_rows"] == both[1]["all_gather_rows"]


def _traced_gather(rt: gk.Runtime) -> dict[str, Any]:
    calls = {"all_gather": 0, "all_gather_object": 0}
    dist = torch.distributed
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    batch = {"pred": torch.ones(8), "y": torch.zeros(8, dtype=torch.long)}
    rt.gather_for_metrics(batch)  # warm up
    try:
        for name in calls:
            setattr(dist, name, counting(name))
        with gk.trace() as t:
            rt.gather_for_metrics(batch)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"reads": sum(s.count for s in t.syncs), "syncs": t.syncs, **calls}


@pytest.mark.processes
def test_a_trace_counts_what_a_gather_costs_on_2_ranks() -> None:
    """One object exchange (shapes, counts and numbers: torch's all_gather_object, whose own
    size exchange and unpickling are its 4 reads) and one all_gather per tensor, which reads
    nothing."""
    out = gk.Runtime(devices=TWO, **DDP2).launch(_traced_gather)
    assert out["all_gather_object"] == 1
    assert out["all_gather"] == 2  # one per tensor
    assert out["reads"] == 4, out["syncs"]
    assert {s.op for s in out["syncs"]} == {"bool", "item", "numpy"}
