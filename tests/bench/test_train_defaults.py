"""The benchmarks and the command line take `gpukit train`'s default Runtime settings from one
place (their declarations), so that they follow each other when a default changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpukit.bench import trace_cost
from gpukit.bench.train_defaults import runtime_settings
from gpukit.cli.__main__ import build_parser
from gpukit.runtime import settings
from gpukit.runtime.runtime import Runtime


def test_the_settings_are_what_gpukit_train_parses_without_options() -> None:
    args = build_parser().parse_args(["train"])
    settings = runtime_settings()
    assert settings == {name: getattr(args, name) for name in settings}
    assert {"strategy", "precision", "devices", "accumulate", "seed", "log_every", "oom"} <= set(
        settings
    )
    assert runtime_settings(devices="cpu") == {**settings, "devices": "cpu"}


def test_a_changed_default_reaches_the_command_line_and_the_benchmarks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declared = settings.option

    def changed(f: Any) -> settings.Option:
        train = {"oom": "raise", "log_every": 7}
        if f.name in train:
            return dataclasses.replace(declared(f), train_default=train[f.name], why="changed")
        return declared(f)

    monkeypatch.setattr(settings, "option", changed)
    chosen = runtime_settings(devices="cpu")
    assert (chosen["oom"], chosen["log_every"]) == ("raise", 7)
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
