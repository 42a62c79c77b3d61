"""The store of figures measured on this machine: where it lives, what it keeps per GPU, and
that a missing, broken or foreign file reads as no figures instead of failing."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from gpukit import _env
from gpukit.devices import measured
from gpukit.errors import OutputWriteError

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_prefers_gpukit_then_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUKIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _env.cache_dir() == tmp_path / "home" / ".cache" / "gpukit"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert _env.cache_dir() == tmp_path / "home" / ".cache" / "gpukit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _env.cache_dir() == tmp_path / "xdg" / "gpukit"
    monkeypatch.setenv("GPUKIT_CACHE_DIR", "~/mine")
    assert _env.cache_dir() == tmp_path / "home" / "mine"
    monkeypatch.setenv("GPUKIT_CACHE_DIR", "  ")  # blank: as if unset
    assert _env.cache_dir() == tmp_path / "xdg" / "gpukit"


def test_save_then_load_keeps_the_figures_with_date_and_torch(cache: Path) -> None:
    written = measured.save(H100, {"h2d_pinned_bps": 5.3e10, "d2h_latency_s": 1.2e-5})
    assert written == cache / "measured.json" == measured.path()
    kept = measured.load(H100)
    assert kept is not None
    assert kept["figures"] == {"h2d_pinned_bps": 5.3e10, "d2h_latency_s": 1.2e-5}
    assert kept["torch"] == torch.__version__ and kept["date"][:2] == "20"
    assert kept["quick"] is False
    assert measured.load(A100) is None
    data = json.loads(written.read_text())
    assert data["schema"] == measured.SCHEMA and list(data["gpus"]) == [H100]
    assert not [p for p in cache.iterdir() if p.name != "measured.json"]  # no temporary left


def test_each_gpu_model_has_its_own_entry_and_a_save_replaces_it(cache: Path) -> None:
    measured.save(H100, {"h2d_pinned_bps": 5e10})
    measured.save(A100, {"h2d_pinned_bps": 2.4e10}, quick=True)
    measured.save(H100, {"h2d_pageable_bps": 1e10})
    h100, a100 = measured.load(H100), measured.load(A100)
    assert h100 is not None and h100["figures"] == {"h2d_pageable_bps": 1e10}
    assert a100 is not None and a100["figures"] == {"h2d_pinned_bps": 2.4e10} and a100["quick"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"schema": 99, "gpus": {H100: {"figures": {"h2d_pinned_bps": 1e10}}}}),
        json.dumps({"schema": 1, "gpus": [H100]}),
        json.dumps({"schema": 1, "gpus": {H100: "fast"}}),
        json.dumps({"schema": 1, "gpus": {H100: {"figures": {"h2d_pinned_bps": "fast"}}}}),
        json.dumps({"schema": 1, "gpus": {H100: {"figures": {"a": -1, "b": True, "c": 0}}}}),
    ],
)
def test_a_broken_or_foreign_store_reads_as_nothing_and_is_rewritten(
    cache: Path, content: str
) -> None:
    cache.mkdir()
    (cache / "measured.json").write_text(content)
    assert measured.load(H100) is None
    measured.save(A100, {"h2d_pinned_bps": 2e10})
    kept = measured.load(A100)
    assert kept is not None and kept["figures"] == {"h2d_pinned_bps": 2e10}


def test_load_keeps_only_positive_finite_numbers(cache: Path) -> None:
    cache.mkdir()
    figures = {
        "h2d_pinned_bps": 2e10,
        "nan": float("nan"),
        "inf": float("inf"),
        "zero": 0,
        "text": "x",
        "flag": True,
        "count": 3,
    }
    (cache / "measured.json").write_text(
        json.dumps({"schema": 1, "gpus": {H100: {"figures": figures}}})
    )
    kept = measured.load(H100)
    assert kept is not None and kept["figures"] == {"h2d_pinned_bps": 2e10, "count": 3.0}
    assert kept["date"] == "" and kept["quick"] is False


def test_a_missing_store_is_no_figures(cache: Path) -> None:
    assert measured.load(H100) is None and not cache.exists()


def test_save_raises_oserror_where_the_folder_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(OSError) as caught:  # what the callers catch
        measured.save(H100, {"h2d_pinned_bps": 1e10})
    assert isinstance(caught.value, OutputWriteError)
    message = str(caught.value)
    assert str(blocker / "cache") in message and "(ENOTDIR)" in message
    assert measured.load(H100) is None


def test_a_save_the_disk_refuses_keeps_the_previous_store_whole(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured.save(H100, {"h2d_pinned_bps": 1e10})

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(os, "write", full)
        with pytest.raises(OutputWriteError) as caught:
            measured.save(H100, {"h2d_pinned_bps": 2e10})
    message = str(caught.value)
    assert "(ENOSPC)" in message and "the previous file is still there" in message
    assert "GPUKIT_CACHE_DIR" in message  # the fix names how the folder is chosen
    kept = measured.load(H100)
    assert kept is not None and kept["figures"]["h2d_pinned_bps"] == 1e10
    assert [p.name for p in cache.iterdir()] == [measured.FILE_NAME]  # no temporary left
