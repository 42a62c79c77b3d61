"""What a plan says about where its step time comes from: a datasheet estimate, a
calibration on this machine, or a one-device calibration extrapolated to more devices.

>>> step_time_notes(None, "ddp", 2)[0].startswith("step time: a datasheet estimate")
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpukit.planning.calibrate import Calibration

DATASHEET = (
    "step time: a datasheet estimate (the target's peak FLOP/s at an assumed efficiency, plus "
    "an assumed host overhead), not a measurement; --calibrate (calibration= in gk.plan) "
    "measures a few real steps on this machine"
)


def step_time_notes(calibration: Calibration | None, strategy: str, devices: int) -> list[str]:
    """The plan's notes on its step time's source (see the module doc)."""
    if calibration is None:
        return [DATASHEET]
    where = f"{calibration.device} ({calibration.device_name})"
    if calibration.line(strategy, devices) is not None:
        return [f"step time: calibrated, measured on {where}"]
    return [
        f"step time of {strategy} on {devices} devices: extrapolated from the one-device "
        f"calibration on {where} plus modelled communication (not measured: this machine "
        "has too few devices, or the strategy was not calibrated)"
    ]


__all__ = ["DATASHEET", "step_time_notes"]
