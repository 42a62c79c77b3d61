"""Shared fixtures: a clean environment for every test, and a machine with pretend GPUs; and
the guard that keeps `make test-fast` honest: a test that starts a process must say so."""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing.process
import os
import platform
import shutil
import subprocess
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from gpukit.devices import hw as _hw
from gpukit.launch import warm_client
from tests import warm_gpukit

GiB = 1024**3

PROCESS_GUARD_MESSAGE = "this test starts a process: mark it @pytest.mark.processes"

# The standard library asks `uname -p` once per process, on the first platform.processor() or
# platform.platform() (gpukit's environment report, MLflow's run tags). Asked here, before any
# test runs, so that whichever test comes first in a worker is not the one to start it.
platform.platform()
platform.processor()


class ProcessGuard:
    """Fails a test not marked ``processes`` that starts a process (a subprocess, a fork, a
    spawned rank, a DataLoader worker): `make test-fast` leaves out only the marked tests, so
    an unmarked one that starts processes would slow the fast lane down unseen.

    The process-starting calls are wrapped once per session. While an unmarked test runs (its
    fixtures' setup and teardown included) they raise pytest's failure, which ``except
    Exception`` does not swallow; a test that passes all the same (the call was made on a
    thread of its own, or caught) is reported failed."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.armed = False
        self.started: list[str] = []
        self._wrap(subprocess.Popen, "__init__", "a subprocess")
        self._wrap(multiprocessing.process.BaseProcess, "start", "a multiprocessing process")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                self._wrap(os, name, f"os.{name}")
        # A rank forked by the warm-start server is started by this process all the same.
        self._wrap(warm_client, "start_rank", "a rank, forked by the warm-start server")

    def _wrap(self, owner: object, name: str, what: str) -> None:
        original: Callable[..., object] = getattr(owner, name)
        guard = self

        def guarded(*args: object, **kwargs: object) -> object:
            if guard.armed and os.getpid() == guard.pid:
                guard.started.append(what)
                pytest.fail(f"{PROCESS_GUARD_MESSAGE} (it started {what})")
            return original(*args, **kwargs)

        # Under the original's name, so that pickles naming it (os.system) still resolve.
        functools.update_wrapper(guarded, original)
        if isinstance(owner, types.ModuleType):
            guarded.__module__ = owner.__name__
        setattr(owner, name, guarded)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        self.pid = os.getpid()
        self.started = []
        self.armed = item.get_closest_marker("processes") is None
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        try:
            return (yield)
        finally:
            self.armed = False

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Iterator[pytest.TestReport]:
        report: pytest.TestReport = yield
        if self.started:
            if report.passed:
                report.outcome = "failed"
                report.longrepr = f"{PROCESS_GUARD_MESSAGE} (it started {self.started[0]})"
            self.started = []
        return report


# What the commands tests run import beyond torch and gpukit's launcher: `gpukit train` and the
# benchmarks draw their plots with pyplot (half a second of CPU per process), and the ranks of
# the Hugging Face tests build transformers' models (1.4 s per rank; where it is installed).
WARM_PRELOAD = ("matplotlib.pyplot",) + (
    (
        "transformers.models.auto.modeling_auto",
        "transformers.models.gpt2.modeling_gpt2",
        "transformers.models.llama.modeling_llama",
    )
    if importlib.util.find_spec("transformers") is not None
    else ()
)


class WarmStart:
    """One warm-start server per test process (each pytest-xdist worker), exported as
    ``GPUKIT_WARM_START`` for every test: the ranks that launchers start, in this process or in
    the ``gpukit launch`` and ``gpukit train`` processes tests start, are forked from it rather
    than importing torch afresh (seconds each). Started as the session starts, so that it warms
    while the tests are collected; kept only when some of them start processes, and ready
    before any runs (the process guard is not armed yet). Tests marked ``cold_start`` run
    without it.

    On by default; ``--cold-start`` turns it off for a whole run. A forked rank is not a fresh
    interpreter in every respect (its parent is the server; variables that glibc, Python and
    torch read at start come from the server's environment; its peak resident memory starts
    from the server's pages): tests that check those are marked ``cold_start``, and so is at
    least one test of each way ranks start (``gpukit launch``, ``gpukit train --devices N``,
    ``rt.launch``), so the cold path a user gets by default keeps real multi-process tests.
    Measured on tests/checkpoint/test_fsdp_checkpoint.py (13 tests, 16 ranks): each rank
    costs 3.1 s of CPU forked against 5.3 s started cold, and the file ran in 207 s against
    355 s on the same loaded machine.
    """

    def __init__(self) -> None:
        self.server: subprocess.Popen[bytes] | None = None
        self.folder: str | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # Started before collection, the server imports torch while this process collects the
        # tests (seconds each, side by side rather than one after the other); whether a test
        # needs it is known only once they are collected. Not on pytest-xdist's controller,
        # which collects nothing, nor where the marks asked for leave out every test that
        # starts processes (`make test-fast`).
        config = session.config
        controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(
            config, "workerinput"
        )
        if not controller and _may_select(config, "processes"):
            self._spawn()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not any(item.get_closest_marker("processes") for item in session.items):
            self._stop()
            return
        self._spawn()
        if self.server is None or self.folder is None:  # the caller's, in GPUKIT_WARM_START
            return
        path = os.path.join(self.folder, "socket")
        warm_client.wait_for_server(self.server, path)
        os.environ["GPUKIT_WARM_START"] = path

    def _spawn(self) -> None:
        if self.server is not None or os.environ.get("GPUKIT_WARM_START"):
            return
        # A short path: a Unix socket's path holds about 100 bytes.
        self.folder = tempfile.mkdtemp(prefix="gpukit-warm-")
        path = os.path.join(self.folder, "socket")
        self.server = warm_client.spawn_server(path, preload=WARM_PRELOAD)

    def _stop(self) -> None:
        if self.server is not None:
            os.environ.pop("GPUKIT_WARM_START", None)
            self.server.terminate()
            self.server.wait(timeout=30)
            self.server = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def pytest_sessionfinish(self) -> None:
        self._stop()


def _may_select(config: pytest.Config, mark: str) -> bool:
    """Whether ``-m`` may select a test marked ``mark`` (and nothing else): False only where
    the expression surely leaves every such test out."""
    expression = config.option.markexpr
    if not expression:
        return True
    try:  # pytest's own parser of -m expressions (pytest is pinned in pyproject.toml)
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expression).evaluate(lambda name, **_: name == mark))
    except Exception:
        return True


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cold-start",
        action="store_true",
        help="start every launched rank as a fresh interpreter (no warm-start server, see "
        "WarmStart)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # A plugin rather than this conftest's own hooks: those would not see the doctests in src/.
    if not config.pluginmanager.has_plugin("gpukit-process-guard"):
        config.pluginmanager.register(ProcessGuard(), "gpukit-process-guard")
    warm = not config.getoption("cold_start")
    if warm and not config.pluginmanager.has_plugin("gpukit-warm-start"):
        config.pluginmanager.register(WarmStart(), "gpukit-warm-start")


# Tests of an xdist_group that pytest-xdist could not keep on one worker (see below).
UNGROUPED: set[str] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a worker of ``--dist loadgroup``, a test of an ``xdist_group`` without its group
    suffix would run beside the group's other tests on the other worker (timing tests side by
    side, shared session results made twice): such tests fail, saying why."""
    if getattr(session.config.option, "loadgroup", False):
        for item in session.items:
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
                UNGROUPED.add(item.nodeid)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in UNGROUPED:
        pytest.fail(
            f"pytest-xdist's groups did not take with pytest {pytest.__version__} (this test "
            "has no @group suffix, so --dist loadgroup would not keep its group on one "
            "worker): install the pytest that pyproject.toml pins",
            pytrace=False,
        )


# The examples in src/ that start processes (a docstring cannot carry a mark).
DOCTESTS_THAT_START_PROCESSES = {
    "gpukit.launch.job.run_job",
    "gpukit.launch.starters",
    "gpukit.launch.workers",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in DOCTESTS_THAT_START_PROCESSES:
            item.add_marker(pytest.mark.processes)
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here"))
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; torch sees {count}"))


CLUSTER_VARIABLES = ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX")


@pytest.fixture(autouse=True)
def clean_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tests start with none of the variables that steer device choice, describe a cluster
    job or set the width of printed text (restored after), and keep what gpukit remembers
    about the machine out of the user's own cache folder."""
    for name in ("GPUKIT_DEVICE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)  # printed text is laid out the same anywhere
    # Tests run inside a Slurm job or a Kubernetes pod too: gpukit launch would read its nodes.
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_")) or name in CLUSTER_VARIABLES:
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gpukit-cache"))


@pytest.fixture(autouse=True)
def cold_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests marked ``cold_start`` start their ranks and commands as fresh interpreters: what
    they check (ranks that die with their launcher by ``PR_SET_PDEATHSIG``, the pid of the
    process they started) is the cold start's own. Other tests that start processes have
    their ``python -m gpukit ...`` commands forked by the warm-start server too
    (tests/warm_gpukit.py); a command passed ``executable=`` starts cold, for a test that
    needs one process cold and the rest warm."""
    if request.node.get_closest_marker("cold_start") is not None:
        monkeypatch.delenv("GPUKIT_WARM_START", raising=False)
        return
    server = os.environ.get("GPUKIT_WARM_START")
    if server is None or request.node.get_closest_marker("processes") is None:
        return
    # The command lines a test starts (`python -m gpukit ...`) are forked warm too.
    start = subprocess.Popen.__init__

    def warm_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if isinstance(args, list) and not kwargs.get("shell") and "executable" not in kwargs:
            args = warm_gpukit.command([os.fspath(a) for a in args], server) or args
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", warm_popen)


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    """A test that fails before ``rt.teardown`` must not leave its in-process group (a world
    of one) behind: the next test's mesh or launch would find a world of the wrong size."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@dataclass
class FakeCuda:
    """The pretend CUDA machine: which device is current, as a stack of scopes."""

    props: list[_hw.CudaProperties]
    current: list[int] = field(default_factory=lambda: [0])
    broken: dict[int, str] = field(default_factory=dict)  # index -> CUDA's error on start

    def properties(self, index: int) -> _hw.CudaProperties:
        if index in self.broken:
            raise RuntimeError(self.broken[index])
        return self.props[index]


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Call ``fake_gpus(n)`` to make gpukit believe torch is a CUDA build seeing n GPUs;
    set ``fake.broken[i] = message`` to make CUDA fail to start on GPU i."""

    def install(
        n: int = 2, name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0)
    ) -> FakeCuda:
        fake = FakeCuda(
            [_hw.CudaProperties(name, 80 * GiB, capability, f"GPU-{i:08d}") for i in range(n)]
        )

        @contextmanager
        def scope(index: int) -> Iterator[None]:
            fake.current.append(index)
            try:
                yield
            finally:
                fake.current.pop()

        monkeypatch.setattr(_hw, "torch_build", lambda: "cuda")
        monkeypatch.setattr(_hw, "cuda_count", lambda: n)
        monkeypatch.setattr(_hw, "cuda_properties", fake.properties)
        monkeypatch.setattr(_hw, "cuda_current", lambda: fake.current[-1])
        monkeypatch.setattr(_hw, "cuda_device_scope", scope)
        return fake

    return install


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make gpukit believe torch is a CPU-only build, whatever this machine has."""
    monkeypatch.setattr(_hw, "torch_build", lambda: "cpu")
    monkeypatch.setattr(_hw, "cuda_count", lambda: 0)
    monkeypatch.setattr(_hw, "mps_built", lambda: False)
    monkeypatch.setattr(_hw, "mps_available", lambda: False)
