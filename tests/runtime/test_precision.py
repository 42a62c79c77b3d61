"""Precision objects: what wraps the forward, and the gradient scaler's skip-and-lower."""

from __future__ import annotations

import copy
import operator
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.runtime.step.precision import FP16Mixed, make_precision

CPU = torch.device("cpu")


def test_float32_leaves_the_model_alone() -> None:
    model = nn.Linear(2, 2)
    assert make_precision("32", CPU).setup_module(model) is model
    assert "forward" not in vars(model)


def test_bf16_mixed_runs_the_forward_in_bf16_and_returns_float32() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    wrapped = make_precision("bf16-mixed", CPU).setup_module(model)
    seen = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    out = wrapped(torch.ones(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert list(wrapped.state_dict()) == ["0.weight", "0.bias"]  # the user's keys
    assert wrapped.module is model and wrapped.training is model.training
    linear = make_precision("bf16-mixed", CPU).setup_module(nn.Linear(3, 2))
    assert linear.in_features == 3  # the user's attributes, through the wrapper
    assert wrapped[0] is model[0] and len(wrapped) == 1 and list(wrapped) == list(model)


def test_mixed_precision_never_modifies_the_users_module() -> None:
    model = nn.Linear(4, 2)
    rt = gk.Runtime(devices="cpu", precision="bf16-mixed")
    wrapped = rt.setup(model)
    assert "forward" not in vars(model) and not model._forward_hooks
    assert model(torch.ones(1, 4)).dtype == torch.float32  # called directly: plain float32
    assert rt.unwrap(wrapped) is model
    wrapped.load_state_dict(model.state_dict())  # the same keys both ways


def test_a_second_setup_returns_the_first_wrapper_without_nesting() -> None:
    model = nn.Linear(4, 2)
    rt = gk.Runtime(devices="cpu", precision="bf16-mixed")
    first = rt.setup(model)
    assert rt.setup(model) is first
    assert rt.setup(first) is first  # what setup returned, given back
    assert rt.unwrap(first) is model and first.module is model  # one wrapper deep
    assert len(rt.state.modules) == 1


def test_after_teardown_the_model_is_as_the_user_gave_it() -> None:
    model = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rt = gk.Runtime(devices="cpu", precision="bf16-mixed")
    rt.setup(model)
    rt.teardown()
    assert type(model).forward is nn.Linear.forward and "forward" not in vars(model)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model(torch.ones(1, 4)).dtype == torch.float32


def test_auto_is_float32_on_cpu() -> None:
    assert make_precision("auto", CPU).name == "32"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp16", r"unknown precision 'fp16': use one of 32, bf16-mixed, 16-mixed, auto"),
        ("16-mixed", r"'16-mixed' needs a CUDA GPU, but the device is cpu"),
    ],
)
def test_bad_precision_names_say_what_is_allowed(name: str, message: str) -> None:
    with pytest.raises(gk.ConfigError, match=message):
        gk.Runtime(devices="cpu", precision=name)


def test_16_mixed_tells_a_skipped_step_without_reading_the_scale() -> None:
    precision = FP16Mixed(CPU)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.scaler.get_scale = None  # type: ignore[assignment]  # any read would fail
    for overflow, expected in ((True, False), (False, True), (True, False)):
        optimizer.zero_grad()
        precision.backward(model(torch.ones(1, 2)).sum())
        if overflow:
            model.weight.grad[0, 0] = float("nan")
        assert precision.step(optimizer) is expected
    assert not optimizer._optimizer_step_pre_hooks  # the step hook is gone after each step


def test_16_mixed_tells_a_fused_optimizers_skipped_step_from_the_scale() -> None:
    precision = FP16Mixed(CPU)
    model = nn.Linear(2, 1)
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    except RuntimeError as err:  # older releases fuse on CUDA only
        pytest.skip(f"this torch has no fused Adam on the CPU: {err}")
    before = model.weight.detach().clone()
    for overflow, expected in ((True, False), (False, True)):
        optimizer.zero_grad()
        precision.backward(model(torch.ones(1, 2)).sum())
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        # The scaler calls a fused optimizer's step every time (it skips on the device), so a
        # hook on the step would have said True both times.
        assert precision.step(optimizer) is expected
        assert torch.equal(model.weight, before) is overflow


def test_16_mixed_skips_a_step_with_inf_gradients_and_lowers_the_scale() -> None:
    precision = FP16Mixed(CPU)  # the scaler logic is the same on CPU; CUDA is not needed
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    scale = precision.scale
    precision.backward(model(torch.ones(1, 2)).sum())
    model.weight.grad[0, 0] = float("inf")  # an overflow, injected
    assert precision.step(optimizer) is False
    assert torch.equal(model.weight, before) and precision.scale < scale
    optimizer.zero_grad()
    precision.backward(model(torch.ones(1, 2)).sum())
    assert precision.step(optimizer) is True
    assert not torch.equal(model.weight, before)
    state = precision.state_dict()
    restored = FP16Mixed(CPU)
    restored.load_state_dict(state)
    assert restored.scale == precision.scale


@pytest.mark.gpu
def test_auto_picks_mixed_precision_on_a_gpu() -> None:
    name = make_precision("auto", torch.device("cuda:0")).name
    major, _ = torch.cuda.get_device_capability(0)
    assert name == ("bf16-mixed" if major >= 8 else "16-mixed")


def test_the_runtime_runs_in_float32_unless_asked() -> None:
    """A program moved onto gpukit keeps its float32 unless it asks for less: "auto" (mixed
    precision on a GPU that has it) is gpukit train's default, not the Runtime's."""
    from gpukit.cli.__main__ import build_parser

    rt = gk.Runtime(devices="cpu")
    assert rt.config.precision == "32" and rt.precision.name == "32"
    assert build_parser().parse_args(["train"]).precision == "auto"


USER_MODULE = """
import torch


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))
"""

# Loads the file in a process that has torch and the user's module, and not gpukit.
RELOAD = """
import sys, torch
sys.modules["gpukit"] = None  # any import of gpukit while loading fails
model = torch.load(sys.argv[1], weights_only=False)
print(type(model).__module__, type(model).__name__)
torch.save(model.state_dict(), sys.argv[2])
"""


def _user_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    (tmp_path / "usermodel.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    torch.manual_seed(0)
    return usermodel.TwoLayers()


def _reload_elsewhere(tmp_path: Path, saved: Path) -> tuple[str, dict[str, torch.Tensor]]:
    out = subprocess.run(
        [sys.executable, "-c", RELOAD, str(saved), str(tmp_path / "weights.pt")],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), torch.load(tmp_path / "weights.pt", weights_only=True)


@pytest.mark.processes
@pytest.mark.parametrize(
    ("strategy", "devices"), [("single", "cpu"), ("dp", ["cpu", "cpu"])], ids=["single", "dp"]
)
def test_a_set_up_model_pickles_as_the_users_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, devices: object
) -> None:
    """The program's own torch.save(model, f) of what rt.setup returned (autocast inside dp's
    devices) writes the user's model, which loads where gpukit is not installed."""
    model = _user_model(tmp_path, monkeypatch)
    rt = gk.Runtime(strategy=strategy, devices=devices, precision="bf16-mixed")
    wrapped = rt.setup(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for _ in range(2):  # trained, so the saved weights are not the initial ones
        rt.backward(wrapped(torch.randn(6, 4)).square().mean())
        rt.step(optimizer)
    torch.save(wrapped, tmp_path / "model.pt")
    rt.teardown()
    loaded_type, weights = _reload_elsewhere(tmp_path, tmp_path / "model.pt")
    assert loaded_type == "usermodel TwoLayers"
    assert list(weights) == list(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_set_up_model_writes_the_same_file_as_the_model_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the function that picks the model out again is added; a model saved beside its
    own parts stays one object; copy.deepcopy gives the user's class too."""
    model = _user_model(tmp_path, monkeypatch)
    wrapped = gk.Runtime(devices="cpu", precision="bf16-mixed").setup(model)
    torch.save({"model": wrapped, "head": model.head}, tmp_path / "both.pt")
    both = torch.load(tmp_path / "both.pt", weights_only=False)
    assert type(both["model"]) is type(model) and both["model"].head is both["head"]
    allowed = [type(model), nn.Sequential, nn.Linear, nn.ReLU, operator.getitem]
    torch.save(wrapped, tmp_path / "model.pt")
    if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5
        with torch.serialization.safe_globals(allowed):
            alone = torch.load(tmp_path / "model.pt", weights_only=True)
        assert type(alone) is type(model)
    copied = copy.deepcopy(wrapped)
    assert type(copied) is type(model) and copied is not model
    assert all(torch.equal(copied.state_dict()[k], v) for k, v in model.state_dict().items())


def test_state_dict_keys_are_the_plain_programs() -> None:
    """Autocast adds no level to the keys; dp's wrapper adds `module.`, as torch's
    DataParallel does (and DDP, tested with it), and rt.unwrap gives the plain keys back."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    plain = list(model.state_dict())
    wrapped = gk.Runtime(devices="cpu", precision="bf16-mixed").setup(model)
    assert list(wrapped.state_dict()) == plain == ["0.weight", "0.bias", "2.weight", "2.bias"]
    rt = gk.Runtime(strategy="dp", devices=["cpu", "cpu"], precision="bf16-mixed")
    parallel = rt.setup(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))
    assert list(parallel.state_dict()) == [f"module.{k}" for k in plain]
    assert list(rt.unwrap(parallel).state_dict()) == plain
