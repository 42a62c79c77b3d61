"""Files gpukit writes, when the disk refuses them: one OutputWriteError naming the file, the
errno and the fix, and nothing half-written. Root ignores chmod (the tests run as root in CI),
so the refusals here are real ones root meets too: a folder where the file goes (EISDIR), a
file where a folder should be (ENOTDIR), a file-size limit (RLIMIT_FSIZE: EFBIG, in a process
of its own); a full disk and a read-only file system are ``os`` calls made to fail as the
kernel would (ENOSPC after half the bytes, EROFS)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpukit as gk
from gpukit._util import files
from gpukit.errors import CheckpointWriteError, OutputWriteError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _full_after(monkeypatch: pytest.MonkeyPatch, allowed: int) -> None:
    """``os.write`` as on a disk with ``allowed`` bytes left: a short write, then ENOSPC."""
    write = os.write
    left = [allowed]

    def short(fd: int, data: bytes | memoryview) -> int:
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done = write(fd, bytes(data[: left[0]]))
        left[0] -= done
        return done

    monkeypatch.setattr(os, "write", short)


def test_a_full_disk_keeps_the_previous_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.json"
    files.write_atomic(path, json.dumps({"steps": 4}))
    _full_after(monkeypatch, 10)
    with pytest.raises(OutputWriteError) as caught:
        files.write_atomic(path, json.dumps({"steps": 8, "pad": "x" * 100}))
    text = str(caught.value)
    assert text.startswith(f"could not write {path}: the disk is full (ENOSPC)"), text
    assert "the previous file is still there, whole" in text and "Fix: free space" in text
    assert caught.value.errno == errno.ENOSPC and caught.value.path == str(path)
    assert json.loads(path.read_text()) == {"steps": 4}  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporary left


def test_a_read_only_file_system_is_named_with_its_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OutputWriteError) as caught:
        files.write_atomic(tmp_path / "config.toml", "x = 1\n")
    text = str(caught.value)
    assert "config.toml: the file system is read-only (EROFS)" in text, text
    assert "Fix: give a folder on a writable disk (--out), or remount it read-write" in text


def test_a_folder_where_the_file_goes_and_a_file_where_a_folder_should_be(
    tmp_path: Path,
) -> None:
    (tmp_path / "loss.png").mkdir()
    with pytest.raises(OutputWriteError, match=r"a folder stands where the file goes \(EISDIR\)"):
        files.write_atomic(tmp_path / "loss.png", b"png")
    assert list((tmp_path / "loss.png").iterdir()) == []
    (tmp_path / "out").write_text("a file")
    with pytest.raises(OutputWriteError, match=r"out/metrics.csv: a file stands where a folder"):
        files.append(tmp_path / "out" / "metrics.csv", "1,0.5\n")
    with pytest.raises(OutputWriteError, match=r"\(ENOTDIR\)"):
        files.make_folder(tmp_path / "out" / "checkpoints")


def test_a_failed_append_is_cut_back_to_whole_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss\n1,0.5\n")
    _full_after(monkeypatch, 3)  # "2,0" of the new line lands, then the disk is full
    with pytest.raises(OutputWriteError, match="it holds its whole lines only"):
        files.append(path, "2,0.25\n")
    assert path.read_text() == "step,loss\n1,0.5\n"


def test_another_librarys_error_is_converted_naming_its_file(tmp_path: Path) -> None:
    with pytest.raises(OutputWriteError) as caught, files.converted(tmp_path / "tb"):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "tb" / "ev"))
    assert str(caught.value).startswith(f"could not write {tmp_path / 'tb' / 'ev'}: permission")
    assert "(EACCES)" in str(caught.value) and "chmod, chown" in str(caught.value)


def test_the_error_is_a_gpukit_error_an_oserror_and_not_restarted() -> None:
    assert issubclass(OutputWriteError, gk.GpukitError) and issubclass(OutputWriteError, OSError)
    assert OutputWriteError.will_repeat and issubclass(CheckpointWriteError, OutputWriteError)
    assert gk.OutputWriteError is OutputWriteError


_LIMITED = textwrap.dedent(
    """
    import resource, sys
    from gpukit._util import files
    path = sys.argv[1]
    files.append(path, "step,loss\\n")
    resource.setrlimit(resource.RLIMIT_FSIZE, (40, 40))  # each file at most 40 bytes
    try:
        for step in range(100):
            files.append(path, f"{step},0.123456\\n")
    except OSError as err:
        print(type(err).__name__, err.errno)
        print(err)
    """
)


@pytest.mark.processes
def test_a_file_size_limit_is_efbig_and_leaves_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(path)],
        executable=sys.executable,  # this process itself, with its limit: not a warm fork
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"OutputWriteError {errno.EFBIG}" in done.stdout, done.stdout
    assert "40 B at most (ulimit -f)" in done.stdout and "(EFBIG)" in done.stdout, done.stdout
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and lines[0] == "step,loss", lines  # ends with a whole line
    assert all(line.endswith(",0.123456") for line in lines[1:-1]), lines


def test_metrics_csv_rewritten_for_a_resume_reaches_the_disk_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.train.report import MetricsCsv

    path = tmp_path / "metrics.csv"
    files.write_atomic(path, "step,loss\n2,0.5\n4,0.25\n")
    synced: list[str] = []
    fsync = os.fsync

    def noted(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", noted)
    log = MetricsCsv(path, resumed_from_step=2)  # keeps step 2, rewritten whole
    assert [os.path.basename(p) for p in synced] == [f".metrics.csv.tmp-{os.getpid()}"]
    log.update([{"step": 3.0, "loss": 0.4}])  # an append: the run's rows, not synced each
    assert len(synced) == 1
    assert path.read_text().splitlines() == ["step,loss", "2,0.5", "3,0.4"]
