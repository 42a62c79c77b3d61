"""Every setting is declared once (gpukit.runtime.settings) and reaches gk.Runtime's keywords,
`gpukit train`'s flags, the config in metrics.json and docs/settings.md from there."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.cli.__main__ import build_parser
from gpukit.cli._settings import add_setting_flags, command_line, values
from gpukit.errors import ConfigError
from gpukit.runtime import settings as s
from gpukit.runtime.settings import Settings, arguments_doc, record, setting
from gpukit.runtime.settings_doc import COMMAND, render
from gpukit.train.loop import TrainConfig, fit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def _check_warmup(value: object) -> None:
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"warmup={value!r}: give 0 or more steps")


@dataclass(frozen=True)
class WithWarmup(Settings):
    """A throwaway option, declared as any other would be."""

    warmup: int = setting(
        0,
        help="steps before the learning rate is reached",
        allowed="0 or more",
        check=_check_warmup,
        parse=int,
        train_default=2,
        why="a command's short runs start gently",
    )


def test_docs_settings_md_is_what_the_declarations_render() -> None:
    assert DOCS.read_text() == render(), f"docs/settings.md is stale: regenerate it with {COMMAND}"


def test_an_option_declared_once_reaches_the_flags_the_table_and_the_record() -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, WithWarmup)
    assert parser.parse_args([]).warmup == 2  # gpukit train's own default
    args = parser.parse_args(["--warmup", "5"])
    assert values(args, WithWarmup)["warmup"] == 5
    assert command_line(args, WithWarmup)[-2:] == ["--warmup", "5"]
    assert "a command's short runs start gently" in " ".join(parser.format_help().split())

    assert "| `warmup` | `0` | `--warmup` | `2` | 0 or more |" in render(WithWarmup)
    assert "a command's short runs start gently |" in render(WithWarmup)
    assert record(WithWarmup(warmup=5))["warmup"] == 5
    assert "warmup: steps before" in arguments_doc(WithWarmup)
    with pytest.raises(ConfigError, match="warmup=-1"):
        WithWarmup(warmup=-1)


def test_every_setting_is_a_runtime_keyword_a_flag_a_row_and_a_record_entry() -> None:
    keywords = inspect.signature(gk.Runtime).parameters
    parsed = vars(build_parser().parse_args(["train"]))
    table, recorded = render(), record(Settings())
    for f in s.fields():
        assert keywords[f.name].default == f.default, f.name
        flag = s.flag_name(f)
        if flag is None:
            assert s.option(f).no_flag, f"{f.name}: say what gpukit train does without a flag"
        else:
            assert parsed[f.name] == s.train_default(f), f.name
        assert f"| `{f.name}` |" in table
        assert f.name in recorded


def test_a_default_differs_between_api_and_command_only_with_its_reason() -> None:
    for f in s.fields():
        meta = s.option(f)
        differs = meta.train_default is not s.SAME and meta.train_default != f.default
        assert differs == bool(meta.why), f.name
    assert s.train_defaults()["oom"] == "auto" and Settings().oom == "raise"


def test_the_runtime_takes_its_keywords_as_before() -> None:
    rt = gk.Runtime("single", "32", "cpu", 2, seed=3)
    assert (rt.strategy.name, rt.accumulate, rt.seed, rt.settings.keep) == ("single", 2, 3, 3)
    with pytest.raises(TypeError, match="acumulate"):
        gk.Runtime(devices="cpu", acumulate=2)
    with pytest.raises(ConfigError, match="save_every needs a folder"):
        gk.Runtime(devices="cpu", save_every=4)


def test_metrics_json_records_every_setting_with_the_values_used() -> None:
    rt = gk.Runtime(devices="cpu", seed=5, log_every=3, keep=2)
    config = rt.launch(fit, TrainConfig(workload="mlp", max_steps=2, progress=False))["config"]
    runtime = config["runtime"]
    assert {k: runtime[k] for k in ("seed", "log_every", "keep", "strategy", "oom")} == {
        "seed": 5,
        "log_every": 3,
        "keep": 2,
        "strategy": "single",
        "oom": "raise",
    }
    assert set(runtime) == {f.name for f in s.fields()}
    # The workload's own epochs, batch and learning rate, as used, rather than None.
    assert None not in (config["epochs"], config["batch_size"], config["lr"])
