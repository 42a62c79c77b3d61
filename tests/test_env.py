"""The environment variables gpukit reads: numbers in ASCII digits only."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import gpukit as gk
from gpukit import _env

READERS: list[tuple[str, Callable[[], object], object]] = [
    ("GPUKIT_RENDEZVOUS_TIMEOUT", _env.rendezvous_timeout, 30.0),
    ("GPUKIT_RENDEZVOUS_LAST_CALL", _env.rendezvous_last_call, 30.0),
    ("GPUKIT_COLLECTIVE_CHECK_TIMEOUT", _env.collective_check_timeout, 30.0),
    ("GPUKIT_FAULT_OOM_ABOVE", _env.fault_oom_above, 30),
    ("GPUKIT_ATTEMPT", _env.attempt, 30),
]


@pytest.mark.parametrize(("name", "read", "thirty"), READERS, ids=[r[0] for r in READERS])
@pytest.mark.parametrize(
    ("value", "shown"),
    [("٣٠", "'٣' (U+0663)"), ("３０", "'３' (U+FF13)"), ("3²", "'²' (U+00B2)"), ("3０", "U+FF10")],
    ids=["arabic-indic", "full-width", "superscript", "mixed"],
)
def test_a_number_in_other_digits_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    read: Callable[[], object],
    thirty: object,
    value: str,
    shown: str,
) -> None:
    """int() and float() read every script's digits: '٣٠' would silently be 30, '²' a crash."""
    monkeypatch.setenv(name, value)
    with pytest.raises(gk.ConfigError) as caught:
        read()
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r} holds characters other than ASCII")
    assert shown in message and "ASCII digits 0-9" in message
    monkeypatch.setenv(name, "30")
    assert read() == thirty
