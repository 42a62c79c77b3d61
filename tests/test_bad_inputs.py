"""Every bad input ends in a clear GpukitError, and nothing on disk changes because of it.

Each case runs in a folder of its own holding a few files (and a module of workloads that go
wrong in every way a user's can); the folder is snapshotted before and after (paths, sizes,
modification times and contents) and must not change. Python API cases must raise the named
:class:`~gpukit.errors.GpukitError` subclass with a message matching the pattern. Command line
cases run in this process through ``gpukit.cli.__main__.main`` and must exit 2 with at most two
lines on stderr, no traceback, and the key words of the message. Nothing here starts a process
or trains more than one step.

To add a case, add a ``pytest.param`` to the table of its kind.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import importlib
import io
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit._util import placement
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError, DeviceError, GpukitError
from gpukit.strategies import DDP, DP, DPBalanced, make_strategy
from gpukit.workloads import load_workload

WORKLOADS = "gk_bad_workloads"  # the module of broken workloads written into each folder
SYNTAX = "gk_bad_syntax"

WORKLOAD_SOURCE = """
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def data(n=64):
    return TensorDataset(torch.randn(n, 2), torch.randn(n, 1))


def fine():
    return nn.Linear(2, 1), data(), nn.MSELoss()


def raises():
    raise ValueError("the data server is down")


def wrong_type():
    return 42


def two_items():
    return nn.Linear(2, 1), data()


def not_pairs():
    return nn.Linear(2, 1), [torch.ones(2)] * 64, nn.MSELoss()


def triples():
    x = torch.ones(64, 2)
    return nn.Linear(2, 1), TensorDataset(x, x, x), nn.MSELoss()


def empty():
    return nn.Linear(2, 1), data(0), nn.MSELoss()


def no_params():
    return nn.ReLU(), data(), nn.MSELoss()


def frozen():
    model = nn.Linear(2, 1)
    model.requires_grad_(False)
    return model, data(), nn.MSELoss()


def strings():
    return nn.Linear(2, 1), [("text", 1.0)] * 64, nn.MSELoss()


def none_target():
    return nn.Linear(2, 1), [(torch.ones(2), None)] * 64, nn.MSELoss()


class Broken(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        raise KeyError(i)


def broken_items():
    return nn.Linear(2, 1), Broken(), nn.MSELoss()


def unsized():
    return nn.Linear(2, 1), iter(data()), nn.MSELoss()


def loss_not_callable():
    return nn.Linear(2, 1), data(), "mse"


class Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")


def unprintable():
    return Unprintable()


def vector_loss():
    return nn.Linear(2, 1), data(), nn.MSELoss(reduction="none")


def float_loss():
    return nn.Linear(2, 1), data(), lambda out, y: ((out - y) ** 2).mean().item()


def int_loss():
    return nn.Linear(2, 1), data(), lambda out, y: (out > y).sum()


def detached_loss():
    return nn.Linear(2, 1), data(), lambda out, y: ((out - y) ** 2).mean().detach()


def none_loss():
    return nn.Linear(2, 1), data(), lambda out, y: None


def needs_args(size):
    return fine()
"""


# -- the folder each case runs in ----------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root`` with its size, modification time and content hash."""
    found: dict[str, tuple[Any, ...]] = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        if path.is_dir():
            found[str(path.relative_to(root))] = ("dir", stat.st_mtime_ns)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns, digest)
    return found


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current folder of a case: a few files and the workload modules, no launcher
    variables, no fault injection; the snapshot after the case must equal the one before."""
    (tmp_path / "data.txt").write_text("some data\n")
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.md").write_text("# notes\n")
    (tmp_path / f"{WORKLOADS}.py").write_text(WORKLOAD_SOURCE)
    (tmp_path / f"{SYNTAX}.py").write_text("def make(:\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # importing must write nothing
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GPUKIT_FAULT",
        "GPUKIT_FAULT_OOM_ABOVE",
        "GPUKIT_COLLECTIVE_CHECK_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    importlib.invalidate_caches()
    before = snapshot(tmp_path)
    yield tmp_path
    for name in (WORKLOADS, SYNTAX):
        sys.modules.pop(name, None)
    assert snapshot(tmp_path) == before, "a refused input changed files on disk"


# -- values that misbehave -----------------------------------------------------------------------


class Unprintable:
    """Its repr raises: every message that shows it must still come out."""

    def __repr__(self) -> str:
        raise RuntimeError("repr failed")

    __str__ = __repr__


class NoLen(list):  # type: ignore[type-arg]
    """A list whose length cannot be taken."""

    def __len__(self) -> int:
        raise RuntimeError("len failed")


class NoIter(list):  # type: ignore[type-arg]
    """A list that cannot be iterated."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("iter failed")


class NoItems(Mapping[str, Any]):
    """A mapping whose values cannot be read."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("getitem failed")

    def __iter__(self) -> Iterator[str]:
        return iter(["x"])

    def __len__(self) -> int:
        return 1


class NoCompare:
    """Comparing it to anything raises, and so does its truth."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq failed")

    def __bool__(self) -> bool:
        raise RuntimeError("bool failed")

    __hash__ = None  # type: ignore[assignment]


def cyclic_list() -> list[Any]:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    return loop


def cyclic_dict() -> dict[str, Any]:
    loop: dict[str, Any] = {"x": torch.ones(1)}
    loop["self"] = loop
    return loop


def cyclic_names() -> list[Any]:
    loop: list[Any] = ["cpu"]
    loop.append(loop)
    return loop


def indirect_cycle() -> dict[str, Any]:
    outer: dict[str, Any] = {"batch": [torch.ones(1)]}
    outer["batch"].append({"back": outer})
    return outer


def tuple_cycle() -> tuple[list[Any]]:
    box: tuple[list[Any]] = ([],)
    box[0].append(box)
    return box


def deep(levels: int = 3000) -> Any:
    return functools.reduce(lambda inner, _: [inner], range(levels), torch.ones(1))


def meta_module() -> nn.Module:
    return nn.Linear(2, 2, device="meta")


def meta_uninitialisable() -> nn.Module:
    """On the meta device, with a parameter no reset_parameters() could initialise."""
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    model.register_parameter("gain", nn.Parameter(torch.ones(2, device="meta")))
    return model


def words() -> Iterator[str]:
    yield "cpu"


def setup_one(**runtime: Any) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = gk.Runtime(devices="cpu", **runtime)
    model = nn.Linear(2, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return rt, model, optimizer


def backward(make_loss: Callable[[nn.Module], Any]) -> None:
    rt, model, _ = setup_one()
    rt.backward(make_loss(model))


def train_step(make_loss: Callable[[nn.Module], Any], accumulate: int = 1) -> None:
    rt, model, optimizer = setup_one(accumulate=accumulate)
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    rt.train_step(optimizer, batch, lambda b: make_loss(model))


def vector(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(4, 2)).squeeze(1)


def as_float(model: nn.Module) -> float:
    return model(torch.ones(4, 2)).mean().item()


def as_int(model: nn.Module) -> torch.Tensor:
    return (model(torch.ones(4, 2)) > 0).sum()


def detached(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(4, 2)).mean().detach()


def without_grad(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.ones(4, 2)).mean()


def complex_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(4, 2)).mean() * torch.tensor(1j)


def on_meta(model: nn.Module) -> torch.Tensor:
    return torch.zeros((), device="meta", requires_grad=True)


def with_logits(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(torch.ones(4, 2))
    return out.mean(), out


def runtime_call(method: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: getattr(setup_one()[0], method)(*args, **kwargs)


def entered(make: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> None:
        with make():
            pass

    return run


R = gk.Runtime
MANY = ["cpu"] * 1_000_000
SECOND = datetime.timedelta(seconds=1)

# (the call, the error class, a pattern its message must match)
API_CASES = [
    # -- gk.device, gk.gpu, gk.on ----------------------------------------------------------------
    pytest.param(
        lambda: gk.device("tpu:0"), DeviceError, "TPUs are not supported", id="device-tpu"
    ),
    pytest.param(lambda: gk.device("cuda:99"), DeviceError, "cuda:99", id="device-cuda99"),
    pytest.param(lambda: gk.device("gpu:-1"), DeviceError, "negative", id="device-negative-str"),
    pytest.param(lambda: gk.device(-1), DeviceError, "negative", id="device-negative-int"),
    pytest.param(lambda: gk.device(""), DeviceError, "empty", id="device-empty"),
    pytest.param(lambda: gk.device("   "), DeviceError, "empty", id="device-whitespace"),
    pytest.param(lambda: gk.device("٢"), DeviceError, "not a device spelling", id="device-arabic"),
    pytest.param(lambda: gk.device("²"), DeviceError, "not a device spelling", id="device-super2"),
    pytest.param(lambda: gk.device("cuda:²"), DeviceError, "not a whole number", id="device-idx²"),
    pytest.param(lambda: gk.device("gpu:٣"), DeviceError, "not a whole number", id="device-idx٣"),
    pytest.param(lambda: gk.device(2**64), DeviceError, "18446744073709551616", id="device-2**64"),
    pytest.param(lambda: gk.device("1" * 40), DeviceError, "too large", id="device-huge-str"),
    pytest.param(lambda: gk.device(1.0), DeviceError, "float", id="device-float"),
    pytest.param(lambda: gk.device(float("nan")), DeviceError, "float", id="device-nan"),
    pytest.param(lambda: gk.device(float("inf")), DeviceError, "float", id="device-inf"),
    pytest.param(lambda: gk.device(True), DeviceError, "bool", id="device-bool"),
    pytest.param(lambda: gk.device(b"cpu"), DeviceError, "bytes", id="device-bytes"),
    pytest.param(lambda: gk.device(["cpu"]), DeviceError, "list", id="device-list"),
    pytest.param(lambda: gk.device({"cpu"}), DeviceError, "set", id="device-set"),
    pytest.param(lambda: gk.device(np.int64(0)), DeviceError, "int64", id="device-numpy-int"),
    pytest.param(lambda: gk.device(torch.tensor(0)), DeviceError, "Tensor", id="device-tensor"),
    pytest.param(lambda: gk.device(torch.device("meta")), DeviceError, "meta", id="device-meta"),
    pytest.param(lambda: gk.device(Unprintable()), DeviceError, "Unprintable", id="device-norepr"),
    pytest.param(lambda: gk.device(object()), DeviceError, "object", id="device-object"),
    pytest.param(lambda: gk.device("cpu:1"), DeviceError, "only one cpu", id="device-cpu1"),
    pytest.param(lambda: gk.device("mps:1"), DeviceError, "only one mps", id="device-mps1"),
    pytest.param(lambda: gk.device("xla:0"), DeviceError, "XLA", id="device-xla"),
    pytest.param(lambda: gk.device("cpu\x00"), DeviceError, "spelling", id="device-nul"),
    pytest.param(
        lambda: gk.device("/job:worker/task:1/device:GPU:0"),
        DeviceError,
        "another TensorFlow job",
        id="device-tf-other-job",
    ),
    pytest.param(lambda: gk.device(gk.Device("cpu", 3)), DeviceError, "only one", id="Device-cpu3"),
    pytest.param(lambda: gk.device("cpu", soft="yes"), DeviceError, "soft=", id="device-soft-str"),
    pytest.param(lambda: gk.device("cpu", soft=None), DeviceError, "soft=", id="device-soft-none"),
    pytest.param(lambda: gk.gpu(True), DeviceError, "GPU index", id="gpu-bool"),
    pytest.param(lambda: gk.gpu("0"), DeviceError, "GPU index", id="gpu-str"),
    pytest.param(lambda: gk.gpu(1.5), DeviceError, "GPU index", id="gpu-float"),
    pytest.param(lambda: gk.gpu(Unprintable()), DeviceError, "Unprintable", id="gpu-norepr"),
    pytest.param(lambda: gk.gpu(-1), DeviceError, "negative", id="gpu-negative"),
    pytest.param(entered(lambda: gk.on("tpu")), DeviceError, "TPU", id="on-tpu"),
    pytest.param(entered(lambda: gk.on(Unprintable())), DeviceError, "Unprintable", id="on-norepr"),
    # -- gk.to -------------------------------------------------------------------------------------
    pytest.param(
        lambda: gk.to(cyclic_list(), "cpu"), ConfigError, r"data\[1\] is data", id="to-cycle-list"
    ),
    pytest.param(
        lambda: gk.to(cyclic_dict(), "cpu"), ConfigError, r"data\.self is data", id="to-cycle-dict"
    ),
    pytest.param(
        lambda: gk.to(indirect_cycle(), "cpu"),
        ConfigError,
        r"data\.batch\[1\]\.back is data",
        id="to-cycle-indirect",
    ),
    pytest.param(lambda: gk.to(tuple_cycle(), "cpu"), ConfigError, "cycle", id="to-cycle-tuple"),
    pytest.param(lambda: gk.to(deep(), "cpu"), ConfigError, "nested too deeply", id="to-too-deep"),
    pytest.param(lambda: gk.to(words(), "cpu"), ConfigError, "generator", id="to-generator"),
    pytest.param(
        lambda: gk.to(iter([torch.ones(1)]), "cpu"), ConfigError, "list_iterator", id="to-iterator"
    ),
    pytest.param(lambda: gk.to(map(torch.ones, [1]), "cpu"), ConfigError, "map", id="to-map"),
    pytest.param(
        lambda: gk.to(torch.ones(2, device="meta"), "cpu"), DeviceError, "meta", id="to-meta-tensor"
    ),
    pytest.param(
        lambda: gk.to({"m": meta_module()}, "cpu"), DeviceError, "meta", id="to-meta-module"
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), Unprintable()),
        DeviceError,
        "Unprintable",
        id="to-device-norepr",
    ),
    pytest.param(lambda: gk.to(torch.ones(1), "tpu"), DeviceError, "TPU", id="to-device-tpu"),
    pytest.param(
        lambda: gk.to(torch.ones(1), "cpu", copy="no"), ConfigError, "copy=", id="to-copy-str"
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), "cpu", copy=None), ConfigError, "copy=", id="to-copy-none"
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), "cpu", copy=1), ConfigError, "copy=", id="to-copy-int"
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), "cpu", non_blocking="x"),
        ConfigError,
        "non_blocking=",
        id="to-non-blocking-str",
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), "cpu", non_blocking=0),
        ConfigError,
        "non_blocking=",
        id="to-non-blocking-int",
    ),
    pytest.param(
        lambda: gk.to(NoItems(), "cpu"), ConfigError, "getitem failed", id="to-mapping-raises"
    ),
    pytest.param(
        lambda: gk.to(NoIter([torch.ones(1)]), "cpu"),
        ConfigError,
        "iter failed",
        id="to-iter-raises",
    ),
    pytest.param(
        lambda: gk.to(torch.ones(1), NoCompare()), DeviceError, "NoCompare", id="to-no-eq"
    ),
    # -- gk.placement, gk.memory, gk.log_placement, gk.explain ---------------------------------
    pytest.param(lambda: gk.placement(None), ConfigError, "NoneType", id="placement-none"),
    pytest.param(lambda: gk.placement(5), ConfigError, "int", id="placement-int"),
    pytest.param(
        lambda: gk.placement(Unprintable()), ConfigError, "Unprintable", id="placement-norepr"
    ),
    pytest.param(lambda: gk.placement(words()), ConfigError, "generator", id="placement-generator"),
    pytest.param(lambda: gk.placement(cyclic_list()), ConfigError, "cycle", id="placement-cycle"),
    pytest.param(
        lambda: gk.placement(cyclic_dict()), ConfigError, "cycle", id="placement-cycle-dict"
    ),
    pytest.param(lambda: gk.placement(deep()), ConfigError, "too deeply", id="placement-deep"),
    pytest.param(lambda: gk.memory("tpu"), DeviceError, "TPU", id="memory-tpu"),
    pytest.param(
        lambda: gk.memory(NoLen(["cpu"])), ConfigError, "reading the list", id="memory-no-len"
    ),
    pytest.param(
        lambda: gk.placement(NoIter([torch.ones(1)])),
        ConfigError,
        "iter failed",
        id="placement-no-iter",
    ),
    pytest.param(
        lambda: gk.log_placement(level=NoCompare()), ConfigError, "level", id="oplog-no-eq"
    ),
    pytest.param(lambda: gk.memory(Unprintable()), ConfigError, "Unprintable", id="memory-norepr"),
    pytest.param(lambda: gk.memory([]), ConfigError, "names no device", id="memory-empty-list"),
    pytest.param(lambda: gk.memory(words()), ConfigError, "generator", id="memory-generator"),
    pytest.param(lambda: gk.memory(2.5), ConfigError, "devices=2.5", id="memory-float"),
    pytest.param(lambda: gk.memory(torch.device("meta")), DeviceError, "meta", id="memory-meta"),
    pytest.param(
        lambda: gk.memory(all_ranks=1), ConfigError, "all_ranks=1", id="memory-all-ranks-int"
    ),
    pytest.param(
        lambda: gk.memory(all_ranks=True), ConfigError, "not initialised", id="memory-all-ranks"
    ),
    pytest.param(
        lambda: gk.log_placement(level="ops"), ConfigError, "not a level", id="oplog-level"
    ),
    pytest.param(
        lambda: gk.log_placement(level=None), ConfigError, "not a level", id="oplog-level-none"
    ),
    pytest.param(
        lambda: gk.log_placement(level=Unprintable()), ConfigError, "Unprintable", id="oplog-norepr"
    ),
    pytest.param(lambda: gk.log_placement(5), ConfigError, "int", id="oplog-file-int"),
    pytest.param(lambda: gk.log_placement(b"log.txt"), ConfigError, "bytes", id="oplog-file-bytes"),
    pytest.param(lambda: gk.log_placement(io.BytesIO()), ConfigError, "BytesIO", id="oplog-binary"),
    pytest.param(lambda: gk.log_placement(model=5), ConfigError, "model=", id="oplog-model-int"),
    pytest.param(
        entered(lambda: gk.log_placement("missing/dir/log.txt")),
        ConfigError,
        "cannot be written",
        id="oplog-missing-folder",
    ),
    pytest.param(
        entered(lambda: gk.log_placement("sub")),
        ConfigError,
        "cannot be written",
        id="oplog-folder",
    ),
    pytest.param(lambda: gk.explain(None), ConfigError, "NoneType", id="explain-none"),
    pytest.param(lambda: gk.explain(5), ConfigError, "int", id="explain-int"),
    pytest.param(
        lambda: gk.explain(Unprintable()), ConfigError, "Unprintable", id="explain-norepr"
    ),
    pytest.param(
        lambda: gk.explain("oom", micro_batch=0), ConfigError, "micro_batch", id="explain-micro0"
    ),
    pytest.param(
        lambda: gk.explain("oom", micro_batch=float("nan")),
        ConfigError,
        "micro_batch",
        id="explain-micro-nan",
    ),
    pytest.param(
        lambda: gk.explain("oom", state_bytes=-1), ConfigError, "state_bytes", id="explain-bytes"
    ),
    pytest.param(
        lambda: gk.explain("oom", imbalance=0.5), ConfigError, "imbalance", id="explain-imbalance"
    ),
    pytest.param(
        lambda: gk.explain("oom", strategy=Unprintable()),
        ConfigError,
        "Unprintable",
        id="explain-strategy",
    ),
    pytest.param(
        lambda: gk.explain_error(None), ConfigError, "exception itself", id="explain-error-none"
    ),
    pytest.param(
        lambda: gk.explain_error("CUDA error"),
        ConfigError,
        "exception itself",
        id="explain-error-str",
    ),
    # -- gk.Runtime: every keyword ---------------------------------------------------------------
    pytest.param(
        lambda: R(strategy="tpu"), ConfigError, "unknown strategy 'tpu'", id="rt-strategy-name"
    ),
    pytest.param(
        lambda: R(strategy=""), ConfigError, "unknown strategy ''", id="rt-strategy-empty"
    ),
    pytest.param(lambda: R(strategy="DDP"), ConfigError, "unknown strategy", id="rt-strategy-case"),
    pytest.param(
        lambda: R(strategy=None), ConfigError, "unknown strategy None", id="rt-strategy-none"
    ),
    pytest.param(
        lambda: R(strategy=["ddp"]), ConfigError, r"\['ddp'\] \(list\)", id="rt-strategy-list"
    ),
    pytest.param(lambda: R(strategy=DDP), ConfigError, "the class", id="rt-strategy-class"),
    pytest.param(
        lambda: R(strategy=Unprintable()), ConfigError, "Unprintable", id="rt-strategy-norepr"
    ),
    pytest.param(
        lambda: R(precision="fp16"), ConfigError, "unknown precision", id="rt-precision-name"
    ),
    pytest.param(lambda: R(precision=32), ConfigError, "the string '32'", id="rt-precision-int"),
    pytest.param(
        lambda: R(precision=None), ConfigError, "unknown precision", id="rt-precision-none"
    ),
    pytest.param(lambda: R(precision=["32"]), ConfigError, "list", id="rt-precision-list"),
    pytest.param(
        lambda: R(precision=Unprintable()), ConfigError, "Unprintable", id="rt-precision-norepr"
    ),
    pytest.param(
        lambda: R(precision="16-mixed", devices="cpu"),
        ConfigError,
        "needs a CUDA GPU",
        id="rt-fp16-cpu",
    ),
    pytest.param(lambda: R(devices=0), ConfigError, "at least 1", id="rt-devices-0"),
    pytest.param(lambda: R(devices=-1), ConfigError, "at least 1", id="rt-devices-negative"),
    pytest.param(lambda: R(devices=10**9), ConfigError, "at most|or fewer", id="rt-devices-10**9"),
    pytest.param(lambda: R(devices=2**64), ConfigError, "at most|or fewer", id="rt-devices-2**64"),
    pytest.param(lambda: R(devices=True), ConfigError, "True", id="rt-devices-bool"),
    pytest.param(lambda: R(devices=b"cpu"), ConfigError, "bytes", id="rt-devices-bytes"),
    pytest.param(lambda: R(devices=[]), ConfigError, "at least one", id="rt-devices-empty-list"),
    pytest.param(
        lambda: R(devices=["cpu", None]),
        ConfigError,
        r"devices\[1\] is None",
        id="rt-devices-none-item",
    ),
    pytest.param(lambda: R(devices=MANY), ConfigError, "1000000 entries", id="rt-devices-million"),
    pytest.param(lambda: R(devices=1.5), DeviceError, "float", id="rt-devices-float"),
    pytest.param(lambda: R(devices=float("nan")), DeviceError, "float", id="rt-devices-nan"),
    pytest.param(lambda: R(devices=""), DeviceError, "empty", id="rt-devices-empty-str"),
    pytest.param(lambda: R(devices=","), DeviceError, "empty", id="rt-devices-comma"),
    pytest.param(lambda: R(devices="cpu,,cpu"), DeviceError, "empty", id="rt-devices-double-comma"),
    pytest.param(lambda: R(devices="tpu:0"), DeviceError, "TPU", id="rt-devices-tpu"),
    pytest.param(lambda: R(devices="٢"), DeviceError, "spelling", id="rt-devices-arabic"),
    pytest.param(
        lambda: R(devices=Unprintable()), DeviceError, "Unprintable", id="rt-devices-norepr"
    ),
    pytest.param(
        lambda: R(devices=[Unprintable()]), DeviceError, "Unprintable", id="rt-devices-item-norepr"
    ),
    pytest.param(lambda: R(devices=cyclic_names()), DeviceError, "list", id="rt-devices-cycle"),
    pytest.param(lambda: R(devices=words()), DeviceError, "generator", id="rt-devices-generator"),
    pytest.param(lambda: R(devices={"cpu"}), DeviceError, "set", id="rt-devices-set"),
    pytest.param(
        lambda: R(devices=NoLen(["cpu"])), ConfigError, "reading the list", id="rt-devices-no-len"
    ),
    pytest.param(
        lambda: R(devices=NoIter(["cpu"])), ConfigError, "reading the list", id="rt-devices-no-iter"
    ),
    pytest.param(lambda: R(devices=NoCompare()), DeviceError, "NoCompare", id="rt-devices-no-eq"),
    pytest.param(lambda: R(strategy=NoCompare()), ConfigError, "NoCompare", id="rt-strategy-no-eq"),
    pytest.param(
        lambda: R(precision=NoCompare()), ConfigError, "NoCompare", id="rt-precision-no-eq"
    ),
    pytest.param(lambda: R(oom=NoCompare()), ConfigError, "NoCompare", id="rt-oom-no-eq"),
    pytest.param(lambda: R(seed=NoCompare()), ConfigError, "NoCompare", id="rt-seed-no-eq"),
    pytest.param(lambda: R(clip=NoCompare()), ConfigError, "NoCompare", id="rt-clip-no-eq"),
    pytest.param(lambda: R(devices=[["cpu"]]), DeviceError, "list", id="rt-devices-nested"),
    pytest.param(
        lambda: R(strategy="single", devices=["cpu", "cpu"]),
        ConfigError,
        "one device",
        id="rt-single-two",
    ),
    pytest.param(lambda: R(accumulate=0), ConfigError, "accumulate=0", id="rt-accumulate-0"),
    pytest.param(
        lambda: R(accumulate=-1), ConfigError, "accumulate=-1", id="rt-accumulate-negative"
    ),
    pytest.param(
        lambda: R(accumulate=True), ConfigError, "accumulate=True", id="rt-accumulate-bool"
    ),
    pytest.param(
        lambda: R(accumulate=2.0), ConfigError, "accumulate=2.0", id="rt-accumulate-float"
    ),
    pytest.param(lambda: R(accumulate="2"), ConfigError, "accumulate='2'", id="rt-accumulate-str"),
    pytest.param(
        lambda: R(accumulate=None), ConfigError, "accumulate=None", id="rt-accumulate-none"
    ),
    pytest.param(lambda: R(accumulate=10**30), ConfigError, "2147483647", id="rt-accumulate-huge"),
    pytest.param(
        lambda: R(accumulate=Unprintable()), ConfigError, "Unprintable", id="rt-accumulate-norepr"
    ),
    pytest.param(lambda: R(clip=0), ConfigError, "clip=0", id="rt-clip-0"),
    pytest.param(lambda: R(clip=-1.0), ConfigError, "clip=-1", id="rt-clip-negative"),
    pytest.param(lambda: R(clip=float("nan")), ConfigError, "clip=nan", id="rt-clip-nan"),
    pytest.param(lambda: R(clip=float("inf")), ConfigError, "clip=inf", id="rt-clip-inf"),
    pytest.param(lambda: R(clip="1.0"), ConfigError, "clip='1.0'", id="rt-clip-str"),
    pytest.param(lambda: R(clip=True), ConfigError, "clip=True", id="rt-clip-bool"),
    pytest.param(lambda: R(clip=torch.tensor(1.0)), ConfigError, "Tensor", id="rt-clip-tensor"),
    pytest.param(lambda: R(clip=10**400), ConfigError, "finite", id="rt-clip-huge-int"),
    pytest.param(lambda: R(clip=Unprintable()), ConfigError, "Unprintable", id="rt-clip-norepr"),
    pytest.param(lambda: R(seed=2**64), ConfigError, r"-2\*\*63 to 2\*\*63-1", id="rt-seed-2**64"),
    pytest.param(lambda: R(seed=2**63), ConfigError, "seed=", id="rt-seed-2**63"),
    pytest.param(lambda: R(seed=-(2**63) - 1), ConfigError, "seed=", id="rt-seed-below"),
    pytest.param(lambda: R(seed=1.5), ConfigError, "seed=1.5", id="rt-seed-float"),
    pytest.param(lambda: R(seed=float("nan")), ConfigError, "seed=nan", id="rt-seed-nan"),
    pytest.param(lambda: R(seed=True), ConfigError, "seed=True", id="rt-seed-bool"),
    pytest.param(lambda: R(seed="0"), ConfigError, "seed='0'", id="rt-seed-str"),
    pytest.param(lambda: R(seed=np.int64(3)), ConfigError, "int64", id="rt-seed-numpy"),
    pytest.param(lambda: R(seed=Unprintable()), ConfigError, "Unprintable", id="rt-seed-norepr"),
    pytest.param(lambda: R(log_every=0), ConfigError, "log_every=0", id="rt-log-every-0"),
    pytest.param(lambda: R(log_every=None), ConfigError, "log_every=None", id="rt-log-every-none"),
    pytest.param(lambda: R(log_every=1.0), ConfigError, "log_every=1.0", id="rt-log-every-float"),
    pytest.param(lambda: R(log_every=2**40), ConfigError, "2147483647", id="rt-log-every-huge"),
    pytest.param(
        lambda: R(log_every=Unprintable()), ConfigError, "Unprintable", id="rt-log-every-norepr"
    ),
    pytest.param(lambda: R(oom="sometimes"), ConfigError, "oom='sometimes'", id="rt-oom-name"),
    pytest.param(lambda: R(oom=None), ConfigError, "oom=None", id="rt-oom-none"),
    pytest.param(lambda: R(oom=["raise"]), ConfigError, "list", id="rt-oom-list"),
    pytest.param(lambda: R(oom=Unprintable()), ConfigError, "Unprintable", id="rt-oom-norepr"),
    # -- strategies -----------------------------------------------------------------------------
    pytest.param(
        lambda: DDP(bucket_cap_mb=-1), ConfigError, "bucket_cap_mb=-1", id="ddp-bucket-negative"
    ),
    pytest.param(lambda: DDP(bucket_cap_mb=0), ConfigError, "bucket_cap_mb=0", id="ddp-bucket-0"),
    pytest.param(lambda: DDP(bucket_cap_mb=float("nan")), ConfigError, "nan", id="ddp-bucket-nan"),
    pytest.param(lambda: DDP(bucket_cap_mb=10**9), ConfigError, "1048576", id="ddp-bucket-huge"),
    pytest.param(lambda: DDP(bucket_cap_mb="25"), ConfigError, "'25'", id="ddp-bucket-str"),
    pytest.param(lambda: DDP(bucket_cap_mb=True), ConfigError, "True", id="ddp-bucket-bool"),
    pytest.param(lambda: DDP(timeout=5), ConfigError, "timedelta", id="ddp-timeout-int"),
    pytest.param(lambda: DDP(timeout=-SECOND), ConfigError, "positive", id="ddp-timeout-negative"),
    pytest.param(
        lambda: DDP(find_unused_parameters="yes"), ConfigError, "True or False", id="ddp-unused-str"
    ),
    pytest.param(lambda: DDP(static_graph=None), ConfigError, "static_graph", id="ddp-static-none"),
    pytest.param(lambda: DP(output_device="tpu"), ConfigError, "TPU", id="dp-output-tpu"),
    pytest.param(lambda: DP(output_device=-1), ConfigError, "position", id="dp-output-negative"),
    pytest.param(
        lambda: DP(output_device=Unprintable()), ConfigError, "Unprintable", id="dp-output-norepr"
    ),
    pytest.param(
        lambda: DPBalanced(loss_device="gpu:x"), ConfigError, "loss_device", id="dpb-loss-device"
    ),
    pytest.param(
        lambda: R(strategy=DP(output_device=5), devices=["cpu", "cpu"]),
        ConfigError,
        "not a position",
        id="dp-output-out-of-range",
    ),
    pytest.param(lambda: make_strategy([1]), ConfigError, "list", id="make-strategy-list"),
    # -- rt.setup, rt.backward, rt.train_step, rt.step, collectives, criterion --------------------
    pytest.param(runtime_call("setup", None), ConfigError, "None", id="setup-none"),
    pytest.param(runtime_call("setup", 5), ConfigError, "got 5 where", id="setup-int"),
    pytest.param(
        runtime_call("setup", Unprintable()), ConfigError, "Unprintable", id="setup-norepr"
    ),
    pytest.param(
        runtime_call("setup", nn.Linear), ConfigError, "the class Linear", id="setup-class"
    ),
    pytest.param(runtime_call("setup", lambda x: x), ConfigError, "function", id="setup-function"),
    pytest.param(
        runtime_call("setup", meta_uninitialisable()), ConfigError, "meta device", id="setup-meta"
    ),
    pytest.param(
        runtime_call("setup", torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)),
        ConfigError,
        "model comes first",
        id="setup-optimizer-first",
    ),
    pytest.param(
        lambda: backward(vector), ConfigError, r"shape \(4,\).*\.mean\(\)", id="backward-vector"
    ),
    pytest.param(
        lambda: backward(as_float), ConfigError, r"a float .*\.item\(\)", id="backward-float"
    ),
    pytest.param(
        lambda: backward(as_int), ConfigError, "int64 tensor.*floating-point", id="backward-int"
    ),
    pytest.param(
        lambda: backward(detached), ConfigError, "does not require grad", id="backward-detached"
    ),
    pytest.param(lambda: backward(without_grad), ConfigError, "no_grad", id="backward-no-grad"),
    pytest.param(lambda: backward(lambda m: None), ConfigError, "got None", id="backward-none"),
    pytest.param(lambda: backward(with_logits), ConfigError, "tensor alone", id="backward-tuple"),
    pytest.param(lambda: backward(complex_loss), ConfigError, "complex64", id="backward-complex"),
    pytest.param(lambda: backward(on_meta), ConfigError, "meta", id="backward-meta"),
    pytest.param(lambda: train_step(vector), ConfigError, "compute_loss.*mean", id="step-vector"),
    pytest.param(lambda: train_step(as_float), ConfigError, "compute_loss.*float", id="step-float"),
    pytest.param(lambda: train_step(as_int), ConfigError, "compute_loss.*int64", id="step-int"),
    pytest.param(lambda: train_step(detached), ConfigError, "require grad", id="step-detached"),
    pytest.param(lambda: train_step(lambda m: None), ConfigError, "got None", id="step-none"),
    pytest.param(
        lambda: train_step(vector, accumulate=2), ConfigError, "mean", id="step-accumulate-vector"
    ),
    pytest.param(
        lambda: train_step(as_float, accumulate=2), ConfigError, "float", id="step-accumulate-float"
    ),
    pytest.param(
        lambda: (lambda r: r[0].train_step(r[2], torch.ones(2, 2), None))(setup_one()),
        ConfigError,
        "compute_loss=None",
        id="step-loss-fn-none",
    ),
    pytest.param(
        lambda: (lambda r: r[0].train_step(None, torch.ones(2, 2), lambda b: r[1](b).mean()))(
            setup_one()
        ),
        ConfigError,
        "not a torch.optim.Optimizer",
        id="step-optimizer-none",
    ),
    pytest.param(
        lambda: (lambda r: r[0].train_step(r[2], None, lambda b: b))(setup_one()),
        ConfigError,
        "no tensor",
        id="step-batch-none",
    ),
    pytest.param(
        lambda: (lambda r: r[0].step(r[2]))(setup_one()),
        ConfigError,
        "without rt.backward",
        id="step-alone",
    ),
    pytest.param(
        runtime_call("all_reduce", 1.0, "avg"), ConfigError, "op='avg'", id="all-reduce-op"
    ),
    pytest.param(
        runtime_call("all_reduce", 1.0, None), ConfigError, "op=None", id="all-reduce-op-none"
    ),
    pytest.param(
        runtime_call("all_reduce", 1.0, ["sum"]), ConfigError, "list", id="all-reduce-op-list"
    ),
    pytest.param(
        runtime_call("all_reduce", 1.0, Unprintable()),
        ConfigError,
        "Unprintable",
        id="all-reduce-op-norepr",
    ),
    pytest.param(runtime_call("all_reduce", "x"), ConfigError, "'x'", id="all-reduce-str"),
    pytest.param(runtime_call("all_reduce", None), ConfigError, "None", id="all-reduce-none"),
    pytest.param(runtime_call("all_reduce", [1, 2]), ConfigError, "list", id="all-reduce-list"),
    pytest.param(
        runtime_call("all_reduce", 2**64, "sum"), ConfigError, "64-bit", id="all-reduce-2**64"
    ),
    pytest.param(
        runtime_call("all_reduce", torch.ones(1, device="meta")),
        ConfigError,
        "meta",
        id="all-reduce-meta",
    ),
    pytest.param(
        runtime_call("all_gather", Unprintable()),
        ConfigError,
        "Unprintable",
        id="all-gather-norepr",
    ),
    pytest.param(runtime_call("broadcast", 1, 1), ConfigError, "src=1", id="broadcast-src-1"),
    pytest.param(
        runtime_call("broadcast", torch.ones(1), -1), ConfigError, "src=-1", id="broadcast-negative"
    ),
    pytest.param(runtime_call("broadcast", 1, "0"), ConfigError, "src='0'", id="broadcast-src-str"),
    pytest.param(
        runtime_call("broadcast", 1, True), ConfigError, "src=True", id="broadcast-src-bool"
    ),
    pytest.param(runtime_call("setup_criterion", None), ConfigError, "None", id="criterion-none"),
    pytest.param(runtime_call("setup_criterion", 5), ConfigError, "5", id="criterion-int"),
    pytest.param(
        runtime_call("setup_criterion", nn.MSELoss), ConfigError, "MSELoss", id="criterion-class"
    ),
    pytest.param(
        runtime_call("setup_criterion", nn.MSELoss(), "avg"),
        ConfigError,
        "reduction='avg'",
        id="criterion-avg",
    ),
    pytest.param(
        runtime_call("setup_criterion", nn.MSELoss(), "none"),
        ConfigError,
        "reduction='none'",
        id="criterion-none-str",
    ),
    # -- load_workload ---------------------------------------------------------------------------
    pytest.param(
        runtime_call("all_reduce", 1.0, NoCompare()), ConfigError, "op=", id="all-reduce-no-eq"
    ),
    pytest.param(lambda: load_workload(None), ConfigError, "not a name", id="workload-none"),
    pytest.param(lambda: load_workload("  "), ConfigError, "not a name", id="workload-blank"),
    pytest.param(
        lambda: load_workload("resnet50"), ConfigError, "unknown workload", id="workload-unknown"
    ),
    pytest.param(
        lambda: load_workload("a:b:c"), ConfigError, "one colon", id="workload-two-colons"
    ),
    pytest.param(
        lambda: load_workload("mlp", seed=2**64), ConfigError, "seed=", id="workload-seed-huge"
    ),
    pytest.param(
        lambda: load_workload("mlp", seed=True), ConfigError, "seed=True", id="workload-seed-bool"
    ),
    pytest.param(
        lambda: load_workload(f"{WORKLOADS}:needs_args"),
        ConfigError,
        "requires size",
        id="workload-args",
    ),
    pytest.param(
        lambda: load_workload(f"{WORKLOADS}:unsized"), ConfigError, "Dataset", id="workload-unsized"
    ),
    pytest.param(
        lambda: load_workload(f"{WORKLOADS}:loss_not_callable"),
        ConfigError,
        "callable",
        id="workload-loss-str",
    ),
    pytest.param(
        lambda: load_workload(f"{WORKLOADS}:two_items"),
        ConfigError,
        "of 2 items",
        id="workload-two-items",
    ),
    # -- rt.profile ------------------------------------------------------------------------------
    pytest.param(
        lambda: gk.Runtime(devices="cpu").profile(active=0),
        ConfigError,
        "active=0.*at least 1",
        id="profile-active-0",
    ),
    pytest.param(
        lambda: gk.Runtime(devices="cpu").profile("prof", wait=-1),
        ConfigError,
        "wait=-1",
        id="profile-wait-negative",
    ),
    pytest.param(
        lambda: gk.Runtime(devices="cpu").profile("data.txt"),
        ConfigError,
        "data.txt is a file",
        id="profile-folder-is-a-file",
    ),
    pytest.param(
        lambda: gk.Runtime(devices="cpu").progress(range(2), epochs=0),
        ConfigError,
        r"rt.progress\(epochs=0\): give a whole number, 1 or more",
        id="progress-epochs-0",
    ),
    pytest.param(
        lambda: gk.Runtime(devices="cpu", checkpoints="run/ck", loggers=["csv", "csv"]),
        ConfigError,
        r"'csv' is given twice.*give each logger once",
        id="loggers-csv-twice",
    ),
    pytest.param(
        runtime_call("setup", nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters())),
        ConfigError,
        r"the optimizer SGD holds 2 parameter\(s\), and none is a parameter of a model rt.setup",
        id="setup-optimizer-of-another-model",
    ),
]


@pytest.mark.parametrize(("call", "error", "pattern"), API_CASES)
def test_a_bad_argument_raises_a_clear_error_and_writes_nothing(
    folder: Path, call: Callable[[], Any], error: type[GpukitError], pattern: str
) -> None:
    with pytest.raises(error, match=pattern) as caught:
        call()
    message = str(caught.value)
    assert message.strip() and "Traceback" not in message


# (variables to set, the call, the error class, the pattern)
ENV_CASES = [
    pytest.param({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'", id="world-size-abc"),
    pytest.param({"RANK": "5", "WORLD_SIZE": "2"}, "RANK='5'.*0..1", id="rank-beyond-world"),
    pytest.param({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'", id="rank-negative"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'", id="world-size-0"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE='-2'", id="world-size-negative"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "٢"}, "WORLD_SIZE='٢'", id="world-size-arabic"),
    pytest.param({"RANK": "²", "WORLD_SIZE": "4"}, "RANK='²'", id="rank-superscript"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "1e3"}, "WORLD_SIZE='1e3'", id="world-size-float"),
    pytest.param({"RANK": "0", "WORLD_SIZE": str(10**20)}, "WORLD_SIZE=", id="world-size-huge"),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3"}, "LOCAL_RANK='3'", id="local-rank"
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
        "LOCAL_WORLD_SIZE='4'",
        id="local-world",
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'", id="local-rank-x"
    ),
]


@pytest.mark.parametrize(("env", "pattern"), ENV_CASES)
def test_garbage_launcher_variables_name_the_variable(
    folder: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], pattern: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=pattern) as caught:
        gk.Runtime()
    assert "gpukit launch" in str(caught.value) and "Unset" in str(caught.value)


@pytest.mark.parametrize(
    ("devices", "works"),
    [
        pytest.param(["cpu", "cpu"], "devices='cpu, cpu, cpu'", id="cpu-pair"),
        pytest.param(["cpu"], "devices='cpu, cpu, cpu'", id="cpu-list"),
    ],
)
def test_too_few_devices_under_a_launcher_names_what_to_pass(
    folder: Path, monkeypatch: pytest.MonkeyPatch, devices: Any, works: str
) -> None:
    """Local rank 2 of 3 with one device: the message names the spellings that run under
    gpukit launch on a CPU (devices='cpu', or one 'cpu' per process)."""
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="local rank 2 has no device") as caught:
        gk.Runtime(devices=devices)
    assert f"devices='cpu' (every process on the CPU), or {works}" in str(caught.value)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("tpu:9", id="tpu"),
        pytest.param("??", id="garbage"),
        pytest.param("cuda:99", id="cuda99"),
    ],
)
def test_a_garbage_gpukit_device_fails_where_the_default_device_is_asked_for(
    folder: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GPUKIT_DEVICE", value)
    with pytest.raises(DeviceError, match="GPUKIT_DEVICE"):
        gk.Runtime()


# -- the command line ------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``gpukit ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as done:  # argparse's own usage errors
            code = done.code if isinstance(done.code, int) else 2
    return code, out.getvalue(), err.getvalue()


ONE_STEP = ["--max-steps", "1", "--devices", "cpu"]


def train(*args: str) -> list[str]:
    return ["train", *args, *ONE_STEP]


def user(name: str) -> list[str]:
    return train("--workload", f"{WORKLOADS}:{name}")


# (argv, extra variables, words every one of which the message holds)
CLI_CASES = [
    pytest.param(
        train("--workload", "mlp", "--seed", str(2**64)),
        {},
        ["seed=18446744073709551616", "2**63"],
        id="seed-2**64",
    ),
    pytest.param(
        train("--workload", "mlp", "--seed", str(-(2**63) - 1)),
        {},
        ["seed=", "-2**63"],
        id="seed-below",
    ),
    pytest.param(
        train("--workload", "mlp", "--accumulate", "0"), {}, ["accumulate=0"], id="accumulate-0"
    ),
    pytest.param(
        train("--workload", "mlp", "--accumulate", str(10**30)),
        {},
        ["accumulate="],
        id="accumulate-huge",
    ),
    pytest.param(
        train("--workload", "mlp", "--log-every", "0"), {}, ["log_every=0"], id="log-every-0"
    ),
    pytest.param(
        train("--workload", "mlp", "--strategy", "tpu"),
        {},
        ["unknown strategy 'tpu'"],
        id="strategy-tpu",
    ),
    pytest.param(
        train("--workload", "mlp", "--strategy", ""),
        {},
        ["unknown strategy ''"],
        id="strategy-empty",
    ),
    pytest.param(
        train("--workload", "mlp", "--precision", "fp8"),
        {},
        ["unknown precision 'fp8'"],
        id="precision-fp8",
    ),
    pytest.param(
        train("--workload", "mlp", "--precision", "16-mixed"),
        {},
        ["needs a CUDA GPU"],
        id="precision-16-cpu",
    ),
    pytest.param(
        ["train", "--workload", "mlp", "--devices", "0"], {}, ["devices=0"], id="devices-0"
    ),
    pytest.param(
        ["train", "--workload", "mlp", "--devices", str(10**9)],
        {},
        ["devices=1000000000"],
        id="devices-10**9",
    ),
    pytest.param(["train", "--workload", "mlp", "--devices", "tpu"], {}, ["TPU"], id="devices-tpu"),
    pytest.param(
        ["train", "--workload", "mlp", "--devices", "²"],
        {},
        ["'²'", "spelling"],
        id="devices-super2",
    ),
    pytest.param(
        ["train", "--workload", "mlp", "--devices", "cpu,,cpu"],
        {},
        ["empty"],
        id="devices-double-comma",
    ),
    pytest.param(
        ["train", "--workload", "mlp", "--devices", ""], {}, ["empty"], id="devices-empty"
    ),
    pytest.param(train("--workload", "mlp", "--lr", "nan"), {}, ["lr=nan"], id="lr-nan"),
    pytest.param(
        train("--workload", "mlp", "--resume"), {}, ["--resume needs --out"], id="resume-no-out"
    ),
    pytest.param(train("--workload", ""), {}, ["is not a name"], id="workload-empty"),
    pytest.param(
        train("--workload", "resnet50"), {}, ["unknown workload 'resnet50'"], id="workload-unknown"
    ),
    pytest.param(
        train("--workload", "nomodule:make"),
        {},
        ["cannot import module 'nomodule'"],
        id="workload-no-module",
    ),
    pytest.param(
        train("--workload", f"{WORKLOADS}:nope"),
        {},
        ["has no 'nope'", "fine"],
        id="workload-no-function",
    ),
    pytest.param(train("--workload", "a:b:c"), {}, ["one colon"], id="workload-colons"),
    pytest.param(
        train("--workload", f"{SYNTAX}:make"),
        {},
        [f"{SYNTAX}.py:1", "SyntaxError", "def make(:"],
        id="workload-syntax",
    ),
    pytest.param(
        user("raises"),
        {},
        ["raises() failed", "line", "ValueError: the data server is down"],
        id="workload-raises",
    ),
    pytest.param(user("wrong_type"), {}, ["returned 42 (int)"], id="workload-returns-int"),
    pytest.param(
        user("unprintable"), {}, ["<Unprintable object>"], id="workload-returns-unprintable"
    ),
    pytest.param(user("not_pairs"), {}, ["(input, target) pair"], id="workload-not-pairs"),
    pytest.param(
        user("triples"), {}, ["tuple of 3 items", "(input, target) pair"], id="workload-triples"
    ),
    pytest.param(user("empty"), {}, ["is empty"], id="workload-empty-dataset"),
    pytest.param(
        user("no_params"), {}, ["has no parameters", "nothing to train"], id="workload-no-params"
    ),
    pytest.param(user("frozen"), {}, ["all frozen"], id="workload-frozen"),
    pytest.param(user("strings"), {}, ["input is 'text' (str)"], id="workload-strings"),
    pytest.param(user("none_target"), {}, ["target is None"], id="workload-none-target"),
    pytest.param(user("broken_items"), {}, ["failed with KeyError"], id="workload-broken-items"),
    pytest.param(user("vector_loss"), {}, ["shape (32, 1)", ".mean()"], id="workload-vector-loss"),
    pytest.param(user("float_loss"), {}, ["got a float", ".item()"], id="workload-float-loss"),
    pytest.param(user("int_loss"), {}, ["int64 tensor", "floating-point"], id="workload-int-loss"),
    pytest.param(user("detached_loss"), {}, ["does not require grad"], id="workload-detached-loss"),
    pytest.param(user("none_loss"), {}, ["got None"], id="workload-none-loss"),
    pytest.param(
        train("--workload", "mlp"),
        {"WORLD_SIZE": "abc", "RANK": "0"},
        ["WORLD_SIZE='abc'", "gpukit launch"],
        id="env-world-size",
    ),
    pytest.param(
        train("--workload", "mlp"), {"WORLD_SIZE": "2", "RANK": "5"}, ["RANK='5'"], id="env-rank"
    ),
    pytest.param(
        ["train", "--workload", "mlp", "--max-steps", "1"],
        {"GPUKIT_DEVICE": "??"},
        ["GPUKIT_DEVICE='??'"],
        id="env-gpukit-device",
    ),
    pytest.param(
        train("--workload", "mlp"),
        {"GPUKIT_FAULT_OOM_ABOVE": "x"},
        ["GPUKIT_FAULT_OOM_ABOVE='x'"],
        id="env-fault-oom",
    ),
    pytest.param(
        train("--workload", "mlp"),
        {"GPUKIT_FAULT_OOM_ABOVE": "٣٠"},
        ["GPUKIT_FAULT_OOM_ABOVE='٣٠'", "U+0663", "ASCII digits"],
        id="env-fault-oom-arabic-digits",
    ),
    pytest.param(["check", "missing.py"], {}, ["'missing.py' is no such file"], id="check-missing"),
    pytest.param(["check", "sub"], {}, ["'sub' is a folder"], id="check-folder"),
    pytest.param(["check", "weights.bin"], {}, ["not Python source"], id="check-binary"),
    pytest.param(["check", "data.txt"], {}, ["data.txt:1: not valid Python"], id="check-text"),
    pytest.param(
        ["check", f"{SYNTAX}.py"], {}, [f"{SYNTAX}.py:1: not valid Python"], id="check-syntax"
    ),
    pytest.param(["devices", "tpu:9"], {}, ["TPU"], id="devices-cmd-tpu"),
    pytest.param(["devices", "٢"], {}, ["not a device spelling"], id="devices-cmd-arabic"),
    pytest.param(["devices", ""], {}, ["empty"], id="devices-cmd-empty"),
    pytest.param(["devices", "cuda:99"], {}, ["cuda:99"], id="devices-cmd-cuda99"),
    pytest.param(
        ["trace", "--steps", "0", "--workload", "mlp"], {}, ["--steps 0"], id="trace-steps-0"
    ),
    pytest.param(
        ["trace", "--workload", f"{WORKLOADS}:raises"],
        {},
        ["raises() failed"],
        id="trace-workload-raises",
    ),
    pytest.param(
        ["trace", "--workload", "nomodule:x"], {}, ["cannot import module"], id="trace-no-module"
    ),
    pytest.param(["trace", "missing.py"], {}, ["not found"], id="trace-missing-script"),
    pytest.param(
        ["trace", f"{SYNTAX}.py"], {}, ["line 1 does not compile"], id="trace-syntax-error"
    ),
    pytest.param(["trace"], {}, ["nothing to trace"], id="trace-nothing"),
    pytest.param(
        ["trace", "--profile", "prof", "--profile-window", "1,1", "--workload", "mlp"],
        {},
        ["--profile-window '1,1'", "WAIT,WARMUP,ACTIVE"],
        id="trace-profile-window-two-numbers",
    ),
    pytest.param(
        ["trace", "--profile", "data.txt", "--workload", "mlp"],
        {},
        ["--profile data.txt", "give a folder"],
        id="trace-profile-to-a-file",
    ),
    pytest.param(
        ["trace", "--profile-window", "1,1,3", "--workload", "mlp"],
        {},
        ["--profile-window 1,1,3 without --profile", "add --profile DIR"],
        id="trace-profile-window-without-profile",
    ),
    pytest.param(
        train("--workload", "mlp", "--logger", "csv,csv"),
        {},
        ["--logger 'csv,csv'", "csv given twice"],
        id="train-logger-twice",
    ),
    pytest.param(
        ["plan", "--workload", "mlp", "--precision", "16-mixed", "--target", "cpu"],
        {},
        ["precision '16-mixed' needs a CUDA GPU, but the device is cpu", "'bf16-mixed' or '32'"],
        id="plan-16-mixed-on-cpu",
    ),
    pytest.param(
        ["plan", "--workload", "mlp", "--precision", "bf16-mixed", "--target", "t4"],
        {},
        ["precision 'bf16-mixed' needs a GPU with bfloat16", "T4 has none"],
        id="plan-bf16-mixed-on-t4",
    ),
    pytest.param(["launch", "--nproc", "0", "missing.py"], {}, ["--nproc 0"], id="launch-nproc-0"),
    pytest.param(["launch", "missing.py"], {}, ["not found"], id="launch-missing-script"),
    pytest.param(["launch", "--nnodes", "0", "data.txt"], {}, ["--nnodes 0"], id="launch-nnodes-0"),
    pytest.param(["bench", "overhead", "--steps", "0"], {}, ["--steps 0"], id="bench-steps-0"),
    pytest.param(
        ["bench", "all", "--only", "nope"], {}, ["nope not an experiment"], id="bench-only"
    ),
    pytest.param(
        ["bench", "compare", "missing.json", "missing.json"],
        {},
        ["no such file"],
        id="bench-compare-missing",
    ),
    pytest.param(
        ["bench", "compare", "data.txt", "sub"],
        {},
        ["two NAME.json files"],
        id="bench-compare-mixed",
    ),
    pytest.param(
        ["bench", "matmul", "--out", "data.txt"], {}, ["a file is there"], id="bench-out-file"
    ),
]

# What argparse refuses itself: its usage text, then one line with the error.
USAGE_CASES = [
    pytest.param(
        train("--workload", "mlp", "--seed", "abc"), ["--seed", "invalid int"], id="seed-abc"
    ),
    pytest.param(
        train("--workload", "mlp", "--seed", "1.5"), ["--seed", "invalid int"], id="seed-float"
    ),
    pytest.param(
        train("--workload", "mlp", "--max-steps", "1.5"), ["--max-steps"], id="steps-float"
    ),
    pytest.param(
        train("--workload", "mlp", "--oom", "sometimes"), ["invalid choice"], id="oom-choice"
    ),
    pytest.param(
        ["launch", "--nproc", "two", "x.py"], ["--nproc", "invalid int"], id="launch-nproc-str"
    ),
    pytest.param(["doctor", "--bogus"], ["unrecognized arguments"], id="doctor-flag"),
    pytest.param(["nosuch"], ["invalid choice"], id="no-such-command"),
]


@pytest.mark.parametrize(("argv", "env", "words"), CLI_CASES)
def test_the_command_line_refuses_in_two_lines_with_exit_code_2(
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    words: list[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_cli(argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize(("argv", "words"), USAGE_CASES)
def test_usage_errors_end_in_one_line_saying_what_is_wrong(
    folder: Path, argv: list[str], words: list[str]
) -> None:
    code, _, err = run_cli(argv)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gpukit") and all(word in last for word in words), err


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param("tpu:9", ["not a device", "TPU"], id="tpu"),
        pytest.param("cuda:99", ["no GPU 99"], id="cuda99"),
        pytest.param("??", ["not a device"], id="garbage"),
    ],
)
def test_doctor_fails_a_garbage_gpukit_device(
    folder: Path, monkeypatch: pytest.MonkeyPatch, value: str, words: list[str]
) -> None:
    monkeypatch.setenv("GPUKIT_DEVICE", value)
    code, out, _ = run_cli(["doctor", "--json", "--no-alloc"])
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1
    check = checks["GPUKIT_DEVICE"]
    assert check["status"] == "FAIL" and "unset GPUKIT_DEVICE" in check["fix"]
    assert all(word in check["detail"] for word in words), check


# -- what must still be accepted ------------------------------------------------------------------

ACCEPTED = [
    pytest.param(
        lambda: R(devices=2).world_size == 2,
        id="rt-devices-2",
        marks=pytest.mark.skipif(torch.cuda.device_count() == 1, reason="one GPU: 2 is too many"),
    ),
    pytest.param(
        lambda: len(R(devices=["cpu", "cpu"]).strategy.devices) == 2, id="rt-devices-list"
    ),
    pytest.param(lambda: R(devices="cpu, cpu").world_size == 2, id="rt-devices-comma-list"),
    pytest.param(lambda: R(devices="cpu", seed=-1).seed == -1, id="rt-seed-negative"),
    pytest.param(lambda: R(devices="cpu", seed=2**63 - 1).seed == 2**63 - 1, id="rt-seed-largest"),
    pytest.param(lambda: R(devices="cpu", clip=0.5).clip == 0.5, id="rt-clip"),
    pytest.param(lambda: R(devices="cpu", clip=np.float32(1.0)).clip == 1.0, id="rt-clip-numpy"),
    pytest.param(lambda: DDP(bucket_cap_mb=0.5).bucket_cap_mb == 0.5, id="ddp-small-bucket"),
    pytest.param(lambda: gk.device(" CPU ").type == "cpu", id="device-spaces"),
    pytest.param(
        lambda: gk.to([torch.ones(1)] * 2, "cpu")[0].shape == (1,), id="to-shared-not-cycle"
    ),
    pytest.param(
        lambda: backward(lambda m: m(torch.ones(4, 2)).mean().reshape(1)) is None, id="loss-(1,)"
    ),
    pytest.param(lambda: load_workload(f"{WORKLOADS}:fine").batch_size == 32, id="workload-fine"),
    pytest.param(lambda: optimizer_with_a_loss_weight() == 3, id="setup-optimizer-extra-param"),
    pytest.param(lambda: optimizer_of_an_earlier_model() == 2, id="setup-optimizer-earlier-model"),
]


def optimizer_with_a_loss_weight() -> int:
    """An optimizer over the model and a learnable weight of the loss: accepted (one of its
    parameters is the model's); returns how many parameters it steps."""
    model, weight = nn.Linear(2, 1), nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([*model.parameters(), weight], lr=0.1)
    _, opt = R(devices="cpu").setup(model, opt)
    return sum(len(g["params"]) for g in opt.param_groups)


def optimizer_of_an_earlier_model() -> int:
    """A GAN's second setup may carry the first model's optimizer: it trains a set-up model."""
    rt, first, second = R(devices="cpu"), nn.Linear(2, 1), nn.Linear(2, 1)
    rt.setup(first)
    _, opt = rt.setup(second, torch.optim.SGD(first.parameters(), lr=0.1))
    return len(opt.param_groups[0]["params"])


@pytest.mark.parametrize("call", ACCEPTED)
def test_good_inputs_are_still_accepted(folder: Path, call: Callable[[], bool]) -> None:
    assert call()


def test_a_valid_launcher_environment_is_read(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert placement.launched() == placement.LaunchEnv(3, 4, 1, 2)
    monkeypatch.setenv("RANK", " ")  # blank is unset: no launcher
    assert placement.launched() is None


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["train", "--workload", "mlp", *ONE_STEP], id="train-mlp"),
        pytest.param(["train", "--workload", f"{WORKLOADS}:fine", *ONE_STEP], id="train-user"),
        pytest.param(
            ["train", "--workload", "mlp", "--seed", "-1", *ONE_STEP], id="train-seed-negative"
        ),
        pytest.param(["devices", "cpu"], id="devices-cpu"),
    ],
)
def test_good_command_lines_still_run(folder: Path, argv: list[str]) -> None:
    code, _, err = run_cli(argv)
    assert code == 0, err
