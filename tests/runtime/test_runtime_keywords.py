"""gk.Runtime's keywords are the settings declared in gpukit.runtime.settings: the same names,
in the same order, with the same defaults, kinds and types, so that the two never drift."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import gpukit as gk
from gpukit.runtime.settings import Settings


def _declared(fn: Callable[..., object]) -> list[tuple[str, object, object, object]]:
    return [
        (p.name, p.default, p.kind, p.annotation)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


def test_the_runtime_keywords_are_the_settings_declaration() -> None:
    runtime = _declared(gk.Runtime.__init__)
    assert runtime == _declared(Settings.__init__)
    assert len(runtime) == 24


def test_the_runtime_keeps_every_keyword_given() -> None:
    rt = gk.Runtime(devices="cpu", seed=3, log_every=7, accumulate=2, clip=1.0)
    assert rt.config == Settings(devices="cpu", seed=3, log_every=7, accumulate=2, clip=1.0)
    assert rt.settings.keywords() == gk.Runtime(**rt.settings.keywords()).config.keywords()
