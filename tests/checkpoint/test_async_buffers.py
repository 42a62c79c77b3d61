"""The host copies of background saves (``async_save``): a save copies into the memory the
previous one wrote from, once that write has ended, allocates only for what is new or changed
shape, keeps shared tensors shared and never hands one buffer to two tensors; the files stay
those of a synchronous save; the end of the run frees them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint import snapshot, writer
from gpukit.checkpoint.background import Background
from gpukit.checkpoint.failure import Failures
from gpukit.errors import CheckpointWriteError
from gpukit.runtime.checkpointing import _Alone

FILES = ("manifest.json", "model.safetensors", "state.pt")


def test_a_lease_copies_into_the_buffers_the_last_one_gave_back() -> None:
    buffers = snapshot.HostBuffers()
    shared, other = torch.ones(2, 3), torch.full((2, 3), 2.0)
    first = buffers.lease()
    copied = snapshot.tree({"a": shared, "b": [shared], "c": other, "n": 3}, first.copy)
    assert copied["a"] is copied["b"][0]  # shared in the state: shared in the copy
    assert copied["a"].data_ptr() != copied["c"].data_ptr()  # one buffer per tensor
    first.give_back()
    assert sorted(t.data_ptr() for t in buffers.held) == sorted(
        [copied["a"].data_ptr(), copied["c"].data_ptr()]
    )
    second = buffers.lease()
    again = snapshot.tree({"a": shared * 5, "c": other * 7}, second.copy)
    assert {again["a"].data_ptr(), again["c"].data_ptr()} == {
        copied["a"].data_ptr(),
        copied["c"].data_ptr(),
    }
    assert again["a"].tolist() == [[5.0] * 3] * 2 and again["c"].tolist() == [[14.0] * 3] * 2
    assert again["a"].data_ptr() == copied["a"].data_ptr()  # the same place, the same buffer


def test_a_changed_shape_gets_a_new_buffer_and_the_old_one_goes() -> None:
    buffers = snapshot.HostBuffers()
    first = buffers.lease()
    kept = first.copy(torch.zeros(4, 4))
    old = first.copy(torch.zeros(3))
    first.give_back()
    second = buffers.lease()
    same = second.copy(torch.ones(4, 4))
    grown = second.copy(torch.ones(5))
    changed_dtype = second.copy(torch.ones(4, 4, dtype=torch.float64))
    second.give_back()
    assert same.data_ptr() == kept.data_ptr()
    assert grown.shape == (5,) and grown.data_ptr() != old.data_ptr()
    assert changed_dtype.dtype == torch.float64 and changed_dtype.data_ptr() != kept.data_ptr()
    assert sorted(tuple(t.shape) for t in buffers.held) == [(4, 4), (4, 4), (5,)]


def test_a_lease_taken_while_the_last_is_out_never_shares_its_memory() -> None:
    """A write given up at a stop may still read its copies: the next save allocates."""
    buffers = snapshot.HostBuffers()
    first = buffers.lease()
    out = first.copy(torch.ones(8))
    second = buffers.lease()
    assert second.copy(torch.zeros(8)).data_ptr() != out.data_ptr()
    assert out.tolist() == [1.0] * 8
    first.give_back()
    with pytest.raises(AssertionError, match="given back twice"):
        first.give_back()
    with pytest.raises(AssertionError, match="already given back"):
        first.copy(torch.ones(8))


def _dtypes() -> list[torch.Tensor]:
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    made = [
        nan_payload,  # NaNs with payloads: copied bit for bit
        torch.randn(3, 4, dtype=torch.bfloat16),
        torch.randn(5, dtype=torch.float16),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64),
        torch.tensor(2.5),  # 0-dim
        torch.zeros(0, 3),  # empty
        torch.randn(4, 3).t(),  # not contiguous: copy_
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate: copy_
        torch.randn(8, 8)[2:5],  # a view at an offset
    ]
    if hasattr(torch, "float8_e4m3fn"):
        made.append(torch.randn(4).to(torch.float8_e4m3fn))
    return made


@pytest.mark.parametrize("tensor", _dtypes(), ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_copies_hold_the_same_bits_fresh_or_into_a_kept_buffer(tensor: torch.Tensor) -> None:
    buffers = snapshot.HostBuffers()
    expected = tensor.resolve_conj().contiguous()
    for _ in range(2):  # new memory, then the same memory again
        lease = buffers.lease()
        out = lease.copy(tensor)
        assert out.is_contiguous() and out.shape == tensor.shape and out.dtype == tensor.dtype
        assert not out.is_conj()
        assert out.reshape(-1).view(torch.uint8).tolist() == (
            expected.reshape(-1).view(torch.uint8).tolist()
        )
        assert out.numel() == 0 or out.data_ptr() != tensor.data_ptr()
        lease.give_back()
    assert snapshot.host_copy(tensor).reshape(-1).view(torch.uint8).tolist() == (
        expected.reshape(-1).view(torch.uint8).tolist()
    )


def test_one_thread_writes_save_after_save_and_a_given_up_write_gets_its_own(
    tmp_path: Path,
) -> None:
    background = Background()
    threads: dict[int, int] = {}  # step -> the thread that wrote it
    go, held = threading.Event(), threading.Event()

    def write(step: int, hold: bool) -> Any:
        def run() -> None:
            threads[step] = threading.get_ident()
            if hold:
                held.set()
                go.wait(30)

        return run

    def start(step: int, hold: bool = False) -> None:
        tmp = tmp_path / f".tmp-{step}"
        tmp.mkdir()
        background.start(
            write(step, hold), step=step, directory=tmp_path, tmp=tmp, failures=Failures(), needed=0
        )

    for step in (1, 2):
        start(step)
        assert background.settle(_Alone(), print, "the next save") is True
    start(3, hold=True)
    assert held.wait(30)  # under way (not still queued) when it is given up
    assert background.settle(_Alone(), lambda _: None, "the stop", lambda: 0.0) is False
    start(4)  # beside the write still held
    background.wait()
    assert background.settle(_Alone(), print, "the end") is True
    go.set()
    assert threads[1] == threads[2] == threads[3] != threads[4]
    background.free()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensors_are_cloned_as_before() -> None:
    buffers = snapshot.HostBuffers()
    lease = buffers.lease()
    quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    copied = lease.copy(quantized)
    assert copied.is_quantized and torch.equal(copied.dequantize(), quantized.dequantize())
    assert copied.data_ptr() != quantized.data_ptr()
    lease.give_back()
    assert buffers.held == []  # not kept: no buffer of that kind to copy into


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x))))


def _train(folder: Path, async_save: bool, on_save: Any = None) -> gk.Runtime:
    """6 steps of ``Tied`` (fp32, CPU), saving after steps 2, 4 and 6 and waiting for each
    write; ``on_save(rt)`` after each."""
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=folder, async_save=async_save)
    net = Tied()
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    for step in range(1, 7):
        x = torch.randint(0, 16, (4, 5))
        rt.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()))
        rt.step(opt)
        if step % 2 == 0:
            rt.save()
            rt.wait_for_save()
            if on_save is not None:
                on_save(rt)
    return rt


def test_later_saves_write_from_the_first_saves_memory_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer.save_file
    written: list[dict[str, int]] = []  # per save: each weight's host copy's address

    def noted(tensors: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            written.append({name: t.data_ptr() for name, t in tensors.items()})
        real(tensors, *args, **kwargs)

    monkeypatch.setattr(writer, "save_file", noted)
    held: list[set[int]] = []
    rt = _train(
        tmp_path / "async",
        True,
        lambda rt: held.append({t.data_ptr() for t in rt._checkpointing.background.buffers.held}),
    )
    assert len(written) == 3 and written[0] == written[1] == written[2]
    assert held[0] == held[1] == held[2] and set(written[0].values()) < held[0]
    assert len(held[0]) > len(written[0])  # the optimizer's state too
    rt.teardown()
    assert rt._checkpointing.background.buffers.held == []  # freed at the end of the run
    _train(tmp_path / "sync", False).teardown()
    for step in (2, 4, 6):  # 4 and 6 written from the memory of 2's copies
        name = f"step-{step:08d}"
        for file in FILES:
            a = (tmp_path / "async" / name / file).read_bytes()
            assert a == (tmp_path / "sync" / name / file).read_bytes(), (name, file)
    weights = load_file(tmp_path / "async" / "step-00000006" / "model.safetensors")
    assert "out.weight" not in weights  # the tied weight once, as save_model writes it


@pytest.mark.gpu
def test_on_a_gpu_later_saves_copy_into_the_same_pinned_memory(tmp_path: Path) -> None:
    held: list[list[torch.Tensor]] = []
    for mode in ("async", "sync"):
        rt = gk.Runtime(
            devices=["cuda:0"], seed=0, checkpoints=tmp_path / mode, async_save=mode == "async"
        )
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
        model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
        for _ in range(2):
            rt.backward(model(torch.randn(8, 256, device=rt.device)).pow(2).mean())
            rt.step(opt)
            rt.save()
            rt.wait_for_save()
            held.append(list(rt._checkpointing.background.buffers.held))
        rt.teardown()
    first, second = held[0], held[1]
    # The 4 weights and their exp_avg and exp_avg_sq come from the GPU: pinned.
    assert sum(t.is_pinned() for t in first) >= 12
    assert {t.data_ptr() for t in first} == {t.data_ptr() for t in second}
    for file in FILES:
        a = (tmp_path / "async" / "step-00000002" / file).read_bytes()
        assert a == (tmp_path / "sync" / "step-00000002" / file).read_bytes(), file


def test_a_bug_after_a_write_is_its_failure_and_the_thread_takes_the_next(
    tmp_path: Path,
) -> None:
    told: list[int] = []

    def landed(step: int) -> None:
        if step == 1:
            raise RuntimeError("a bug in what is told")
        told.append(step)

    background = Background(landed=landed)
    for step in (1, 2):
        tmp = tmp_path / f".tmp-{step}"
        tmp.mkdir()
        background.start(
            lambda: None, step=step, directory=tmp_path, tmp=tmp, failures=Failures(), needed=0
        )
        if step == 1:
            with pytest.raises(CheckpointWriteError, match="a bug in what is told"):
                background.settle(_Alone(), print, "the next save")
            assert not tmp.exists()  # what the failed save began is removed
        else:
            assert background.settle(_Alone(), print, "the end") is True
    assert told == [2]
    background.free()
