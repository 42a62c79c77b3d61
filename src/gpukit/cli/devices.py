"""gpukit devices: the devices this process can use, or how one spelling resolves.

Any spelling gpukit accepts works as SPEC: cuda:1, gpu:1, GPU:1, /gpu:1, /device:GPU:1,
/job:localhost/replica:0/task:0/device:GPU:1, 1, cpu, mps, auto. An unknown or missing device
prints what this machine has and exits with code 2.

Example:
    gpukit devices
    gpukit devices --json
    gpukit devices /device:GPU:0
"""

from __future__ import annotations

import argparse
from typing import Any

from gpukit._util.text import format_bytes, make_table
from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.devices.device import Device, device, devices

NAME = "devices"


def register(sub: Any) -> None:
    parser = add_command(sub, NAME, "list devices, or resolve a device spelling", __doc__)
    add_json_flag(parser)
    parser.add_argument("spec", nargs="?", help="a device spelling to resolve, e.g. /gpu:0")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    found = [device(args.spec)] if args.spec is not None else devices()
    if args.json:
        rows: Any = [d.to_dict() for d in found]
        print_json({"spec": args.spec, "device": rows[0]} if args.spec is not None else rows)
        return 0
    title = f"{args.spec!r} is {found[0]}" if args.spec is not None else "Devices"
    console().print(make_table(title, ["device", "name", "memory", "compute"], _rows(found)))
    return 0


def _rows(found: list[Device]) -> list[list[str]]:
    return [
        [
            str(d),
            d.name,
            format_bytes(d.total_memory),
            ".".join(map(str, d.compute_capability)) if d.compute_capability else "-",
        ]
        for d in found
    ]
