"""The doctor's result: checks with a status and a fix, plus the devices, as a table or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["OK", "WARN", "FAIL"]
SCHEMA_VERSION = 1
_RANK: dict[Status, int] = {"OK": 0, "WARN": 1, "FAIL": 2}


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report. ``fix`` is empty when there is nothing to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class DoctorReport:
    """Every check, the devices torch can use, and what NVML sees."""

    checks: tuple[Check, ...]
    devices: tuple[dict[str, Any], ...] = ()
    nvml: dict[str, Any] = field(default_factory=dict)
    p2p: dict[str, Any] | None = None

    @property
    def status(self) -> Status:
        """The worst status of any check."""
        return max((c.status for c in self.checks), key=_RANK.__getitem__, default="OK")

    @property
    def ok(self) -> bool:
        """True when nothing FAILs: the process exit code is 0 then."""
        return self.status != "FAIL"

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON schema of ``gpukit doctor --json`` (documented in the README)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "checks": [asdict(c) for c in self.checks],
            "devices": list(self.devices),
            "nvml": self.nvml,
            "p2p": self.p2p,
        }
