"""A logger whose files the disk refuses stops the run with one LoggerWriteError: a
LoggerError naming the logger, and an OutputWriteError naming the file, the errno and the fix
(not restarted: a restart would meet the same disk). Root
ignores chmod, so the refusals are a file where the logger's folder should be (ENOTDIR) and a
folder where its file goes (EISDIR)."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.loggers import CsvLogger

pytest.importorskip("tensorboard")


def test_a_third_party_writers_oserror_is_one_output_write_error(tmp_path: Path) -> None:
    from gpukit.loggers import TensorBoardLogger

    (tmp_path / "file").write_text("not a folder")
    folder = tmp_path / "file" / "tb"
    rt = gk.Runtime(devices="cpu", loggers=[TensorBoardLogger(folder)])
    caught: gk.LoggerWriteError | None = None
    try:
        rt.log_metrics(val_loss=0.5)
    except gk.LoggerWriteError as err:
        caught = err
        rt.teardown()  # as a `finally:` does: the logger's failing finalize is only logged
    assert caught is not None
    text = str(caught)
    assert text.startswith("logger tensorboard failed in log_metrics at step 0: NotADirectory")
    assert f"could not write {folder}: a file stands where a folder should be (ENOTDIR)" in text
    assert "Fix: move that file away" in text and caught.errno == errno.ENOTDIR
    assert caught.path == str(folder)
    # Both: the logger's failure, and a write the disk refused (not restarted).
    assert isinstance(caught, gk.LoggerError) and isinstance(caught, gk.OutputWriteError)
    assert caught.will_repeat


def test_csv_loggers_params_meeting_a_folder_leave_its_files_whole(tmp_path: Path) -> None:
    log = CsvLogger(tmp_path)
    rt = gk.Runtime(devices="cpu", loggers=[log])
    rt.log_metrics(loss=0.5)
    before = log.path.read_text()
    (tmp_path / "hyperparams.json").unlink(missing_ok=True)
    (tmp_path / "hyperparams.json").mkdir()  # the next merge is renamed onto a folder
    with pytest.raises(gk.OutputWriteError, match=r"hyperparams.json: a folder stands where"):
        log.log_hyperparams({"lr": 0.1})
    assert log.path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyperparams.json", "metrics.csv"]
    rt.teardown()


_FILLED = textwrap.dedent(
    """
    import resource, sys
    import gpukit as gk
    from gpukit.loggers import MLflowLogger, TensorBoardLogger
    for logger in (TensorBoardLogger(sys.argv[1]), MLflowLogger(sys.argv[2])):
        rt = gk.Runtime(devices="cpu", loggers=[logger])
        rt.log_metrics(loss=1.0)  # the files exist, then each file may grow to 4 kB only
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            for step in range(1, 2000):
                rt.log_metrics(loss=1.0 / step)
            print("never refused")
        except gk.LoggerWriteError as err:
            print(err.errno, err.path)
            print(err)
        rt.teardown()
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    """
)


@pytest.mark.processes
def test_a_full_file_mid_run_stops_tensorboards_and_mlflows_writes_as_one_error(
    tmp_path: Path,
) -> None:
    """TensorBoard writes in a thread of its own: its refusal comes back at the next record's
    flush. MLflow's file store appends in the caller's thread. Both are one LoggerWriteError
    with the errno (EFBIG, the size limit) and the file the library named."""
    pytest.importorskip("mlflow")
    tb, ml = tmp_path / "tb", tmp_path / "mlruns"
    done = subprocess.run(
        [sys.executable, "-c", _FILLED, str(tb), str(ml)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "never refused" not in lines, done.stdout
    said = [(lines[i], lines[i + 1]) for i in range(0, len(lines), 2)]
    assert len(said) == 2, done.stdout
    for (head, text), name, folder in zip(said, ("tensorboard", "mlflow"), (tb, ml), strict=True):
        code, path = head.split(" ", 1)
        assert int(code) == errno.EFBIG, done.stdout
        assert path.startswith(str(folder)), done.stdout
        assert text.startswith(f"logger {name} failed in log_metrics at step "), text
        assert "the largest size allowed: this process may write files of 4 KiB at most" in text
        assert "Fix: raise the limit (ulimit -f unlimited)" in text
