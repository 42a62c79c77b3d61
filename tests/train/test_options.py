"""gpukit train's own options are declared once (gpukit.train.options): the flags, the config
file's keys, each rank's command line, config.toml and metrics.json all agree with it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpukit.cli.__main__ import build_parser
from gpukit.cli._config_file import file_defaults
from gpukit.cli.train import _worker_command
from gpukit.runtime import settings
from gpukit.train import options
from gpukit.train.options import TrainConfig
from gpukit.train.rerun import rerun_flags, to_toml


def _parser() -> argparse.ArgumentParser:
    parser = build_parser().parse_args(["train"]).config_parser
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _parser()._actions if a.option_strings and a.dest != "help"}


def _given(f: dataclasses.Field[Any]) -> Any:
    """A value of the option other than its default, as its flag would give it."""
    meta = options.option(f)
    if options.is_switch(f):
        return True
    if meta.choices is not None:
        return meta.choices[-1]
    return {int: 7, float: 2.5}.get(meta.parse, f"{f.name}-given")


def _argv(fields: tuple[dataclasses.Field[Any], ...]) -> list[str]:
    argv: list[str] = []
    for f in fields:
        given = _given(f)
        argv += [options.flag_name(f)] if given is True else [options.flag_name(f), str(given)]
    return argv


def test_the_flags_are_the_declared_options_and_the_runtime_settings() -> None:
    actions = _actions()
    setting_flags = {f.name for f in settings.fields() if settings.option(f).flag}
    assert set(actions) == {f.name for f in options.flags()} | setting_flags
    assert not {f.name for f in options.flags()} & setting_flags  # each option declared once
    for f in options.flags():
        action, meta = actions[f.name], options.option(f)
        assert action.option_strings == [options.flag_name(f)]
        assert (action.default, action.help) == (f.default, meta.help)
        if not options.is_switch(f):
            assert (action.type, action.choices, action.metavar) == (
                meta.parse,
                meta.choices,
                meta.metavar,
            )
    # The API's own options have no flag (seed's is the Runtime setting's; compile_why is what
    # the command made of --compile).
    unflagged = {f.name for f in options.fields()} - set(actions)
    assert unflagged == {"progress", "sample", "validate", "compile_why"}


def test_every_declared_flag_but_config_is_a_key_of_a_config_file(tmp_path: Path) -> None:
    declared = [f for f in options.flags() if f.name != "config"]
    path = tmp_path / "run.toml"
    path.write_text(to_toml({f.name: _given(f) for f in declared}))
    assert file_defaults(_parser(), path) == {f.name: _given(f) for f in declared}


def test_every_rank_gets_the_loop_and_runtime_options_and_not_the_launchers() -> None:
    argv = _argv(options.flags())
    args = build_parser().parse_args(["train", *argv])
    command = _worker_command(args, "fsdp")
    again = build_parser().parse_args(command[command.index("train") :])
    ranks = {f.name for f in options.for_ranks()}
    assert ranks == {f.name for f in options.flags()} - {
        "config",
        "overwrite",
        "max_restarts",
        "hang_timeout",
        "startup_timeout",
        "straggler_factor",
        "straggler_steps",
    }
    for f in options.flags():
        expected = _given(f) if f.name in ranks else f.default
        assert getattr(again, f.name) == expected, f.name
    assert again.strategy == "fsdp"


def test_every_rerun_option_round_trips_through_config_toml(tmp_path: Path) -> None:
    rerun = options.for_rerun()
    assert {f.name for f in options.for_ranks()} - {f.name for f in rerun} == {"resume", "logger"}
    recorded: dict[str, Any] = {"runtime": {}}
    strategy_options = SimpleNamespace()
    for f in rerun:
        name = options.option(f).strategy_option
        if name is None:
            recorded[f.name] = _given(f)
        else:  # the value the strategy used: fsdp's compile="blocks" is the switch's
            setattr(strategy_options, name, "blocks" if options.is_switch(f) else _given(f))
    path = tmp_path / "config.toml"
    path.write_text(to_toml(rerun_flags(recorded, "32", strategy_options)))
    assert file_defaults(_parser(), path) == {f.name: _given(f) for f in rerun}


def test_metrics_json_records_the_loops_options() -> None:
    loop = {f.name for f in options.fields() if options.option(f).reader == "loop"}
    assert loop == {
        "workload",
        "epochs",
        "max_steps",
        "batch_size",
        "lr",
        "seed",
        "out",
        "resume",
        "progress",
        "progress_every",
        "sample",
        "validate",
        "compile_why",
    }
    config = TrainConfig(workload="mlp", lr=0.5, max_restarts=3, compile="on")
    recorded = options.record(config)
    assert set(recorded) == loop and (recorded["workload"], recorded["lr"]) == ("mlp", 0.5)


@pytest.mark.parametrize("f", options.fields(), ids=lambda f: f.name)
def test_every_option_is_declared_with_its_metadata(f: dataclasses.Field[Any]) -> None:
    meta = options.option(f)
    assert (meta.help != "") == meta.flag  # a flag has its --help line; no flag, none
    assert meta.reader == "loop" or meta.flag
