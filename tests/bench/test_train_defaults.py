"""The benchmarks take `gpukit train`'s default Runtime settings from its parser, so that they
follow the command line when a default changes."""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.bench import trace_cost
from gpukit.bench.train_defaults import runtime_settings
from gpukit.cli import train
from gpukit.cli.__main__ import build_parser
from gpukit.runtime.runtime import Runtime


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


def test_a_changed_cli_default_reaches_the_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    register = train.register

    def changed(sub: Any) -> None:
        register(sub)
        sub.choices[train.NAME].set_defaults(oom="raise", log_every=7)

    monkeypatch.setattr(train, "register", changed)
    settings = runtime_settings(devices="cpu")
    assert (settings["oom"], settings["log_every"]) == ("raise", 7)


def test_the_trace_benchmark_builds_its_runtime_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, Any]] = []

    class Recorded(Runtime):
        def __init__(self, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(**{**kwargs, "devices": "cpu"})

    monkeypatch.setattr(trace_cost, "Runtime", Recorded)
    trace_cost.run_trace_cost(workload="mlp", steps=1, rounds=1)
    assert built == [runtime_settings()]
