"""A GPU's PCIe link from NVML (through a fake pynvml module): matched by UUID or bus id, never
by index, its per-direction peak, and None instead of an error whenever NVML cannot tell."""

from __future__ import annotations

import types
from typing import Any

import pytest

from gpukit.devices import nvml as _nvml
from gpukit.devices.nvml import PcieLink, pcie_link
from tests.fakes import NVMLError, NVMLError_LibraryNotFound, fake_pynvml, install_pynvml


def with_links(module: types.ModuleType) -> types.ModuleType:
    """Add the link queries to a fake pynvml: each GPU dict's "link" is (gen, max gen, width,
    max width), a missing entry an unsupported query."""
    m: Any = module

    def query(position: int) -> Any:
        def read(h: dict[str, Any]) -> int:
            if "link" not in h or h["link"][position] is None:
                raise NVMLError("Not Supported")
            return int(h["link"][position])

        return read

    m.nvmlDeviceGetCurrPcieLinkGeneration = query(0)
    m.nvmlDeviceGetMaxPcieLinkGeneration = query(1)
    m.nvmlDeviceGetCurrPcieLinkWidth = query(2)
    m.nvmlDeviceGetMaxPcieLinkWidth = query(3)
    return module


GPUS = [
    {"name": "NVIDIA A100", "uuid": "GPU-a", "bus": "00000000:3B:00.0", "link": (4, 4, 16, 16)},
    {"name": "NVIDIA H100", "uuid": "GPU-b", "bus": "00000000:86:00.0", "link": (1, 5, 16, 16)},
    {"name": "NVIDIA L4", "uuid": "GPU-c", "bus": "00000000:AF:00.0"},
]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    install_pynvml(monkeypatch, with_links(fake_pynvml(GPUS)))


def test_a_gpu_is_found_by_uuid_whatever_its_nvml_index(machine: None) -> None:
    assert pcie_link("GPU-b") == PcieLink(1, 5, 16, 16)
    assert pcie_link("GPU-a") == PcieLink(4, 4, 16, 16)


def test_a_gpu_is_found_by_bus_id_in_either_spelling(machine: None) -> None:
    assert pcie_link("0000:86:00.0") == PcieLink(1, 5, 16, 16)
    assert pcie_link("00000000:3b:00.0") == PcieLink(4, 4, 16, 16)


def test_an_unknown_gpu_or_an_unknown_link_is_none(machine: None) -> None:
    assert pcie_link("GPU-zzz") is None
    assert pcie_link("0000:01:00.0") is None
    assert pcie_link("GPU-c") is None  # NVML supports none of the link queries there
    assert pcie_link("not an id") is None


def test_without_nvml_there_is_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    install_pynvml(monkeypatch, None)
    assert pcie_link("GPU-a") is None
    error = NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    install_pynvml(monkeypatch, with_links(fake_pynvml(GPUS, init_error=error)))
    assert pcie_link("GPU-a") is None


def test_nvml_failing_midway_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    module = with_links(fake_pynvml(GPUS))

    def lost(_: int) -> None:
        raise NVMLError("GPU is lost")

    module.nvmlDeviceGetCount = lost  # type: ignore[attr-defined]
    install_pynvml(monkeypatch, module)
    assert pcie_link("GPU-a") is None


def test_the_peak_is_lanes_times_the_lane_rate_at_the_best_generation() -> None:
    assert PcieLink(1, 5, 16, 16).peak_bps() == pytest.approx(16 * 3.938e9)  # idle at gen1
    assert PcieLink(3, 3, 8, 16).peak_bps() == pytest.approx(16 * 0.985e9)
    assert PcieLink(4, None, 16, None).peak_bps() == pytest.approx(16 * 1.969e9)
    assert PcieLink(None, None, 16, 16).peak_bps() is None
    assert PcieLink(9, 9, 16, 16).peak_bps() is None  # a generation we know no rate of
    assert set(_nvml.PCIE_LANE_GBPS) >= {3, 4, 5, 6}


def test_describe_says_the_best_link_and_where_it_idles_below_it() -> None:
    assert PcieLink(4, 4, 16, 16).describe() == "PCIe gen4 x16"
    assert PcieLink(1, 5, 16, 16).describe() == "PCIe gen5 x16 (now gen1 x16)"
    assert PcieLink(4, None, 16, None).describe() == "PCIe gen4 x16"
