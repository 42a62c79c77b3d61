"""The benchmarks and the command line take `gpukit train`'s default Runtime settings from one
place, so that they follow each other when a default changes."""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.bench import trace_cost
from gpukit.bench.train_defaults import runtime_settings
from gpukit.cli.__main__ import build_parser
from gpukit.runtime.runtime import Runtime
from gpukit.train import loop


def test_the_settings_are_what_gpukit_train_parses_without_options() -> None:
    args = build_parser().parse_args(["train"])
    settings = runtime_settings()
    assert settings == {
        "strategy": args.strategy,
        "precision": args.precision,
        "devices": args.devices,
        "accumulate": args.accumulate,
        "seed": args.seed,
        "log_every": args.log_every,
        "oom": args.oom,
    }
    assert runtime_settings(devices="cpu") == {**settings, "devices": "cpu"}


def test_a_changed_default_reaches_the_command_line_and_the_benchmarks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(loop.RUNTIME_DEFAULTS, "oom", "raise")
    monkeypatch.setitem(loop.RUNTIME_DEFAULTS, "log_every", 7)
    settings = runtime_settings(devices="cpu")
    assert (settings["oom"], settings["log_every"]) == ("raise", 7)
    args = build_parser().parse_args(["train"])
    assert (args.oom, args.log_every) == ("raise", 7)


def test_the_trace_benchmark_builds_its_runtime_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, Any]] = []

    class Recorded(Runtime):
        def __init__(self, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(**{**kwargs, "devices": "cpu"})

    monkeypatch.setattr(trace_cost, "Runtime", Recorded)
    trace_cost.run_trace_cost(workload="mlp", steps=1, rounds=1)
    assert built == [runtime_settings()]
