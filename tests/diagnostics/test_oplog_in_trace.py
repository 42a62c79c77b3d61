"""A placement log entered inside gk.trace() rides on the trace's dispatch mode (one pass per
op serves both, as `gpukit trace` runs them): it must find exactly what it finds alone, and the
trace exactly what it finds without the log."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from gpukit.diagnostics.oplog import log_placement
from gpukit.diagnostics.trace import trace


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(4) * 2  # CPU work inside a model elsewhere
        return self.proj(x) * scale.to(x.device)


def _meta_model() -> None:
    model = nn.Sequential(nn.Linear(16, 8), Head()).to("meta")
    for _ in range(3):  # the same ops again: counted from what the first pass learnt
        model(torch.randn(2, 16).to("meta")).sum().backward()


def _cpu_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        torch.cat([torch.ones(2), torch.zeros(3)]).to("meta")  # a list argument, a copy


def _copies_of_sizes() -> None:
    dst = torch.zeros(4, 2, device="meta")
    for n in (1, 2, 3):  # same op, devices and module; other bytes
        torch.ones(n, 8).to("meta")
        dst.copy_(torch.ones(4, 2))
    torch.ones(2, device="meta") * torch.tensor(3.0)  # a CPU scalar does not mix


SCENES: dict[str, Callable[[], None]] = {
    "meta model": _meta_model,
    "cpu training": _cpu_training,
    "copies": _copies_of_sizes,
}


def _found(scene: Callable[[], None], level: str, in_trace: bool) -> dict[str, Any]:
    with trace() if in_trace else contextlib.nullcontext(), log_placement(level=level) as log:  # type: ignore[arg-type]
        scene()
    modules = [(m.name, m.calls, m.ops, m.inputs, m.outputs) for m in log.modules.values()]
    return {"summary": log.summary().to_dict(), "modules": modules, "records": log.records}


@pytest.mark.parametrize("level", ["op", "module"])
@pytest.mark.parametrize("scene", list(SCENES))
def test_a_log_inside_a_trace_finds_what_it_finds_alone(scene: str, level: str) -> None:
    alone = _found(SCENES[scene], level, in_trace=False)
    assert alone["summary"]["total_ops"] > 0
    assert _found(SCENES[scene], level, in_trace=True) == alone


def test_copies_of_different_sizes_keep_their_bytes() -> None:
    with trace(), log_placement(level="module") as log:
        _copies_of_sizes()
    copies = {c["op"]: (c["count"], c["bytes"]) for c in log.summary().copies}
    assert copies == {"aten::_to_copy": (3, (1 + 2 + 3) * 8 * 4), "aten::copy_": (3, 3 * 32)}


def test_one_dispatch_mode_serves_both_and_the_trace_counts_the_same() -> None:
    with trace() as plain:
        _cpu_training()
    with trace() as t:
        with log_placement(level="module") as log:
            assert len(_get_current_dispatch_mode_stack()) == 1  # the trace's alone
            _cpu_training()
        assert t._recorder.listeners == []  # the log left when its block ended
    assert log.summary().to_dict()["total_ops"] == sum(t.ops_per_device.values())
    assert [(s.op, s.line, s.count) for s in t.syncs] != []
    assert [(s.op, s.count) for s in t.syncs] == [(s.op, s.count) for s in plain.syncs]
    assert [(x.kind, x.count, x.bytes) for x in t.transfers] == [
        (x.kind, x.count, x.bytes) for x in plain.transfers
    ]
    assert t.ops_per_device == plain.ops_per_device


def test_a_failing_op_inside_a_trace_is_logged_with_its_inputs() -> None:
    model = nn.Linear(3, 2).to("meta")
    with trace(), log_placement(model=model) as log, pytest.raises(RuntimeError):
        model(torch.ones(1, 3))  # the input was not moved
    failed = log.records[-1]
    assert failed.op == "aten::addmm" and failed.outputs == ()
    assert {str(s.device) for s in failed.inputs} == {"cpu", "meta"}


def test_a_log_entered_before_the_trace_keeps_its_own_mode() -> None:
    with log_placement(level="module") as log, trace() as t:
        assert len(_get_current_dispatch_mode_stack()) == 2
        _cpu_training()
    # Below the trace's mode, the log also sees the ops the trace runs to look closer.
    assert log.summary().to_dict()["total_ops"] >= sum(t.ops_per_device.values()) > 0
