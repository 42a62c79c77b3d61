"""`--out` is checked before anything starts, and a refusal leaves the disk as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.train.outdir import check_out


def _snapshot(root: Path) -> dict[str, tuple[bool, bytes | None, int]]:
    """Every path under ``root``: whether a folder, its bytes, its mode."""
    return {
        str(p.relative_to(root)): (
            p.is_dir(),
            None if p.is_dir() else p.read_bytes(),
            p.stat().st_mode,
        )
        for p in sorted(root.rglob("*"))
    }


def _refused(root: Path, out: str, match: str, **flags: bool) -> None:
    before = _snapshot(root)
    with pytest.raises(gk.ConfigError, match=match):
        check_out(out, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    assert _snapshot(root) == before


def _with_checkpoints(out: Path) -> None:
    folder = out / "checkpoints"
    for step in (32, 64):
        (folder / f"step-{step:08d}").mkdir(parents=True)
        (folder / f"step-{step:08d}" / "state.pt").write_bytes(b"x")
    (folder / "latest").write_text("step-00000064\n")
    (out / "metrics.csv").write_text("step,loss\n")


def test_no_out_means_no_outputs() -> None:
    assert check_out(None, resume=False, overwrite=False) is None


@pytest.mark.parametrize("out", ["", "   ", "\t"])
def test_an_empty_out_is_refused(tmp_path: Path, out: str) -> None:
    _refused(tmp_path, out, r"give a folder .* or leave --out out to write no metrics")


def test_an_existing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run.txt").write_text("notes")
    _refused(tmp_path, str(tmp_path / "run.txt"), r"that is a file, not a folder")


def test_a_folder_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run.txt").write_text("notes")
    _refused(tmp_path, str(tmp_path / "run.txt" / "sub"), r"cannot write there")


def test_a_checkpoints_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("?")
    _refused(tmp_path, str(tmp_path / "run"), r"checkpoints is a file")


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere"
)
def test_a_folder_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        _refused(tmp_path, str(parent / "a" / "b"), r"cannot write there \(Permission denied")
    finally:
        parent.chmod(0o700)


def test_a_folder_where_writing_fails_is_refused_and_what_was_created_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(self: Path, data: bytes) -> int:
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", no_space)
    _refused(tmp_path, str(tmp_path / "new" / "run"), r"cannot write there \(No space left")
    assert not (tmp_path / "new").exists()


def test_a_new_folder_is_accepted_and_not_left_behind(tmp_path: Path) -> None:
    before = _snapshot(tmp_path)
    assert check_out(str(tmp_path / "a" / "b"), resume=False, overwrite=False) == Path(
        tmp_path / "a" / "b"
    )
    assert _snapshot(tmp_path) == before  # the run creates it when it writes


def test_a_folder_of_metrics_without_checkpoints_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("step,loss\n")
    assert check_out(str(tmp_path), resume=False, overwrite=False) == tmp_path


def test_a_folder_holding_checkpoints_needs_resume_or_overwrite(tmp_path: Path) -> None:
    _with_checkpoints(tmp_path / "run")
    _refused(
        tmp_path,
        str(tmp_path / "run"),
        r"already holds checkpoints up to step 64 .* add --resume to continue that run, or "
        r"--overwrite to start over \(the old checkpoints are kept, renamed to "
        r"checkpoints\.old-<date>-<time>\)",
    )
    _refused(tmp_path, str(tmp_path / "run"), "contradict", resume=True, overwrite=True)
    before = _snapshot(tmp_path)
    assert check_out(str(tmp_path / "run"), resume=True, overwrite=False) == tmp_path / "run"
    assert _snapshot(tmp_path) == before


def test_overwrite_moves_the_old_checkpoints_aside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _with_checkpoints(out)
    old = _snapshot(out / "checkpoints")
    with pytest.warns(UserWarning, match=r"moved to .*checkpoints\.old-\d{8}-\d{6}"):
        assert check_out(str(out), resume=False, overwrite=True) == out
    assert not (out / "checkpoints").exists()
    (aside,) = out.glob("checkpoints.old-*")
    assert _snapshot(aside) == old  # nothing deleted
    assert (out / "metrics.csv").exists()
    # a second overwrite in the same second gets a name of its own
    _with_checkpoints(out)
    with pytest.warns(UserWarning, match="moved to"):
        check_out(str(out), resume=False, overwrite=True)
    assert len(list(out.glob("checkpoints.old-*"))) == 2
