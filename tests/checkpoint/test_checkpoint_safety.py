"""Checkpoints are never lost or poisoned: checksums, non-finite values, pruning, a `latest`
that falls back, all-or-nothing loads, pickles that would run code, and kills mid-save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import gpukit as gk
from gpukit import checkpoint
from gpukit.checkpoint.files import write_manifest

TORCH_ADVICE = ("weights_only=False", "weights_only", "Re-running", "WeightsUnpickler")


def _setup(
    model: nn.Module | None = None, order: str = "forward"
) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = gk.Runtime(devices="cpu", seed=0)
    model = model if model is not None else nn.Linear(2, 2)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params if order == "forward" else params[::-1], lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    return rt, model, optimizer


def _train(rt: gk.Runtime, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    rt.backward(model(torch.ones(1, rt.unwrap(model).in_features)).sum())
    rt.step(optimizer)


def _saves(folder: Path, count: int) -> gk.Runtime:
    rt, model, optimizer = _setup()
    for _ in range(count):
        _train(rt, model, optimizer)
        rt.save(folder, keep=5)
    return rt


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        values += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return values


def _unchanged(model: nn.Module, optimizer: torch.optim.Optimizer, before: list) -> bool:
    now = _snapshot(model, optimizer)
    return len(now) == len(before) and all(
        torch.equal(a, b) for a, b in zip(now, before, strict=True)
    )


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_weights(folder: Path, **values: torch.Tensor) -> None:
    """Change weights after the save and write a manifest that matches (a manifest that
    lies, or one a tool rewrote)."""
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **values}, str(folder / "model.safetensors"))
    if (folder / "manifest.json").exists():
        write_manifest(folder, int(folder.name[5:]), [])


def _rewrite_state(folder: Path, change) -> None:
    state = torch.load(folder / "state.pt", weights_only=True)
    change(state)
    torch.save(state, folder / "state.pt")
    if (folder / "manifest.json").exists():
        write_manifest(folder, int(folder.name[5:]), [])


def _as_before_manifests(folder: Path) -> None:
    """Make a checkpoint look like one written before manifests existed (format 1)."""
    (folder / "manifest.json").unlink()
    _rewrite_state(folder, lambda state: state.update(format=1))


# -- checksums --------------------------------------------------------------------------------


def test_each_checkpoint_has_a_manifest_with_sizes_and_checksums(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    folder = tmp_path / "step-00000001"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == checkpoint.FORMAT and manifest["step"] == 1
    assert manifest["finite"] is True and manifest["problems"] == []
    assert sorted(manifest["files"]) == ["model.safetensors", "state.pt"]
    import hashlib

    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.problem(folder) is None


def test_a_damaged_latest_falls_back_to_the_newest_good_one_with_a_warning(
    tmp_path: Path,
) -> None:
    _saves(tmp_path, 3)
    _flip_a_byte(tmp_path / "step-00000003" / "model.safetensors")
    rt, _, _ = _setup()
    with pytest.warns(UserWarning, match=r"step-00000003 named by .*latest is damaged: model"):
        assert rt.load(tmp_path)["step"] == 2
    assert rt.global_step == 2
    with pytest.warns(UserWarning, match="resuming from step-00000002"):
        assert checkpoint.resumable(tmp_path) == tmp_path / "step-00000002"


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_good_one(
    tmp_path: Path,
) -> None:
    _saves(tmp_path, 2)
    _flip_a_byte(tmp_path / "step-00000002" / "state.pt")
    rt, model, optimizer = _setup()
    _train(rt, model, optimizer)
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError) as err:
        rt.load(tmp_path / "step-00000002")  # this folder, by name: no falling back
    message = str(err.value)
    assert "is damaged: state.pt does not match the checksum" in message
    assert "Nothing was changed" in message
    assert "the newest good checkpoint there is" in message and "step-00000001" in message
    assert f"rt.load('{tmp_path / 'step-00000001'}')" in message
    assert _unchanged(model, optimizer, before) and rt.global_step == 1


def test_when_no_checkpoint_is_good_the_load_is_refused(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    (tmp_path / "step-00000001" / "model.safetensors").write_bytes(b"")
    rt, model, optimizer = _setup()
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError, match=r"model.safetensors has 0 bytes, .* Nothing was"):
        rt.load(tmp_path)
    assert _unchanged(model, optimizer, before)
    with pytest.raises(gk.ConfigError, match="can be resumed from"):
        checkpoint.resumable(tmp_path)


def test_a_checkpoint_from_before_manifests_still_loads(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    folder = tmp_path / "step-00000001"
    _as_before_manifests(folder)
    rt, model, _ = _setup()
    assert rt.load(tmp_path)["step"] == 1
    saved = load_file(str(folder / "model.safetensors"))
    assert torch.equal(rt.unwrap(model).weight, saved["weight"])


# -- non-finite values ------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", ["rewritten", "none"])
def test_nan_weights_are_refused_naming_the_tensor(tmp_path: Path, manifest: str) -> None:
    _saves(tmp_path, 1)
    folder = tmp_path / "step-00000001"
    if manifest == "none":
        _as_before_manifests(folder)
    _rewrite_weights(folder, weight=torch.tensor([[float("nan")] * 2, [float("nan"), 1.0]]))
    rt, model, optimizer = _setup()
    _train(rt, model, optimizer)
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError, match=r"model.safetensors: weight has 3 NaN") as err:
        rt.load(tmp_path)
    assert "Nothing was changed" in str(err.value)
    assert _unchanged(model, optimizer, before) and rt.global_step == 1


def test_inf_in_the_optimizer_state_is_refused(tmp_path: Path) -> None:
    _saves(tmp_path, 1)

    def poison(state: dict) -> None:
        state["optimizers"][0]["state"][0]["exp_avg_sq"][0, 1] = float("inf")

    _rewrite_state(tmp_path / "step-00000001", poison)
    rt, model, optimizer = _setup()
    before = _snapshot(model, optimizer)
    with pytest.raises(
        gk.ConfigError, match=r"state.pt: optimizer 0 exp_avg_sq of weight has 1 Inf"
    ):
        rt.load(tmp_path)
    assert _unchanged(model, optimizer, before)


def test_a_non_finite_gradient_scaler_state_is_refused(tmp_path: Path) -> None:
    _saves(tmp_path, 1)

    def poison(state: dict) -> None:
        state["precision"] = {"scaler": {"scale": float("nan"), "growth_factor": 2.0}}

    _rewrite_state(tmp_path / "step-00000001", poison)
    rt, _, _ = _setup()
    with pytest.raises(gk.ConfigError, match=r"state.pt: precision\.scaler\.scale is nan"):
        rt.load(tmp_path)


def test_a_save_with_nan_is_kept_but_marked_bad_and_latest_stays(tmp_path: Path) -> None:
    rt, model, optimizer = _setup()
    _train(rt, model, optimizer)
    rt.save(tmp_path, keep=1)
    for _ in range(2):
        _train(rt, model, optimizer)
        with torch.no_grad():
            rt.unwrap(model).bias[0] = float("nan")
        with pytest.warns(UserWarning, match=r"non-finite values \(model.safetensors: bias has"):
            rt.save(tmp_path, keep=1)
    # keep=1, yet nothing was pruned for the bad saves, and latest names the good one
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    manifest = json.loads((tmp_path / "step-00000003" / "manifest.json").read_text())
    assert manifest["finite"] is False and manifest["problems"] == [
        "model.safetensors: bias has 1 NaN"
    ]
    assert checkpoint.resumable(tmp_path) == tmp_path / "step-00000001"
    fresh, _, _ = _setup()
    assert fresh.load(tmp_path)["step"] == 1
    with pytest.raises(gk.ConfigError, match="was marked bad when saved"):
        fresh.load(tmp_path / "step-00000003")
    # the next good save prunes as usual, the bad ones too
    with torch.no_grad():
        rt.unwrap(model).bias.zero_()
    _train(rt, model, optimizer)
    rt.save(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004"]


def test_a_first_save_with_nan_leaves_nothing_to_resume(tmp_path: Path) -> None:
    rt, model, _ = _setup()
    with torch.no_grad():
        rt.unwrap(model).weight.fill_(float("inf"))
    with pytest.warns(UserWarning, match=r"weight has 4 Inf.*no 'latest' was written"):
        rt.save(tmp_path)
    assert checkpoint.has_checkpoints(tmp_path)
    with pytest.raises(gk.ConfigError, match=r"step-00000000 was marked bad when saved"):
        checkpoint.resumable(tmp_path)


def test_a_bad_save_never_replaces_a_good_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    rt, model, _ = _setup()
    good = rt.save(tmp_path)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    with torch.no_grad():
        rt.unwrap(model).weight[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="it was not written over"):
        rt.save(tmp_path)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000000"]


def test_a_buffer_may_hold_infinity_but_not_nan(tmp_path: Path) -> None:
    class Masked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))

    rt, _, _ = _setup(Masked())
    rt.save(tmp_path)
    assert checkpoint.resumable(tmp_path) == tmp_path / "step-00000000"
    fresh, _, _ = _setup(Masked())
    assert fresh.load(tmp_path)["step"] == 0


# -- pruning and `latest` ---------------------------------------------------------------------


def test_a_new_run_in_a_folder_of_later_checkpoints_keeps_its_own(tmp_path: Path) -> None:
    old = _setup()[0]
    old.state.global_step = 50
    for step in (50, 51, 52):
        old.state.global_step = step
        old.save(tmp_path, keep=3)
    rt, model, optimizer = _setup()
    _train(rt, model, optimizer)
    with pytest.warns(UserWarning, match=r"later steps \(up to step 52\)"):
        rt.save(tmp_path, keep=2)
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert (tmp_path / "step-00000001").is_dir()  # not pruned at once, as the oldest by step
    assert _setup()[0].load(tmp_path)["step"] == 1


def test_latest_naming_a_missing_folder_falls_back_with_a_warning(tmp_path: Path) -> None:
    _saves(tmp_path, 2)
    (tmp_path / "latest").write_text("step-00000099\n")
    with pytest.warns(UserWarning, match=r"step-00000099 named by .* is missing.*step-00000002"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"


def test_a_complete_folder_without_latest_is_resumable(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    (tmp_path / "latest").unlink()  # a kill after the rename, before `latest` was written
    with pytest.warns(UserWarning, match=r"no 'latest' file .* resuming from step-00000001"):
        assert checkpoint.resumable(tmp_path) == tmp_path / "step-00000001"


def test_leftovers_of_saves_cut_short_go_with_the_next_save(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step-00000007").mkdir(parents=True)
    (tmp_path / ".tmp-step-00000007" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".deleting-step-00000003").mkdir()
    _saves(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_has_checkpoints_and_resumable_without_any(tmp_path: Path) -> None:
    assert not checkpoint.has_checkpoints(tmp_path / "missing")
    assert checkpoint.resumable(tmp_path / "missing") is None
    (tmp_path / "step-00000004").mkdir()
    assert checkpoint.has_checkpoints(tmp_path)
    assert checkpoint.newest_step(tmp_path) == 4


# -- all or nothing ---------------------------------------------------------------------------


def test_a_model_of_another_shape_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    rt, model, optimizer = _setup(nn.Linear(2, 3))
    _train(rt, model, optimizer)
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError) as err:
        rt.load(tmp_path)
    message = str(err.value)
    assert "weight: checkpoint (2, 2), model (3, 2)" in message
    assert "bias: checkpoint (2,), model (3,)" in message and "Nothing was changed" in message
    assert _unchanged(model, optimizer, before) and rt.global_step == 1


def test_an_optimizer_over_other_parameters_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    _saves(tmp_path, 1)
    rt, model, optimizer = _setup(order="reversed")  # same model, parameters in another order
    _train(rt, model, optimizer)
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError, match=r"optimizer: bias \(2,\): exp_avg checkpoint"):
        rt.load(tmp_path)
    assert _unchanged(model, optimizer, before) and rt.global_step == 1


def test_another_number_of_optimizers_or_dtype_is_refused(tmp_path: Path) -> None:
    _saves(tmp_path, 1)
    rt = gk.Runtime(devices="cpu", seed=0)
    model = rt.setup(nn.Linear(2, 2))
    with pytest.raises(gk.ConfigError, match=r"1 optimizer\(s\) in the checkpoint, 0 now"):
        rt.load(tmp_path)
    rt, model, optimizer = _setup(nn.Linear(2, 2).double())
    before = _snapshot(model, optimizer)
    with pytest.raises(
        gk.ConfigError, match=r"weight: checkpoint torch\.float32, model torch\.float64"
    ):
        rt.load(tmp_path)
    assert _unchanged(model, optimizer, before)


def test_tied_weights_round_trip(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(x))

    torch.manual_seed(1)
    rt, model, optimizer = _setup(Tied())
    rt.backward(model(torch.tensor([1, 2])).sum())
    rt.step(optimizer)
    rt.save(tmp_path)
    fresh, other, _ = _setup(Tied())
    fresh.load(tmp_path)
    assert torch.equal(fresh.unwrap(other).head.weight, rt.unwrap(model).embed.weight)
    assert fresh.unwrap(other).head.weight is fresh.unwrap(other).embed.weight


def test_a_failure_while_restoring_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _saves(tmp_path, 1)
    rt, _, optimizer = _setup()

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk went away")

    monkeypatch.setattr(optimizer, "load_state_dict", fails)
    with pytest.raises(gk.ConfigError, match=r"failed part-way.*disk went away.*partly restored"):
        rt.load(tmp_path)


# -- a pickle that would run code -------------------------------------------------------------


class RunsCode:
    """Unpickled without weights_only, this would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("manifest", ["rewritten", "none"])
def test_a_pickle_that_would_run_code_is_refused_without_torch_advice(
    tmp_path: Path, manifest: str
) -> None:
    folder = tmp_path / "ck"
    _saves(folder, 1)
    saved = folder / "step-00000001"
    marker = tmp_path / "pwned"
    if manifest == "none":
        _as_before_manifests(saved)
    _rewrite_state(saved, lambda state: state.update(hook=RunsCode(marker)))
    rt, model, optimizer = _setup()
    before = _snapshot(model, optimizer)
    with pytest.raises(gk.ConfigError) as err:
        rt.load(folder)
    message = str(err.value)
    assert "holds objects that are not plain tensors or values" in message
    assert "only as data, so that a checkpoint can never run code" in message
    assert "re-save it with gpukit" in message and "load it yourself" in message
    assert not any(advice in message for advice in TORCH_ADVICE), message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert not marker.exists()
    assert _unchanged(model, optimizer, before)


# -- killed mid-save --------------------------------------------------------------------------

HARNESS = """
import json, os, random, signal, sys, time
from pathlib import Path

import torch

torch.set_num_threads(1)  # forked children compute on one thread (OpenMP does not fork)
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit import checkpoint

folder, trials = Path(sys.argv[1]), int(sys.argv[2])


def build():
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(1024, 768)  # 3 MB of weights and 3 MB of momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    return rt, model, optimizer


def save_until_killed():
    rt, model, optimizer = build()
    if checkpoint.resumable(folder) is not None:
        rt.load(folder)
    x = torch.ones(4, 1024)
    while True:
        rt.backward(model(x).square().mean())
        rt.step(optimizer)
        rt.save(folder, keep=2)


def check():
    path = checkpoint.resumable(folder)
    assert path is not None, "no checkpoint left"
    assert (path / "manifest.json").is_file() and checkpoint.problem(path) is None, path
    rt, model, _ = build()
    with torch.no_grad():
        rt.unwrap(model).weight.zero_()
    progress = rt.load(folder)
    saved = load_file(str(path / "model.safetensors"))
    assert torch.equal(rt.unwrap(model).weight, saved["weight"]), path
    assert progress["step"] == rt.global_step == int(path.name[5:]), path
    rt.teardown()
    return path.name


def wait_for(condition, what):
    deadline = time.monotonic() + 20
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for " + what)
        time.sleep(0.0005)


def named():
    return (folder / "latest").read_text() if (folder / "latest").exists() else None


chance = random.Random(0)
for trial in range(trials):
    before = named()
    pid = os.fork()
    if pid == 0:
        try:
            save_until_killed()
        finally:
            os._exit(1)
    if trial % 2 and before is not None:  # any moment: starting, loading, saving, pruning
        time.sleep(chance.uniform(0.0, 0.3))
    else:  # while a save is writing its files (after one that pruned what a kill left)
        wait_for(lambda: named() not in (None, before), "a new checkpoint")
        wait_for(lambda: any(folder.glob(".tmp-step-*")), "a save in progress")
        time.sleep(chance.uniform(0.0, 0.02))
    mid_save = any(folder.glob(".tmp-step-*"))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print(json.dumps({"trial": trial, "mid_save": mid_save, "resumed": check()}), flush=True)
"""


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork to kill savers quickly")
def test_a_kill_during_a_save_never_loses_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(HARNESS))
    folder = tmp_path / "ck"
    result = subprocess.run(
        [sys.executable, str(script), str(folder), "20"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    trials = [json.loads(line) for line in result.stdout.splitlines()]
    assert [t["trial"] for t in trials] == list(range(20))
    assert sum(t["mid_save"] for t in trials) >= 5, trials  # most kills hit a save at work
    path = checkpoint.resumable(folder)
    assert path is not None and checkpoint.problem(path) is None
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(1024, 768)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    assert rt.load(folder)["step"] == int(path.name[5:])
