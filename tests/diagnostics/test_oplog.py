"""gk.log_placement: every op with its devices, per-module aggregation, and the summary.

No GPU here: the ``meta`` device stands in for an accelerator (a model on meta, inputs copied
from the CPU to meta, CPU work inside a meta model).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gpukit.diagnostics.op_records import OpRecord, TensorSpec
from gpukit.diagnostics.oplog import log_placement
from gpukit.errors import ConfigError, OutputWriteError


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class Head(nn.Module):
    """A layer that does some of its work on the CPU whatever device it is on: the bug to find."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(4) * 2
        return self.proj(x) * scale.to(x.device)


def hook_counts() -> tuple[int, int, int]:
    return (
        len(module_mod._global_forward_pre_hooks),
        len(module_mod._global_forward_hooks),
        len(module_mod._global_forward_hooks_always_called),
    )


def test_records_have_op_devices_shapes_dtypes_and_module() -> None:
    model, x = mlp(), torch.randn(8, 32)
    with log_placement(model=model) as log:
        model(x)
    addmm = [r for r in log.records if r.op == "aten::addmm"]
    assert [r.module for r in addmm] == ["0", "2"]
    first = addmm[0]
    assert first.device == "cpu"
    assert TensorSpec(torch.device("cpu"), (8, 32), torch.float32) in first.inputs
    assert first.outputs == (TensorSpec(torch.device("cpu"), (8, 64), torch.float32),)
    assert first.line() == (
        "aten::addmm  cpu <- cpu[64]f32, cpu[8,32]f32, cpu[32,64]f32 -> cpu[8,64]f32  (0)"
    )
    assert any(r.op == "aten::relu" and r.module == "1" for r in log.records)
    assert log.modules == {}  # level="op" keeps records only


def test_without_model_modules_are_named_by_class() -> None:
    model = mlp()
    with log_placement() as log:
        model(torch.randn(2, 32))
    assert [r.module for r in log.records if r.op == "aten::addmm"] == ["Linear", "Linear"]


def test_backward_ops_are_recorded_and_attributed_to_backward() -> None:
    model, x = mlp(), torch.randn(8, 32)
    with log_placement(model=model) as log:
        model(x).sum().backward()
    backward = [r for r in log.records if r.module == "(backward)"]
    assert {"aten::mm", "aten::threshold_backward"} <= {r.op for r in backward}
    # the gradient of the first weight: [64, 8] @ [8, 32]
    grads = [r for r in backward if r.op == "aten::mm" and r.outputs[0].shape == (64, 32)]
    assert grads and grads[0].outputs[0].dtype == torch.float32
    assert log.records[-1].module == "(backward)"
    assert any(r.op == "aten::sum" and r.module == "(no module)" for r in log.records)


def test_tensors_in_list_arguments_and_nested_module_data_are_specs() -> None:
    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        extra: dict[str, torch.Tensor]

    class Nested(nn.Module):
        def forward(self, batch: dict[str, list[torch.Tensor]]) -> Out:
            x = torch.cat(batch["x"])
            return Out(x[None, torch.tensor([0])], {"meta": x.to("meta")})

    a, b = torch.ones(2), torch.ones(3)
    with log_placement() as log:
        Nested()({"x": [a, b]})
    cat = next(r for r in log.records if r.op == "aten::cat")
    assert [str(s) for s in cat.inputs] == ["cpu[2]f32", "cpu[3]f32"]
    index = next(r for r in log.records if r.op == "aten::index")
    assert [str(s) for s in index.inputs] == ["cpu[1,5]f32", "cpu[1]i64"]  # indices: [None, t]
    with log_placement(level="module") as log:
        Nested()({"x": [a, b]})
    assert (log.modules["Nested"].inputs, log.modules["Nested"].outputs) == (
        {"cpu"},
        {"cpu", "meta"},
    )


def test_module_level_aggregates_per_module_by_path() -> None:
    model, x = mlp(), torch.randn(8, 32)
    with log_placement(level="module", model=model) as log:
        model(x)
        model(x)
    assert list(log.modules) == ["(model)", "0", "1", "2"]
    first = log.modules["0"]
    assert (first.type, first.calls, first.ops) == ("Linear", 2, {"cpu": 4})  # t + addmm, twice
    assert first.inputs == first.outputs == {"cpu"}
    assert log.modules["(model)"].ops == {}  # own ops only; its children did the work
    assert log.records == []
    assert "module" in str(log.summary()) and "Linear" in str(log.summary())


def test_op_level_file_gets_one_line_per_op(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(4, 32)
    path = tmp_path / "ops.log"
    with log_placement(path, model=model) as log:
        model(x)
    lines = path.read_text().splitlines()
    assert lines == [r.line() for r in log.records]
    assert len(lines) == len(log.records) >= 5
    assert any(line.startswith("aten::addmm  cpu <- ") for line in lines)


def test_stream_file_gets_lines_as_ops_run() -> None:
    stream = io.StringIO()
    with log_placement(stream) as log:
        torch.ones(3) + 1
        assert stream.getvalue().count("\n") == 2  # written as they run, not at exit
    assert stream.getvalue().splitlines() == [r.line() for r in log.records]
    assert not stream.closed  # a stream the caller owns stays open


def test_module_level_file_gets_one_line_per_module_call() -> None:
    model, stream = mlp(), io.StringIO()
    with log_placement(stream, level="module", model=model):
        model(torch.randn(4, 32))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "0 (Linear)  cpu[4,32]f32 -> cpu[4,64]f32  ops: cpu x2"
    assert len(lines) == 4 and lines[-1].startswith("(model) (Sequential)  cpu[4,32]f32")


def test_summary_counts_ops_per_device() -> None:
    model = mlp()
    with log_placement() as log:
        model(torch.randn(2, 32))
    summary = log.summary()
    d = summary.to_dict()
    assert d["ops"] == {"cpu": len(log.records)} and d["total_ops"] == len(log.records)
    assert d["model_device"] == "cpu"
    assert d["cpu_ops"] == d["copies"] == d["mixed"] == []  # all on the CPU is not a problem
    assert str(summary).startswith(f"Placement log: {len(log.records)} ops, model on cpu")


def test_meta_model_flags_cpu_ops_and_counts_copies_with_bytes() -> None:
    model = nn.Sequential(nn.Linear(16, 8), Head()).to("meta")
    x = torch.randn(2, 16)
    for level in ("op", "module"):
        with log_placement(level=level, model=model) as log:  # type: ignore[arg-type]
            model(x.to("meta"))
        summary = log.summary()
        d = summary.to_dict()
        assert log.model_device == d["model_device"] == "meta"
        assert d["ops"]["cpu"] == 2 and d["ops"]["meta"] > 2
        assert d["cpu_ops"] == [
            {"op": "aten::ones", "module": "1", "count": 1},
            {"op": "aten::mul", "module": "1", "count": 1},
        ]
        # x (2 x 16 float32) into the model, the scale (4 float32) inside Head
        assert d["copies"] == [
            {"op": "aten::_to_copy", "src": "cpu", "dst": "meta", "count": 2, "bytes": 144}
        ]
        text = str(summary)
        assert "2 ops ran on cpu while the model is on meta:" in text
        assert "aten::mul in 1 (x1)" in text
        assert "2 cross-device copies, 144 B:" in text
        assert "aten::_to_copy cpu->meta (x2, 144 B)" in text


def test_in_place_copy_between_devices_is_a_copy() -> None:
    dst = torch.zeros(4, 2, device="meta")
    with log_placement() as log:
        dst.copy_(torch.ones(4, 2))
    d = log.summary().to_dict()
    assert d["copies"] == [
        {"op": "aten::copy_", "src": "cpu", "dst": "meta", "count": 1, "bytes": 32}
    ]
    assert d["mixed"] == []


def test_failing_op_mixing_devices_is_recorded_then_raised() -> None:
    model = nn.Linear(3, 2).to("meta")
    with log_placement(model=model) as log, pytest.raises(RuntimeError):
        model(torch.ones(1, 3))  # the classic bug: the input was not moved
    failed = log.records[-1]
    assert failed.op == "aten::addmm" and failed.outputs == () and failed.module == "(model)"
    assert {str(s.device) for s in failed.inputs} == {"cpu", "meta"}
    d = log.summary().to_dict()
    assert d["mixed"] == [
        {"op": "aten::addmm", "module": "(model)", "devices": ["cpu", "meta"], "count": 1}
    ]


def test_cpu_scalars_do_not_count_as_mixing() -> None:
    with log_placement() as log:
        torch.ones(2, device="meta") * torch.tensor(3.0)
    assert log.summary().mixed == []


def test_accelerator_records_format_and_item_counts_as_a_copy() -> None:
    cuda = torch.device("cuda:0")
    log = log_placement()
    log.records += [
        OpRecord(
            "aten::addmm",
            (TensorSpec(cuda, (8, 32), torch.float32), TensorSpec(cuda, (32, 64), torch.float32)),
            (TensorSpec(cuda, (8, 64), torch.float32),),
            "encoder.0",
        ),
        OpRecord("aten::_local_scalar_dense", (TensorSpec(cuda, (), torch.float32),), (), "loss"),
    ]
    assert log.records[0].line() == (
        "aten::addmm  cuda:0 <- cuda:0[8,32]f32, cuda:0[32,64]f32 -> cuda:0[8,64]f32  (encoder.0)"
    )
    d = log.summary().to_dict()
    assert d["ops"] == {"cuda:0": 2}
    assert d["copies"] == [
        {"op": "aten::_local_scalar_dense", "src": "cuda:0", "dst": "cpu", "count": 1, "bytes": 4}
    ]


def test_model_device_falls_back_to_the_given_model() -> None:
    model = nn.Linear(2, 2).to("meta")
    with log_placement(model=model) as log:
        torch.ones(2) * 2  # no module ran
    assert log.model_device == "meta"
    assert log.summary().to_dict()["cpu_ops"][0] == {
        "op": "aten::ones",
        "module": "(no module)",
        "count": 1,
    }


def test_hooks_and_mode_removed_after_exit_and_after_exception() -> None:
    before = hook_counts()
    model = mlp()
    with log_placement(model=model):
        assert hook_counts() != before
        assert _get_current_dispatch_mode() is not None
    assert hook_counts() == before and _get_current_dispatch_mode() is None

    with pytest.raises(ValueError, match="boom"), log_placement(level="module") as log:
        model(torch.randn(1, 32))
        raise ValueError("boom")
    assert hook_counts() == before and _get_current_dispatch_mode() is None
    with_ops = log.summary().to_dict()["total_ops"]
    torch.ones(2) + 1  # after exit: not recorded
    assert log.summary().to_dict()["total_ops"] == with_ops


def test_forward_that_raises_leaves_no_module_on_the_stack() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside forward")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    with log_placement(model=model) as log:
        with pytest.raises(RuntimeError):
            model(torch.ones(1, 2))
        torch.ones(1) + 1
    assert log.records[-1].module == "(no module)"


def test_nested_logs_both_record_and_restore() -> None:
    before = hook_counts()
    model = mlp()
    with log_placement(model=model) as outer:
        with log_placement(level="module") as inner:
            model(torch.randn(2, 32))
        assert hook_counts() != before
        torch.ones(1)
    assert hook_counts() == before and _get_current_dispatch_mode() is None
    assert len(outer.records) == inner.summary().to_dict()["total_ops"] + 1
    assert inner.modules["Linear"].calls == 2


def test_other_threads_are_not_recorded() -> None:
    model = mlp()
    with log_placement(level="module", model=model) as log:
        worker = threading.Thread(target=lambda: model(torch.randn(2, 32)))
        worker.start()
        worker.join()
        torch.ones(1)
    assert log.summary().to_dict()["total_ops"] == 1
    assert list(log.modules) == ["(no module)"]


def test_a_log_is_not_entered_twice_at_once() -> None:
    log = log_placement()
    with log, pytest.raises(ConfigError, match="already active"), log:
        pass


@pytest.mark.parametrize("level", ["ops", "Module", "", None])
def test_bad_level_says_what_is_allowed(level: object) -> None:
    with pytest.raises(ConfigError, match=r"'op'.*'module'"):
        log_placement(level=level)  # type: ignore[arg-type]


@pytest.mark.parametrize("file", [3, io.BytesIO(), b"ops.log", object()])
def test_bad_file_says_what_is_allowed(file: object) -> None:
    with pytest.raises(ConfigError, match=r"text stream such as sys\.stderr"):
        log_placement(file)  # type: ignore[arg-type]


def test_unwritable_path_and_bad_model_are_config_errors(tmp_path: Path) -> None:
    before = hook_counts()
    with pytest.raises(ConfigError, match="cannot be written"), log_placement(tmp_path / "no/x"):
        pass
    assert hook_counts() == before
    with pytest.raises(ConfigError, match=r"nn\.Module"):
        log_placement(model="encoder")  # type: ignore[arg-type]


@pytest.mark.processes
def test_a_forked_child_writes_nothing_to_the_log(tmp_path: Path) -> None:
    import multiprocessing

    path = tmp_path / "ops.txt"
    ctx = multiprocessing.get_context("fork")
    model = nn.Linear(3, 2)
    with log_placement(path, level="op") as log:
        model(torch.ones(1, 3))
        # Enough ops to fill the inherited file buffer, which the child would then write out.
        child = ctx.Process(target=lambda: [model(torch.ones(1, 3)) for _ in range(500)])
        child.start()
        child.join(30)
    assert child.exitcode == 0
    assert len(path.read_text().splitlines()) == len(log.records)


def test_ops_without_tensors_are_not_counted() -> None:
    with log_placement() as log, torch.profiler.record_function("marker"):
        torch.ones(2).sum()
    assert all(r.inputs or r.outputs for r in log.records)
    assert "-" not in log.summary().to_dict()["ops"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("ops", [1, 2000])  # a write at the end (close), one mid-log (full buffer)
def test_a_log_file_on_a_full_disk_is_one_error_naming_it(ops: int) -> None:
    before = hook_counts()
    x = torch.ones(2)
    with pytest.raises(OutputWriteError) as raised, log_placement("/dev/full", level="op"):
        for _ in range(ops):
            x = x + 1
    said = str(raised.value)
    assert said.startswith("could not write /dev/full: the disk is full (ENOSPC)"), said
    assert "Fix: free space there" in said and "(log_placement(file=))" in said
    assert raised.value.errno == errno.ENOSPC
    assert hook_counts() == before  # the hooks were removed all the same
