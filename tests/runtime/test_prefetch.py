"""The CUDA prefetch: each batch's copy on a side stream, the current stream waiting for that
batch's copy alone. The CUDA path runs here with torch.cuda's streams and events replaced by
fakes that log what is enqueued where; a test marked ``gpu`` runs it for real."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpukit.runtime.data.prefetch as prefetch
from gpukit.runtime.data.loader import DeviceLoader

CUDA = torch.device("cuda:0")


class _Fakes:
    """torch.cuda's Stream, Event, stream() and current_stream(), logging each operation."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.events = 0
        self.current = self.make_stream("current")
        self.inside: str | None = None  # the stream a ``with torch.cuda.stream(s)`` made current

    def make_stream(self, name: str = "side") -> Any:
        fakes = self

        class Stream:
            device = CUDA

            def __init__(self) -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                fakes.log.append(("wait", self.name, event.name))

            def wait_stream(self, other: Any) -> None:
                raise AssertionError("a stream waits for one batch's event, not a stream")

        return Stream()

    def make_event(self, enable_timing: bool = False) -> Any:
        fakes, number = self, self.events
        self.events += 1

        class Event:
            name = f"{'timing' if enable_timing else 'copy'}{number}"

            def record(self, stream: Any) -> None:
                fakes.log.append(("record", self.name, stream.name))

        return Event()

    @contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        self.inside = s.name
        try:
            yield
        finally:
            self.inside = None

    def move_to(self, batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
        assert device == CUDA and non_blocking
        self.log.append(("copy", int(batch[0][0]), self.inside))
        return batch


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> _Fakes:
    f = _Fakes()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: f.make_stream())
    monkeypatch.setattr(torch.cuda, "Event", f.make_event)
    monkeypatch.setattr(torch.cuda, "stream", f.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f.current)
    monkeypatch.setattr(prefetch, "move_to", f.move_to)
    return f


def _batches(fakes: _Fakes, n: int) -> list[tuple[torch.Tensor]]:
    out = []
    for i in range(n):
        t = torch.tensor([i])
        t.record_stream = lambda s, i=i: fakes.log.append(("record_stream", i, s.name))  # type: ignore[method-assign]
        out.append((t,))
    return out


def test_each_batch_waits_for_its_own_copy_not_the_next_ones(fakes: _Fakes) -> None:
    batches = _batches(fakes, 3)
    for batch in prefetch.on_device(iter(batches), CUDA):
        fakes.log.append(("handed", int(batch[0][0])))
    assert fakes.log == [
        ("copy", 0, "side"),
        ("record", "copy0", "side"),
        ("copy", 1, "side"),  # batch 1's copy is enqueued before batch 0 is handed out...
        ("record", "copy1", "side"),
        ("wait", "current", "copy0"),  # ...and batch 0's step waits for batch 0's copy alone
        ("record_stream", 0, "current"),
        ("handed", 0),
        ("copy", 2, "side"),
        ("record", "copy2", "side"),
        ("wait", "current", "copy1"),
        ("record_stream", 1, "current"),
        ("handed", 1),
        ("wait", "current", "copy2"),
        ("record_stream", 2, "current"),
        ("handed", 2),
    ]


def test_the_device_wait_is_marked_by_two_timing_events_around_it(fakes: _Fakes) -> None:
    marked: list[tuple[str, str]] = []
    batches = _batches(fakes, 2)
    handed = list(
        prefetch.on_device(iter(batches), CUDA, lambda a, b: marked.append((a.name, b.name)))
    )
    assert handed == batches
    on_current = [e for e in fakes.log if "current" in e[1:] and e[0] != "record_stream"]
    assert on_current == [
        ("record", "timing2", "current"),
        ("wait", "current", "copy0"),
        ("record", "timing3", "current"),
        ("record", "timing4", "current"),
        ("wait", "current", "copy1"),
        ("record", "timing5", "current"),
    ]
    assert marked == [("timing2", "timing3"), ("timing4", "timing5")]


def test_batches_without_a_tensor_pass_through_unchanged(fakes: _Fakes) -> None:
    """Strings, dicts of lists: nothing to copy, so no copy, event or wait, and no error."""
    batches: list[Any] = [["a", "b"], {"ids": [1, 2], "text": ["x", "y"]}, ("only", 3)]
    handed = list(prefetch.on_device(iter(batches), CUDA))
    assert all(h is b for h, b in zip(handed, batches, strict=True))
    assert len(handed) == 3 and fakes.log == []


def test_a_loader_of_strings_and_dicts_of_lists_iterates_on_every_device() -> None:
    words = ["alpha", "beta", "gamma", "delta"]
    plain = DataLoader(words, batch_size=2)
    assert list(DeviceLoader(plain, torch.device("cpu"), 1, 0, seed=0)) == list(plain)
    records = [{"ids": [i, i + 1], "name": f"n{i}"} for i in range(4)]
    plain = DataLoader(records, batch_size=2, collate_fn=lambda items: items)
    assert list(DeviceLoader(plain, torch.device("cpu"), 1, 0, seed=0)) == list(plain)


@pytest.mark.gpu
def test_on_a_gpu_batches_and_their_order_equal_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 16, generator=gen), torch.randint(0, 9, (96,)))
    plain = DataLoader(data, batch_size=8)
    loader = DeviceLoader(DataLoader(data, batch_size=8), CUDA, 1, 0, seed=0)
    got = []
    for x, y in loader:
        assert x.device.type == "cuda" and y.device.type == "cuda"
        got.append((x * 2, y + 1))  # used on the current stream while the next one copies
    expected = [(x * 2, y + 1) for x, y in plain]
    assert len(got) == len(expected)
    for (gx, gy), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(gx.cpu(), ex) and torch.equal(gy.cpu(), ey)
    texts = DataLoader(["a", "b", "c"], batch_size=2)
    assert list(DeviceLoader(texts, CUDA, 1, 0, seed=0)) == [["a", "b"], ["c"]]
