"""The boundaries of a run: periodic checkpoints, injected faults, preemption, the non-finite
guard and the heartbeat, in one process (the launcher's side is tested with the agent).

Each feature's per-step cost is counted with gk.trace(): none adds a read per step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.checkpoint import has_checkpoints
from gpukit.errors import ConfigError, NonFiniteError, Preempted
from gpukit.launch import heartbeat
from gpukit.launch.faults import FaultPlan, parse_faults
from gpukit.lifecycle.checks import parse_save_every
from gpukit.lifecycle.preemption import SECOND_SIGNAL_AFTER_S
from gpukit.runtime.step.nonfinite import MAX_SKIPS_IN_A_ROW, NonFiniteGuard
from tests import warm_gpukit

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def _train(rt: gk.Runtime, steps: int, fused: bool = False) -> nn.Module:
    """``steps`` steps over a loader (a resumed run skips the batches it has seen)."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    batches = _batches(steps)
    data = DataLoader(
        TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])),
        batch_size=8,
    )
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=fused or None)
    model, opt, loader = rt.setup(net, opt, data)
    mse = nn.functional.mse_loss
    for batch in loader:
        loss = rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1]))
        rt.log(loss=loss)
    return net


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (4, (4, None)),
        ("4", (4, None)),
        ("10m", (None, 600.0)),
        ("90s", (None, 90.0)),
        ("1.5h", (None, 5400.0)),
        (None, (None, None)),
    ],
)
def test_save_every_reads_steps_or_time(given: Any, expected: Any) -> None:
    assert parse_save_every(given) == expected


@pytest.mark.parametrize("bad", [0, -3, "0", "10x", "m", "", "1.5", True, 2.5, "٤", "-1m", "0s"])
def test_a_bad_save_every_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="save_every"):
        parse_save_every(bad)


def test_settings_that_need_a_folder_say_so() -> None:
    with pytest.raises(ConfigError, match="needs a folder"):
        gk.Runtime(devices="cpu", save_every=4)
    with pytest.raises(ConfigError, match="needs a folder"):
        gk.Runtime(devices="cpu", resume="auto")
    with pytest.raises(ConfigError, match="resume="):
        gk.Runtime(devices="cpu", checkpoints="x", resume="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep="):
        gk.Runtime(devices="cpu", checkpoints="x", keep=0)
    with pytest.raises(ConfigError, match=r"rt\.save\(\) needs a folder"):
        gk.Runtime(devices="cpu").save()


def test_save_every_n_steps_writes_a_checkpoint_at_each_multiple(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu", checkpoints=tmp_path, save_every=3, keep=10)
    _train(rt, 10)
    rt.teardown()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000003",
        "step-00000006",
        "step-00000009",
    ]


@pytest.mark.parametrize(
    "spec",
    ["boom:0:1", "raise:0:0", "raise:a:1", "raise:0", "raise:0:1:2", "raise:0:٣", "raise:-1:2"],
)
def test_a_bad_fault_spec_is_refused(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT", spec)
    with pytest.raises(ConfigError, match="GPUKIT_FAULT"):
        gk.Runtime(devices="cpu")


def test_an_injected_raise_fires_at_its_step_on_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT", "raise:1:2,raise:0:4")
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(RuntimeError, match="raise on rank 0 at step 4"):
        _train(rt, 10)
    assert rt.global_step == 3  # steps 1..3 done; step 4 began and failed


def test_a_fault_fires_once_per_job(tmp_path: Path) -> None:
    faults = parse_faults("raise:0:2")
    first = FaultPlan(faults, rank=0, job_dir=tmp_path)
    with pytest.raises(RuntimeError):
        first.step_begins(2)
    again = FaultPlan(faults, rank=0, job_dir=tmp_path)  # a restarted attempt of the same job
    again.step_begins(2)
    other = FaultPlan(faults, rank=1, job_dir=tmp_path)
    other.step_begins(2)


def test_preemption_saves_at_the_step_and_resume_finishes_bitwise_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _train(gk.Runtime(devices="cpu", seed=0), 12)
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv("GPUKIT_FAULT", "sigterm:0:5")
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path)
    with pytest.raises(Preempted, match="SIGTERM received: stopped after step 5") as caught:
        _train(rt, 12)
    rt.teardown()
    assert caught.value.exit_code == 143
    assert (tmp_path / "step-00000005").is_dir()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers given back
    monkeypatch.delenv("GPUKIT_FAULT")
    again = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, resume="auto")
    resumed = _train(again, 12)
    again.teardown()
    assert again.global_step == 12
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _slow_program(tmp_path: Path, until: str) -> tuple[subprocess.Popen[str], int]:
    """A one-process program whose first step lasts until a file ``until`` exists in
    ``tmp_path`` (at most a minute), started, and its process id; it has said "in step" when
    this returns."""
    script = tmp_path / "slow.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time, torch, gpukit as gk
            rt = gk.Runtime(devices="cpu", checkpoints={str(tmp_path / "ck")!r})
            net = torch.nn.Linear(2, 1)
            model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            def slow(batch):
                with open({str(tmp_path / "pid")!r}, "w") as f:
                    f.write(str(os.getpid()))
                print("in step", flush=True)
                for _ in range(1200):  # Python runs between the waits, as between a
                    if os.path.exists({str(tmp_path / until)!r}):  # step's ops: its
                        break  # signal handlers run at once
                    time.sleep(0.05)
                return model(batch).sum()
            for _ in range(3):
                rt.train_step(opt, torch.ones(2, 2), slow)
            """
        )
    )
    proc = _started(script, "in step")
    return proc, int((tmp_path / "pid").read_text())


def _started(script: Path, says: str, **env: str) -> subprocess.Popen[str]:
    """``script`` running in a process of its own, once it has printed ``says``. It is forked
    by the warm-start server where tests have one (tests/conftest.py): signals sent to the
    process started here are passed on to it."""
    command = [sys.executable, str(script)]
    server = os.environ.get("GPUKIT_WARM_START")
    proc = subprocess.Popen(
        warm_gpukit.script_command(command, server) if server else command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == says
    return proc


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
def test_a_second_ctrl_c_exits_at_once(tmp_path: Path) -> None:
    proc, pid = _slow_program(tmp_path, "never")
    os.kill(pid, signal.SIGINT)  # the first waits for the step
    time.sleep(SECOND_SIGNAL_AFTER_S + 0.5)  # later than any copy of the first would come
    os.kill(pid, signal.SIGINT)  # the user's second Ctrl-C does not
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert not has_checkpoints(tmp_path / "ck")  # (the folder holds its lock)


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
def test_copies_of_the_request_never_cut_the_save_short(tmp_path: Path) -> None:
    # A scheduler signals every process, a launcher passes its own signal on, a terminal's
    # Ctrl-C reaches the whole group: one request, however many copies arrive.
    proc, pid = _slow_program(tmp_path, "sent")
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        os.kill(pid, sig)
    # The step ends once every copy was sent: a signal is pending in a process as soon as
    # kill() returns, and its handler runs before the step's next line does.
    (tmp_path / "sent").touch()
    assert proc.wait(timeout=60) == 143
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert said.count("received: stopped after step 1 on every rank") == 1, said
    assert (tmp_path / "ck" / "step-00000001").is_dir()


def test_without_a_checkpoint_folder_signals_are_left_alone() -> None:
    before = signal.getsignal(signal.SIGINT)
    rt = gk.Runtime(devices="cpu")
    assert signal.getsignal(signal.SIGINT) is before
    rt.teardown()


def _nan_at(step: int) -> Any:
    def poison(loss: torch.Tensor, at: list[int]) -> torch.Tensor:
        return loss * float("nan") if at[0] == step else loss

    return poison


def test_skip_leaves_weights_and_optimizer_state_of_a_nan_step_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUKIT_FAULT", "nan:0:3")
    rt = gk.Runtime(devices="cpu", nonfinite="skip", log_every=4)
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    model, opt = rt.setup(net, opt)
    mse = nn.functional.mse_loss
    weights = []
    for batch in _batches(6):
        rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1]))
        weights.append(net.weight.detach().clone())
    assert torch.equal(weights[1], weights[2])  # step 3 skipped
    assert not torch.equal(weights[2], weights[3])  # step 4 trained
    assert torch.isfinite(net.weight).all()
    assert int(opt.state[net.weight]["step"]) == 5
    assert rt.skipped_steps() == 1


def test_raise_names_the_step_and_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT", "nan:0:3")
    rt = gk.Runtime(devices="cpu", nonfinite="raise", log_every=2)
    with pytest.raises(NonFiniteError, match=r"step 3 hold NaN or Inf on rank 0 \(rank 0's own"):
        _train(rt, 6)
    assert rt.global_step == 4  # found at the read-back after step 4


def test_too_many_skips_in_a_row_raise() -> None:
    guard = NonFiniteGuard("skip", log_every=100)
    for step in range(1, MAX_SKIPS_IN_A_ROW + 1):
        guard.found([torch.tensor([float("inf")])])
        guard.update(step)
    with pytest.raises(NonFiniteError, match=f"{MAX_SKIPS_IN_A_ROW} steps in a row"):
        guard.read(0)


def test_skip_needs_a_fused_optimizer_and_refuses_16_mixed() -> None:
    rt = gk.Runtime(devices="cpu", nonfinite="skip")
    with pytest.raises(ConfigError, match="fused=True"):
        _train(rt, 2, fused=False)
    with pytest.raises(ConfigError, match="16-mixed"):
        NonFiniteGuard("skip", log_every=1, precision="16-mixed")
    with pytest.raises(ConfigError, match="nonfinite="):
        gk.Runtime(devices="cpu", nonfinite="ignore")  # type: ignore[arg-type]


def _reads(rt: gk.Runtime, steps: int = 20) -> int:
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True))
    mse = nn.functional.mse_loss
    batches = _batches(steps + 2)
    for batch in batches[:2]:
        rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1]))
    rt.flush_logs()
    with gk.trace() as t:
        for batch in batches[2:]:
            rt.log(loss=rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1])))
    rt.teardown()
    return sum(s.count for s in t.syncs)


def test_the_heartbeat_preemption_and_guard_add_no_read_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _reads(gk.Runtime(devices="cpu", log_every=10))
    assert plain == 2  # one per logging window
    monkeypatch.setenv("GPUKIT_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    watched = gk.Runtime(
        strategy="single", devices="cpu", log_every=10, checkpoints=tmp_path / "ck"
    )
    assert watched.lifecycle.heartbeat is not None
    assert _reads(watched) == plain
    beat = heartbeat.read(tmp_path, 0)
    assert beat is not None and beat.phase == "loop" and beat.step == 22
    # Each beat names the Runtime call and the caller's line: ranks that disagree on a
    # collective are told apart by them (see gpukit.launch.failures.diverged).
    assert re.fullmatch(r"rt\.train_step at test_lifecycle\.py:\d+", beat.where), beat.where
    assert beat.calls >= 22 * 2  # a backward and an optimizer step per step, at least
    # The guard reads its counters once per logging window, beside the metrics' flush.
    guarded = gk.Runtime(strategy="single", devices="cpu", log_every=10, nonfinite="skip")
    assert _reads(guarded) == plain * 2


def test_stopped_ranks_leave_together_rank_zero_last() -> None:
    # After the stop's save, rank 1 may exit only once rank 0 has left every collective, and
    # rank 0 only once rank 1 has answered: no rank resets its sockets under a slower peer.
    import threading

    import torch.distributed as dist

    from gpukit.lifecycle.preemption import Preemption

    store = dist.HashStore()
    order: list[str] = []
    ranks = [Preemption(r, 2, store=lambda: store, heartbeat=None) for r in (0, 1)]

    def leave(p: Preemption, delay: float) -> None:
        time.sleep(delay)
        p.leave_together()
        order.append(f"rank {p.rank} left")

    threads = [
        threading.Thread(target=leave, args=(ranks[1], 0.0)),  # the quick one waits
        threading.Thread(target=leave, args=(ranks[0], 0.3)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert set(order) == {"rank 0 left", "rank 1 left"}
    assert store.check(["gpukit/preempt/0/left/0", "gpukit/preempt/0/answered/1"])


def _tracked_run(rt: gk.Runtime, steps: int = 12) -> tuple[nn.Module, dict[str, Any]]:
    """A loop that updates its own tracked values after each step, as programs do (the best
    loss so far, a count of batches seen): a checkpoint must hold them as of its step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    batches = _batches(steps)
    data = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    model, opt, loader = rt.setup(net, opt, DataLoader(data, batch_size=8, shuffle=True))
    stats: dict[str, Any] = {"best": float("inf"), "seen": 0, "noise": 0.0}
    rt.track(stats=stats)
    mse = nn.functional.mse_loss
    for batch in loader:
        loss = rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1]))
        stats["seen"] += 1
        stats["best"] = min(stats["best"], float(loss))
        stats["noise"] += float(torch.rand(()))  # the program's own draw between steps
    return net, stats


@pytest.mark.parametrize("how", ["preempted", "periodic"])
def test_a_save_between_steps_holds_what_the_program_did_after_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    plain_net, plain_stats = _tracked_run(gk.Runtime(devices="cpu", seed=0))
    if how == "preempted":
        monkeypatch.setenv("GPUKIT_FAULT", "sigterm:0:5")
        rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path)
        with pytest.raises(Preempted):
            _tracked_run(rt)
    else:  # a crash right after the periodic save at step 5
        monkeypatch.setenv("GPUKIT_FAULT", "raise:0:6")
        rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, save_every=5)
        with pytest.raises(RuntimeError, match="raise on rank 0 at step 6"):
            _tracked_run(rt)
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    monkeypatch.delenv("GPUKIT_FAULT")
    again = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, resume="auto")
    net, stats = _tracked_run(again)
    again.teardown()
    assert stats == plain_stats
    for a, b in zip(plain_net.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
def test_a_request_with_no_step_end_to_save_at_ends_the_process_after_the_grace(
    tmp_path: Path,
) -> None:
    # The training loop is over (an evaluation runs): no step end will come to save at. The
    # process must not stay deaf to the scheduler until its SIGKILL.
    script = tmp_path / "after.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, torch, gpukit as gk
            rt = gk.Runtime(devices="cpu", checkpoints={str(tmp_path / "ck")!r}, save_every=2)
            net = torch.nn.Linear(2, 1)
            model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for _ in range(2):
                rt.train_step(opt, torch.ones(2, 2), lambda b: model(b).sum())
            print("evaluating", flush=True)
            for _ in range(1200):
                time.sleep(0.05)
            """
        )
    )
    proc = _started(script, "evaluating", GPUKIT_STOP_GRACE="1")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert "SIGTERM received 1 s ago, and no step ended since to save at" in said, said
    assert "the newest checkpoint is step 2" in said, said
