"""rt.progress: the program's own loop with progress on rank 0, from rt.history only."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from rich.console import Console
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.runtime.outputs import progress


def _setup(log_every: int = 2, batches: int = 6) -> tuple[gk.Runtime, Any, Any, Any]:
    torch.manual_seed(0)
    rt = gk.Runtime(devices="cpu", seed=0, log_every=log_every)
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1))
    model, optimizer, loader = rt.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)
    )
    return rt, model, optimizer, loader


def _train(rt: gk.Runtime, model: Any, optimizer: Any, batches: Any) -> None:
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        rt.log(loss=loss)


def _fake_clock(monkeypatch: pytest.MonkeyPatch, ticks: list[float]) -> None:
    it = iter(ticks)
    monkeypatch.setattr(progress, "clock", lambda: next(it))


def test_off_a_terminal_a_line_every_n_seconds_with_the_last_loss_read_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt, model, optimizer, loader = _setup(log_every=2)
    # enter, epoch start, then one tick per batch (6), then the end
    _fake_clock(monkeypatch, [0.0, 0.0, 5.0, 10.0, 31.0, 40.0, 50.0, 62.0, 70.0])
    out = io.StringIO()
    _train(rt, model, optimizer, rt.progress(loader, every=30, out=out, epochs=2))
    lines = out.getvalue().splitlines()
    assert [line.split(", ")[0] for line in lines] == [
        "train 0/6 batches (0%)",
        "train 3/6 batches (50%)",  # 31 s
        "train 6/6 batches (100%)",  # 62 s
    ]
    assert all(", epoch 1/2, " in line for line in lines)
    losses = [re.search(r"loss ([^,]+),", line).group(1) for line in lines]  # type: ignore[union-attr]
    history = [r["loss"] for r in rt.history]
    assert losses == ["-", f"{history[0]:.4f}", f"{history[2]:.4f}"]
    # 3 batches of 4 samples in 31 s; 3 batches left at 31 s / 3 batches each
    assert lines[1].endswith(", 0 samples/s, ETA 0:00:31")
    assert lines[2].endswith(", 0 samples/s, ETA 0:00:00")


def test_each_pass_of_a_loader_shows_its_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, model, optimizer, loader = _setup(batches=2)
    monkeypatch.setattr(progress, "clock", lambda: 0.0)
    out = io.StringIO()
    shown = rt.progress(loader, every=0, out=out, desc="fit")
    for _ in range(2):
        _train(rt, model, optimizer, shown)
    firsts = [line.split(", ")[:2] for line in out.getvalue().splitlines()]
    assert firsts == [
        ["fit 0/2 batches (0%)", "epoch 1"],
        ["fit 1/2 batches (50%)", "epoch 1"],
        ["fit 2/2 batches (100%)", "epoch 1"],
        ["fit 0/2 batches (0%)", "epoch 2"],
        ["fit 1/2 batches (50%)", "epoch 2"],
        ["fit 2/2 batches (100%)", "epoch 2"],
    ]
    assert len(shown) == 2


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(12):
            yield torch.ones(4), torch.zeros(1)


@pytest.mark.parametrize("total", [None, 3])
def test_a_loader_without_len(total: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = gk.Runtime(devices="cpu", seed=0)
    loader = rt.setup_loader(DataLoader(_Stream(), batch_size=4))
    monkeypatch.setattr(progress, "clock", iter([0.0, 0.0, 1.0, 2.0, 4.0, 4.0]).__next__)
    out = io.StringIO()
    shown = rt.progress(loader, every=0, out=out, total=total)
    assert len(list(shown)) == 3
    last = out.getvalue().splitlines()[-1]
    if total is None:
        assert last.startswith("train 3 batches, epoch 1, loss -, 3 samples/s, ETA -")
        with pytest.raises(TypeError, match="pass total="):
            len(shown)
    else:
        assert last.startswith("train 3/3 batches (100%), epoch 1, loss -, 3 samples/s, ETA 0:")


def test_a_plain_iterable_shows_batches_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = gk.Runtime(devices="cpu")
    monkeypatch.setattr(progress, "clock", iter([0.0, 0.0, 2.0, 4.0, 4.0]).__next__)
    out = io.StringIO()
    assert list(rt.progress(iter("ab"), every=0, out=out, desc="eval")) == ["a", "b"]
    assert out.getvalue().splitlines() == [
        "eval 0 batches, loss -, - batches/s, ETA -",
        "eval 1 batches, loss -, 0.5 batches/s, ETA -",
        "eval 2 batches, loss -, 0.5 batches/s, ETA -",
    ]


def test_other_ranks_iterate_silently() -> None:
    rt, model, optimizer, loader = _setup()
    rt.strategy.rank = 1  # as rank 1 of a job sees itself
    out = io.StringIO()
    shown = rt.progress(loader, out=out)
    assert iter(shown).__class__ is iter(loader).__class__  # the loader's own pass, unwrapped
    _train(rt, model, optimizer, shown)
    assert out.getvalue() == "" and rt.global_step == 6


def test_a_loop_breaking_early_ends_with_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, _, _, loader = _setup()
    monkeypatch.setattr(progress, "clock", lambda: 0.0)
    out = io.StringIO()
    for i, _ in enumerate(rt.progress(loader, every=1000, out=out)):
        if i == 1:
            break
    assert [line.split(", ")[0] for line in out.getvalue().splitlines()] == [
        "train 0/6 batches (0%)",
        "train 1/6 batches (17%)",
    ]


def test_on_a_terminal_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, model, optimizer, loader = _setup(log_every=3, batches=3)
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    _train(rt, model, optimizer, rt.progress(loader, out=console, desc="fit"))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # type: ignore[attr-defined]
    loss = f"{rt.history[-1]['loss']:.4f}"
    assert re.search(rf"fit epoch 1 .*━.* 3/3 batches loss {loss} \d+ samples/s", text), text
    assert "(100%)" not in text  # no plain lines on a terminal


def test_showing_progress_adds_no_read_copy_or_sync() -> None:
    def counts(shown: bool) -> tuple[Any, ...]:
        rt, model, optimizer, loader = _setup(log_every=2, batches=6)
        with gk.trace() as t:
            _train(
                rt,
                model,
                optimizer,
                rt.progress(loader, every=0, out=io.StringIO()) if shown else loader,
            )
        syncs = sorted((s.op, s.count) for s in t.syncs)
        copies = sorted((c.kind, c.count) for c in t.transfers)
        return syncs, copies, len(rt.history)

    assert counts(shown=True) == counts(shown=False)
    assert sum(n for _, n in counts(shown=False)[0]) == 3  # rt.log's 3 read-backs


@pytest.mark.parametrize(
    ("keywords", "match"),
    [({"every": -1}, "every=-1"), ({"total": 2.5}, "total=2.5"), ({"epochs": "2"}, "epochs=")],
)
def test_bad_arguments_are_refused(keywords: dict[str, Any], match: str) -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(ConfigError, match=match):
        rt.progress(range(2), **keywords)
