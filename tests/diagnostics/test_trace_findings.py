"""What the trace finds and what it advises: attributed to the user's own line (never a
library's), host work kept out of the syncs, and a fix that fits each kind of finding."""

from __future__ import annotations

import importlib
import io
import linecache
import statistics
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gpukit.diagnostics.trace import Sync, Transfer, trace
from gpukit.diagnostics.trace.records import Recorder
from gpukit.diagnostics.trace.report import render

records_module = importlib.import_module("gpukit.diagnostics.trace.records")


def line_of(sync: Sync) -> str:
    return linecache.getline(sync.file, sync.line)


@pytest.fixture
def fake_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A package installed in a ``site-packages`` folder of its own, that reads tensors the way
    a trainer's logging or metrics code does; imported fresh, forgotten after the test."""
    package = tmp_path / "site-packages" / "fakelib_for_trace"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import threading

            from gpukit.diagnostics.trace import trace


            def log_scalar(value):
                return float(value.item())


            def log_text(value):
                return f"{value}"


            def traced_in_a_thread(value, found):
                def work():
                    with trace() as t:
                        value.item()
                    found.append(t)

                thread = threading.Thread(target=work)
                thread.start()
                thread.join(10)
            """
        )
    )
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "fakelib_for_trace", raising=False)
    module = importlib.import_module("fakelib_for_trace")
    yield module
    sys.modules.pop("fakelib_for_trace", None)


def test_a_site_packages_library_is_skipped_for_the_line_that_called_it(fake_library) -> None:  # type: ignore[no-untyped-def]
    loss = torch.ones(3).sum()
    with trace() as t:
        fake_library.log_scalar(loss)
        fake_library.log_text(loss)
    assert [(s.op, s.count, s.file) for s in t.syncs] == [
        ("item", 1, __file__),
        ("print", 1, __file__),
    ]
    assert "fake_library.log_scalar(loss)" in line_of(t.syncs[0])
    assert "fake_library.log_text(loss)" in line_of(t.syncs[1])
    assert "site-packages" not in t.report()


def test_no_frame_of_the_users_code_is_never_a_library_line(fake_library) -> None:  # type: ignore[no-untyped-def]
    found: list = []  # type: ignore[type-arg]
    fake_library.traced_in_a_thread(torch.ones(1), found)
    (t,) = found
    # threading (the standard library) and the library itself: nothing the user could change.
    assert [(s.op, s.file, s.line) for s in t.syncs] == [("item", "<no frame of your code>", 0)]


def test_the_standard_library_is_skipped() -> None:
    values = [torch.tensor(3.0), torch.tensor(1.0), torch.tensor(2.0)]
    with trace() as t:
        middle = statistics.median(values)  # sorts: bool(a < b) inside statistics.py
    assert middle == 2.0
    assert {s.op for s in t.syncs} == {"bool"}
    assert {s.file for s in t.syncs} == {__file__}
    assert "statistics.median(values)" in line_of(t.syncs[0])


def test_numpy_memmap_indexed_with_a_cpu_tensor_is_host_work(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    with trace() as t:
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - 8, (12,), generator=torch.Generator().manual_seed(0))
        x = torch.stack([torch.from_numpy(data[i : i + 8].astype(np.int64)) for i in ix])
        rows = [list(range(1000))[i] for i in ix]  # a Python list, indexed the same way
        loss = x.float().mean()
        loss.item()  # @item
    assert x.shape == (12, 8) and rows == x[:, 0].tolist()
    # The reads of the offsets are host work on any run (on a GPU run ix is on the CPU too);
    # the loss is a potential sync, at the line that reads it.
    (sync,) = t.syncs
    assert (sync.op, sync.count, sync.file, sync.synchronised) == ("item", 1, __file__, False)
    assert "# @item" in line_of(sync)
    assert "memmap.py" not in t.report() and "Python index" not in t.report()


def test_numpy_reading_a_tensor_is_attributed_to_the_users_line() -> None:
    with trace() as t:
        np.asarray(torch.ones(3))  # torch's __array__ calls .numpy()
    (sync,) = t.syncs
    assert (sync.op, sync.file) == ("numpy", __file__) and "np.asarray" in line_of(sync)


@pytest.fixture
def meta_is_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta device stands in for a GPU: ops on it make the run an accelerator's."""
    monkeypatch.setattr(records_module, "_HOST_DEVICE_TYPES", frozenset({"cpu"}))


@pytest.mark.usefixtures("meta_is_an_accelerator")
def test_on_an_accelerator_run_reads_of_cpu_tensors_are_not_syncs(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    with trace() as t:
        weight = torch.ones(4, device="meta") * 2  # the model's work, on the accelerator
        for i in torch.randint(90, (3,)):
            data[i : i + 4]
        loss = torch.ones(3).sum()  # a CPU tensor that never was on the accelerator
        loss.item()
        print(loss, file=io.StringIO())
    assert weight.device.type == "meta" and t.ops_per_device["meta"] >= 1
    assert t.syncs == []
    assert "rt.log" not in t.report()


@pytest.mark.usefixtures("meta_is_an_accelerator")
def test_a_device_tensor_used_as_a_python_index_is_one_index_sync() -> None:
    r = Recorder()
    r.record_sync("index", torch.device("meta"), host_work=True)
    r.record_sync("index", torch.device("cpu"), host_work=True)  # host work: not counted
    (sync,) = r.syncs
    assert (sync.op, sync.count, sync.device, sync.synchronised) == ("index", 1, "meta", True)
    assert "index with a Python int" in render(r.ops_per_device, r.transfers, r.syncs)


def test_the_index_wrapper_counts_one_read_per_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every device counts as one whose reads wait, so the CPU tensor takes the device path.
    monkeypatch.setattr(records_module, "_HOST_DEVICE_TYPES", frozenset())
    with trace() as t:
        ["a", "b", "c"][torch.tensor(1)]
        range(torch.tensor(2))
    assert [(s.op, s.count, s.synchronised) for s in t.syncs] == [
        ("index", 1, True),
        ("index", 1, True),
    ]  # not also the item() numpy and Python's index protocol do inside


SYNC_FIXES = {  # op -> words its fix must have, and words it must not
    "item": ("rt.log", "Python int"),
    "float": ("rt.log", "precomputed"),
    "int": ("Python ints", "precomputed"),
    "index": ("index with a Python int", "rt.log"),
    "tolist": ("every N steps, in one batch", "Python int"),
    "numpy": ("convert once", "rt.log"),
    "print": ("log less often", "Python int"),
    "bool": ("decide on the device", "rt.log"),
    "equal": ("decide on the device", "rt.log"),
    "allclose": ("decide on the device", "rt.log"),
    "synchronize": ("CUDA Events", "rt.log"),
    "nonzero": ("nonzero_static", "rt.log"),
    "mask-index": ("index with a precomputed index", "rt.log"),
    "unique": ("once outside the loop", "rt.log"),
    "repeat_interleave": ("output_size=", "rt.log"),
}


@pytest.mark.parametrize(("op", "fix"), SYNC_FIXES.items())
def test_each_kind_of_sync_gets_a_fix_that_fits_it(op: str, fix: tuple[str, str]) -> None:
    sync = Sync(op, 3, __file__, 1, "step", "cuda:0", True)
    report = render({"cuda:0": 10}, [], [sync])
    has, lacks = fix
    fix_line = next(line for line in report.splitlines() if line.strip().startswith("fix:"))
    assert has in fix_line and lacks not in fix_line, fix_line


TRANSFER_FIXES = [  # (kind, pinned, blocking) -> words its fix must have
    (("h2d", False, True), "pin host memory"),
    (("h2d", True, True), "non_blocking=True"),
    (("h2d", True, False), "move it once"),
    (("d2h", False, True), "keep results on the device"),
    (("d2h", True, False), "after an Event"),
    (("d2d", False, False), "gk.placement(model)"),
]


@pytest.mark.parametrize(("transfer", "fix"), TRANSFER_FIXES)
def test_each_kind_of_copy_gets_a_fix_that_fits_it(
    transfer: tuple[str, bool, bool], fix: str
) -> None:
    kind, pinned, blocking = transfer
    copy = Transfer(kind, 4096, 2, __file__, 1, "step", pinned, blocking, "cpu", "cuda:0")  # type: ignore[arg-type]
    assert fix in render({"cuda:0": 10}, [copy], [])


def test_a_real_trace_gives_each_finding_its_own_fix() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    with trace() as t:
        x[x > 0]
        x.sum().item()
        str(x)
    report = t.report().splitlines()
    fixes = {
        line.split(" at ")[0].split("  ", 1)[1]: report[i + 2]
        for i, line in enumerate(report)
        if line[:3].strip().rstrip(".").isdigit()
    }
    assert "precomputed index" in fixes["boolean-mask indexing x[mask] once"]
    assert "rt.log" in fixes[".item() once"]
    assert "log less often" in fixes["print/str/f-string of a tensor once"]
