"""Devices: naming one in every common spelling, the machine's facts, and moving data there.

``device`` (the ``Device`` type, ``device()``, ``devices()``, ``on()``), ``spec`` (parsing every
spelling), ``hw`` (what torch and the OS report: the seam tests replace), ``nvml`` (driver and
per-process facts from NVML) and ``move`` (``to()``: nested data onto a device).

Note that ``gk.devices`` is the function listing the devices; this package is
``importlib.import_module("gpukit.devices")``.
"""

from gpukit.devices.device import SPELLINGS, Device, DeviceSpec, cpu, device, devices, gpu, on
from gpukit.devices.move import move_to, to

__all__ = [
    "SPELLINGS",
    "Device",
    "DeviceSpec",
    "cpu",
    "device",
    "devices",
    "gpu",
    "move_to",
    "on",
    "to",
]
