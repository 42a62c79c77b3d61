"""The trace of copies and synchronisations: counts at known lines, restored patches, schema."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import linecache
import logging
import os
import runpy
import textwrap
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.diagnostics.trace import Sync, Trace, Transfer, trace
from gpukit.diagnostics.trace.records import Recorder
from gpukit.diagnostics.trace.report import render
from gpukit.errors import ConfigError

# Where the devices whose copies are ignored are read: tests empty it so that the meta device
# stands in for a GPU.
records_module = importlib.import_module("gpukit.diagnostics.trace.records")


def write_script(tmp_path: Path, source: str) -> tuple[Path, dict[str, int]]:
    """The script, and the line of each ``# @NAME`` marker in it."""
    path = tmp_path / "script.py"
    text = textwrap.dedent(source)
    path.write_text(text)
    lines = {
        line.split("# @")[1].strip(): number
        for number, line in enumerate(text.splitlines(), 1)
        if "# @" in line
    }
    return path, lines


def run_traced(path: Path) -> Trace:
    with trace() as t:
        runpy.run_path(str(path), run_name="__main__")
    return t


SYNCS = """
    import torch


    def main():
        x = torch.arange(4.0)
        for _ in range(3):
            x.sum().item()  # @A
        x.tolist()  # @B
        for _ in range(2):
            bool(x[1])  # @C
        print(x)  # @D
        print(x.sum(), f"{x.sum():.2f}")  # @E


    if __name__ == "__main__":
        main()
"""


def test_syncs_are_counted_at_their_lines_with_their_functions(tmp_path: Path) -> None:
    path, at = write_script(tmp_path, SYNCS)
    t = run_traced(path)
    found = {(s.op, s.line, s.function, s.file): s.count for s in t.syncs}
    assert found == {
        ("item", at["A"], "main", str(path)): 3,
        ("tolist", at["B"], "main", str(path)): 1,
        ("bool", at["C"], "main", str(path)): 2,
        ("print", at["D"], "main", str(path)): 1,  # not also the item()s it does inside
        ("print", at["E"], "main", str(path)): 2,  # a 0-dim print and a formatted f-string
    }
    assert all(s.device == "cpu" and s.synchronised is False for s in t.syncs)
    assert t.transfers == []


def test_report_ranks_findings_with_line_and_fix(tmp_path: Path) -> None:
    path, at = write_script(tmp_path, SYNCS)
    report = run_traced(path).report()
    first = report.splitlines()[3]
    assert first.startswith(" 1.") and ".item() 3 times" in first
    assert f"script.py:{at['A']} in main" in first and "[potential]" in first
    assert "`x.sum().item()  # @A`" in report  # the code itself
    assert "rt.log(loss=loss)" in report
    assert f"script.py:{at['D']} in main" in report and "print every N steps" in report


def test_same_device_moves_and_dtype_changes_are_not_transfers() -> None:
    x = torch.ones(8)
    with trace() as t:
        x.to("cpu")
        x.to(torch.float64)
        x.cpu()
        x.to(torch.device("cpu"), copy=True)
        torch.tensor([1.0, 2.0])
        torch.empty(3).copy_(x[:3])
    assert t.transfers == []
    assert t.syncs == []


def test_meta_device_copies_are_ignored_by_default() -> None:
    with trace() as t:
        torch.ones(4).to("meta") + 1
    assert t.transfers == []
    assert t.ops_per_device == {"cpu": 2, "meta": 1}  # ones and _to_copy, then the add


COPIES = """
    import torch


    def load():
        x = torch.ones(1000)
        for _ in range(2):
            x.to("meta")  # @E
        torch.empty(10, device="meta").copy_(x[:10])  # @F
        x.to("meta", non_blocking=True)  # @G
        torch.tensor([1.0, 2.0, 3.0], device="meta")  # @H
        torch.as_tensor(x, device="meta")  # @I


    load()
"""


def test_cross_device_copies_with_meta_standing_in_for_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records_module, "_IGNORED_DEVICE_TYPES", frozenset())
    path, at = write_script(tmp_path, COPIES)
    t = run_traced(path)
    found = {(c.line, c.kind, c.count, c.bytes, c.pinned, c.blocking) for c in t.transfers}
    assert found == {
        (at["E"], "h2d", 2, 8000, False, True),
        (at["F"], "h2d", 1, 40, False, True),
        (at["G"], "h2d", 1, 4000, False, False),
        (at["H"], "h2d", 1, 12, False, True),  # never reaches the dispatcher: torch.tensor
        (at["I"], "h2d", 1, 4000, False, True),  # a tensor's copy: counted once
    }
    assert {(c.function, c.src, c.dst) for c in t.transfers} == {("load", "cpu", "meta")}
    assert all(isinstance(c, Transfer) for c in t.transfers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.transfers[0].count = 0  # type: ignore[misc]
    assert t.syncs == []
    assert "h2d 3.9 KiB 2 times (blocking, pageable, cpu -> meta)" in t.report()
    assert "pin host memory" in t.report()


def test_blocking_d2h_copy_is_a_transfer_and_a_sync_listed_once() -> None:
    r = Recorder()

    def read_back() -> None:
        r.record_transfer(torch.device("cuda:0"), torch.device("cpu"), 4000, False, True)

    sync_line = read_back.__code__.co_firstlineno + 1

    read_back()
    read_back()
    r.record_transfer(torch.device("cuda:0"), torch.device("cuda:1"), 100, True, False)
    (d2h, d2d) = r.transfers
    assert (d2h.kind, d2h.count, d2h.bytes, d2h.function) == ("d2h", 2, 8000, "read_back")
    assert (d2d.kind, d2d.pinned) == ("d2d", False)  # pinned means nothing between GPUs
    assert r.syncs == [Sync("d2h-copy", 2, __file__, sync_line, "read_back", "cuda:0", True)]
    report = render(r.ops_per_device, r.transfers, r.syncs)
    assert "d2h-copy" not in report and "keep results on the device" in report
    assert "gk.placement(model)" in report


def test_to_dict_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records_module, "_IGNORED_DEVICE_TYPES", frozenset())
    path, _ = write_script(tmp_path, COPIES + "\n" + SYNCS)
    data = run_traced(path).to_dict()
    assert set(data) == {"transfers", "syncs", "ops_per_device"}
    transfer_types = {
        "kind": str,
        "bytes": int,
        "count": int,
        "file": str,
        "line": int,
        "function": str,
        "pinned": bool,
        "blocking": bool,
    }
    sync_types = {"op": str, "count": int, "file": str, "line": int, "function": str}
    sync_types.update({"device": str, "synchronised": bool})
    assert data["transfers"] and data["syncs"]
    for item in data["transfers"]:
        assert {k: type(item[k]) for k in transfer_types} == transfer_types
        assert item["kind"] in ("h2d", "d2h", "d2d")
    for item in data["syncs"]:
        assert {k: type(item[k]) for k in sync_types} == sync_types
    assert all(type(k) is str and type(v) is int for k, v in data["ops_per_device"].items())
    assert json.loads(json.dumps(data)) == data


TENSOR_ENTRIES = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__repr__")
TENSOR_ENTRIES += ("__index__",)
PATCHED: list[tuple[Any, str]] = [(torch.Tensor, name) for name in TENSOR_ENTRIES]
PATCHED += [(torch.Tensor, "__str__"), (torch.Tensor, "__format__")]
PATCHED += [
    (torch, "tensor"),
    (torch, "as_tensor"),
    (torch, "asarray"),
    (torch.cuda, "synchronize"),
]
PATCHED += [(torch.Tensor, "new_tensor")]
PATCHED += [(torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
if hasattr(torch, "accelerator"):
    PATCHED.append((torch.accelerator, "synchronize"))


def own_attributes() -> list[Any]:
    return [vars(owner).get(name, "<inherited>") for owner, name in PATCHED]


def test_patches_are_restored_exactly_after_the_block_and_after_an_error() -> None:
    before = own_attributes()
    with trace():
        assert all(a is not b for a, b in zip(own_attributes(), before, strict=True))
        assert torch._C._len_torch_dispatch_stack() == 1
    assert own_attributes() == before
    with pytest.raises(ZeroDivisionError), trace() as t:
        torch.ones(1).item()
        raise ZeroDivisionError
    assert own_attributes() == before
    assert torch._C._len_torch_dispatch_stack() == 0
    assert len(t.syncs) == 1
    torch.ones(1).item()  # after the block: not recorded
    assert t.syncs[0].count == 1


def test_a_nested_trace_sees_its_part_and_the_outer_one_everything() -> None:
    before = own_attributes()
    with trace() as outer:
        torch.ones(1).item()
        with trace() as inner:
            torch.ones(1).tolist()
        with pytest.raises(ConfigError, match="already active"), inner, inner:
            pass
        torch.ones(1).item()
    assert own_attributes() == before
    assert sorted(s.op for s in outer.syncs) == ["item", "item", "tolist"]
    assert [s.op for s in inner.syncs] == ["tolist"] and inner.ops_per_device["cpu"] >= 1


def test_numpy_data_moved_at_creation_is_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    monkeypatch.setattr(records_module, "_IGNORED_DEVICE_TYPES", frozenset())
    with trace() as t:
        torch.tensor(np.ones(4, dtype=np.float32), device="meta")
        torch.as_tensor(np.ones(4, dtype=np.float32), device="meta")
        torch.tensor([1.0, 2.0], device="meta")
    assert sum(x.count for x in t.transfers) == 3


def test_every_way_to_make_a_device_tensor_from_host_data_is_one_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import numpy as np

    monkeypatch.setattr(records_module, "_IGNORED_DEVICE_TYPES", frozenset())
    on_device = torch.empty(2, device="meta")
    host = torch.ones(3)
    with trace() as t:
        torch.asarray([1.0, 2.0], device="meta")
        torch.asarray(np.ones(3, dtype=np.float32), device="meta")
        torch.asarray(host, device="meta")
        on_device.new_tensor([1.0, 2.0, 3.0, 4.0])
        on_device.new_tensor(np.ones(5, dtype=np.float32))
        with warnings.catch_warnings():  # torch suggests clone() for a tensor: still a copy
            warnings.simplefilter("ignore", UserWarning)
            on_device.new_tensor(host.clone())
        torch.tensor(data=[1.0], device="meta")
    assert {c.kind for c in t.transfers} == {"h2d"}
    assert [c.count for c in t.transfers] == [1] * 7  # one a line, none counted twice
    with trace() as t:
        host.new_tensor([1.0, 2.0])  # stays on the host
        torch.asarray([1.0])
    assert t.transfers == []


@pytest.mark.processes
def test_a_forked_child_records_nothing() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    counted = ctx.Queue()

    def child_work() -> None:  # ops the child's inherited trace would count
        before = sum(t.ops_per_device.values())
        torch.ones(3).sum()
        counted.put(sum(t.ops_per_device.values()) - before)

    with trace() as t:
        child = ctx.Process(target=child_work)
        child.start()
        assert counted.get(timeout=30) == 0
        child.join(30)
        torch.ones(3).sum()  # the parent still counts
    assert child.exitcode == 0 and t.ops_per_device["cpu"] >= 2


def test_a_trace_records_only_its_own_thread() -> None:
    before = own_attributes()
    other: list[Trace] = []
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        with trace() as t:
            started.set()
            release.wait(5)
            torch.ones(1).tolist()
        other.append(t)

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(5)
    with trace() as mine:
        torch.ones(1).item()
    assert own_attributes() != before  # the other thread's trace still needs the wrappers
    release.set()
    thread.join(5)
    assert own_attributes() == before
    assert [s.op for s in mine.syncs] == ["item"]
    assert [s.op for s in other[0].syncs] == ["tolist"]


def test_ops_per_device_counts_cpu_ops() -> None:
    x = torch.ones(3)
    with trace() as t:
        for _ in range(5):
            x = x + 1
    assert t.ops_per_device == {"cpu": 5}


def test_data_dependent_shapes_are_syncs_and_static_ones_are_not() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    with trace() as t:
        x[x > 0]
        x.nonzero()
        torch.masked_select(x, x > 0)
        x[torch.tensor([0, 2])]  # integer indices: shape known
        torch.where(x > 0, x, 0.0)  # static shape
    assert Counter(s.op for s in t.syncs for _ in range(s.count)) == {"mask-index": 2, "nonzero": 1}


def test_attribution_skips_torch_and_optimizer_step_counters() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with trace() as t:
        for _ in range(2):
            model(torch.ones(2, 3)).sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            optimizer.step()  # reads its CPU step counters: not syncs
            optimizer.zero_grad()
    (sync,) = t.syncs
    assert (sync.op, sync.count, sync.file) == ("bool", 2, __file__)
    assert sync.function == "test_attribution_skips_torch_and_optimizer_step_counters"
    assert "clip_grad_norm_" in linecache.getline(__file__, sync.line)


def test_file_rules_for_attribution() -> None:
    gpukit_dir = Path(gk.__file__).resolve().parent
    torch_dir = Path(torch.__file__).resolve().parent
    where = importlib.import_module("gpukit.diagnostics.trace.where")
    classify = where._classify
    assert classify(str(gpukit_dir / "workloads" / "loop.py")) == where._USER
    assert classify(str(gpukit_dir / "workloads" / "gpt.py")) == where._USER
    assert classify(str(gpukit_dir / "runtime" / "runtime.py")) == where._GPUKIT
    assert classify(str(gpukit_dir / "diagnostics" / "trace" / "records.py")) == where._GPUKIT
    assert classify(str(torch_dir / "nn" / "modules" / "linear.py")) == where._LIBRARY
    assert classify(str(torch_dir / "optim" / "adamw.py")) == where._HOST_SIDE
    assert classify(threading.__file__) == where._LIBRARY
    assert classify(contextlib.__file__) == where._LIBRARY
    assert classify(logging.__file__) == where._LIBRARY
    assert classify("<frozen runpy>") == where._LIBRARY  # a frozen standard module
    assert classify(pytest.__file__) == where._LIBRARY  # an installed package
    assert classify("/opt/conda/lib/python3.12/site-packages/trainer/log.py") == where._LIBRARY
    assert classify("/usr/lib/python3/dist-packages/numpy/_core/memmap.py") == where._LIBRARY
    assert classify(str(gpukit_dir / "bench" / "nanogpt_loop.py")) == where._USER
    assert classify(str(gpukit_dir / "bench" / "timing.py")) == where._GPUKIT
    assert classify("/home/me/train.py") == where._USER
    assert classify("<stdin>") == where._USER


def test_a_tensor_logged_is_attributed_to_the_logging_call() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("gpukit-test-trace")
    logger.propagate = False  # only this handler: pytest's own would format the record again
    logger.addHandler(logging.StreamHandler(stream))
    with trace() as t:
        logger.warning("loss %s", torch.ones(1))
    (sync,) = t.syncs
    assert (sync.op, sync.count, sync.file) == ("print", 1, __file__)
    assert "logger.warning" in linecache.getline(__file__, sync.line)
    assert stream.getvalue() == "loss tensor([1.])\n"


def test_explicit_synchronize_is_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    with trace() as t:
        torch.cuda.synchronize(1)
    assert calls == [1]
    assert [(s.op, s.device, s.synchronised) for s in t.syncs] == [("synchronize", "cuda:1", True)]
    assert "remove it outside timing code" in t.report()


def train(steps: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_tracing_does_not_change_results(capsys: pytest.CaptureFixture[str]) -> None:
    plain_losses, plain_params = train(4)
    with trace() as t:
        traced_losses, traced_params = train(4)
    assert traced_losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_params, traced_params, strict=True))
    assert [(s.op, s.count) for s in t.syncs] == [("item", 4)]
    x = torch.arange(3.0)
    outside = (str(x), repr(x), f"{x.sum():.1f}", x.tolist(), bool(x[1]))
    with trace():
        inside = (str(x), repr(x), f"{x.sum():.1f}", x.tolist(), bool(x[1]))
    assert inside == outside


# --- on a GPU --------------------------------------------------------------------------------

GPU_COPIES = """
    import torch


    def main():
        x = torch.ones(1000, 1000)
        p = torch.ones(1000, 1000).pin_memory()
        for _ in range(3):
            a = x.to("cuda")  # @P
        for _ in range(3):
            b = p.to("cuda", non_blocking=True)  # @Q
        for _ in range(2):
            c = a.cpu()  # @R
        torch.cuda.synchronize()  # @S


    main()
"""


@pytest.mark.gpu
def test_gpu_copies_have_exact_bytes(tmp_path: Path) -> None:
    path, at = write_script(tmp_path, GPU_COPIES)
    t = run_traced(path)
    mb4 = 1000 * 1000 * 4
    assert {(c.line, c.kind, c.count, c.bytes, c.pinned, c.blocking) for c in t.transfers} == {
        (at["P"], "h2d", 3, 3 * mb4, False, True),
        (at["Q"], "h2d", 3, 3 * mb4, True, False),
        (at["R"], "d2h", 2, 2 * mb4, False, True),
    }
    assert {(s.op, s.line, s.count, s.device, s.synchronised) for s in t.syncs} == {
        ("d2h-copy", at["R"], 2, "cuda:0", True),
        ("synchronize", at["S"], 1, "cuda:0", True),
    }


@pytest.mark.gpu
def test_gpu_training_loop_item_is_a_sync_per_step() -> None:
    model = nn.Linear(32, 1).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32, device="cuda"), torch.randn(64, 1, device="cuda")
    steps = 5
    with trace() as t:
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
    items = [s for s in t.syncs if s.op == "item"]
    assert [(s.count, s.device, s.synchronised, s.function) for s in items] == [
        (steps, "cuda:0", True, "test_gpu_training_loop_item_is_a_sync_per_step")
    ]
    assert "loss.item()" in t.report()
    assert os.path.basename(items[0].file) == "test_trace.py"


def _scripted_sum(values: list[float]) -> torch.Tensor:
    return torch.tensor(values) + torch.as_tensor(values)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_compiles_torch_tensor_inside_a_trace() -> None:
    from torch.jit import _builtins

    before = dict(_builtins._get_builtin_table())
    with trace():
        scripted = torch.jit.script(_scripted_sum)
    assert scripted([1.0, 2.0]).tolist() == [2.0, 4.0]
    assert _builtins._get_builtin_table() == before  # the wrappers' entries are gone with them


def _compiled_step(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sin() + 1


def test_a_compiled_function_runs_and_is_counted_inside_a_trace() -> None:
    # The mode keeps torch.compile out of its own frames without torch's per-op wrapper.
    compiled = torch.compile(_compiled_step, backend="eager")
    x = torch.ones(3)
    expected = compiled(x)
    with trace() as t:
        outputs = [compiled(x) for _ in range(2)]
        outputs[0].sum().item()
    assert all(torch.equal(out, expected) for out in outputs)
    assert t.ops_per_device["cpu"] >= 2 * 3
    assert [(s.op, s.count) for s in t.syncs] == [("item", 1)]


def test_the_trace_package_is_small_modules_of_one_concept_each() -> None:
    package = Path(str(records_module.__file__)).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert {"records.py", "dispatch.py", "entries.py", "where.py", "report.py"} <= set(sizes)
    assert "core.py" not in sizes
    assert max(sizes.values()) <= 300, sizes
