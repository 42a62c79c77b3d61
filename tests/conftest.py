"""Shared fixtures: a clean environment for every test, and a machine with pretend GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

from gpukit.devices import hw as _hw

GiB = 1024**3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here"))
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; torch sees {count}"))


@pytest.fixture(autouse=True)
def clean_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tests start with none of the variables that steer device choice (restored after), and
    keep what gpukit remembers about the machine out of the user's own cache folder."""
    for name in ("GPUKIT_DEVICE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gpukit-cache"))


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
