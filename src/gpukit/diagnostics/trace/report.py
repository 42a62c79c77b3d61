"""The text of ``Trace.report()``: findings ranked by estimated cost, each with a fix.

The costs come from a :class:`CostModel`: the figures ``gpukit bench transfer`` measured on
this machine for the GPU the trace saw (kept by :mod:`gpukit.devices.measured`), else rough
constants of a current GPU. Either way they rank the findings; they do not predict a run.
"""

from __future__ import annotations

import contextlib
import linecache
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpukit._util.text import format_bytes
from gpukit.devices import hw as _hw
from gpukit.devices import measured
from gpukit.diagnostics.trace.records import HOST, Sync, Transfer

# Rough costs on a current GPU, only to rank the findings where nothing was measured here.
SYNC_S = 30e-6  # one host<->device round trip: 10-50 us stall, and the GPU's queue runs dry
COPY_LAUNCH_S = 10e-6
PAGEABLE_BPS, PINNED_BPS, PEER_BPS = 12e9, 25e9, 50e9


@dataclass(frozen=True)
class CostModel:
    """What one synchronisation and one copy cost, to rank a trace's findings.

    ``gpu`` and ``date`` say whose measured figures these are; both None for the rough
    defaults.

    >>> CostModel().rate("h2d", pinned=True) / 1e9, CostModel().measured
    (25.0, False)
    """

    sync_s: float = SYNC_S
    copy_launch_s: float = COPY_LAUNCH_S
    h2d_pageable_bps: float = PAGEABLE_BPS
    h2d_pinned_bps: float = PINNED_BPS
    d2h_pageable_bps: float = PAGEABLE_BPS
    d2h_pinned_bps: float = PINNED_BPS
    peer_bps: float = PEER_BPS
    gpu: str | None = None
    date: str | None = None

    @property
    def measured(self) -> bool:
        """Whether these are figures measured on this machine."""
        return self.gpu is not None

    def rate(self, kind: str, pinned: bool) -> float:
        """Bytes per second of a copy of ``kind`` (h2d, d2h, d2d) from or to pinned memory."""
        if kind == "d2d":
            return self.peer_bps
        if kind == "d2h":
            return self.d2h_pinned_bps if pinned else self.d2h_pageable_bps
        return self.h2d_pinned_bps if pinned else self.h2d_pageable_bps

    def describe(self) -> str:
        """The header's account of the costs: where they come from, then the figures.

        >>> print(CostModel().describe())
        rough defaults (30 us per sync; copies 10 us + 12 GB/s pageable, 25 GB/s pinned; ...
        """
        figures = (
            f"{self.sync_s * 1e6:.0f} us per sync; copies {self.copy_launch_s * 1e6:.0f} us + "
            f"{self.h2d_pageable_bps / 1e9:.3g} GB/s pageable, "
            f"{self.h2d_pinned_bps / 1e9:.3g} GB/s pinned"
        )
        if not self.measured:
            return f"rough defaults ({figures}; `gpukit bench transfer` measures this machine's)"
        return f"figures of {self.gpu} measured on this machine {self.date} ({figures})"


# Measured figure -> the CostModel field it replaces.
_FIELDS = {
    "d2h_latency_s": "sync_s",  # a blocking tiny read-back is one round trip
    "h2d_latency_s": "copy_launch_s",
    "h2d_pageable_bps": "h2d_pageable_bps",
    "h2d_pinned_bps": "h2d_pinned_bps",
    "d2h_pageable_bps": "d2h_pageable_bps",
    "d2h_pinned_bps": "d2h_pinned_bps",
    "d2d_peer_bps": "peer_bps",
}


def cost_model(ops_per_device: dict[str, int], transfers: Sequence[Transfer]) -> CostModel:
    """The figures measured on this machine for the GPU the trace saw (the first CUDA device
    among its ops and copies, else the first GPU present if CUDA has started), where
    ``gpukit bench transfer`` kept some; the rough defaults otherwise. Never raises."""
    try:
        name = _gpu_name([*ops_per_device, *(d for t in transfers for d in (t.src, t.dst))])
        entry = measured.load(name) if name is not None else None
    except Exception:  # a broken GPU or store must not cost the user the report
        return CostModel()
    if entry is None:
        return CostModel()
    found = {_FIELDS[k]: v for k, v in entry["figures"].items() if k in _FIELDS}
    date = entry["date"][:10] or "(undated)"
    return CostModel(**found, gpu=name, date=date)


def _gpu_name(devices: Sequence[str]) -> str | None:
    count = _hw.cuda_count()
    seen = next((d for d in devices if d == "cuda" or d.startswith("cuda:")), None)
    index = 0  # the first GPU present, when the trace saw none
    if seen is not None:
        index = int(seen.split(":")[1]) if ":" in seen else _hw.cuda_current()
    elif not torch.cuda.is_initialized():
        # Reading a GPU's name starts CUDA: a report must not (a second and hundreds of MiB
        # on the GPU, and no fork of this process may use CUDA after it).
        return None
    return _hw.cuda_properties(index).name if index < count else None


def render(
    ops_per_device: dict[str, int],
    transfers: Sequence[Transfer],
    syncs: Sequence[Sync],
    model: CostModel | None = None,
) -> str:
    """The report of a trace's records (see ``Trace.report``), costed with ``model`` (by
    default :func:`cost_model` of the records)."""
    ops = sum(ops_per_device.values())
    model = model if model is not None else cost_model(ops_per_device, transfers)
    found = [_transfer_finding(t, model) for t in transfers]
    found += [_sync_finding(s, model) for s in syncs if s.op != "d2h-copy"]
    if not found:
        return f"gk.trace: {ops:,} ops; no host<->device copies or synchronisations found"
    per_dev = ", ".join(f"{d} {n:,}" for d, n in ops_per_device.items())
    waits, copies = sum(s.count for s in syncs), sum(t.count for t in transfers)
    moved = format_bytes(sum(t.bytes for t in transfers))
    lines = [
        f"gk.trace: {ops:,} ops ({per_dev}); synchronisations: {waits:,}; "
        f"copies: {copies:,} ({moved})",
        f"ranked by estimated cost on a GPU, from {model.describe()}; "
        "[potential]: ran on the CPU, would wait on a GPU",
    ]
    if set(ops_per_device) <= {HOST}:
        lines.append("every op ran on the CPU: copies a GPU run would make are not seen")
    found.sort(key=lambda f: -f[0])
    for i, (cost, what, code, fix) in enumerate(found, 1):
        cost_text = f"{cost * 1e3:.1f} ms" if cost >= 1e-3 else f"{cost * 1e6:.0f} us"
        lines.append(f"{i:2}. ~{cost_text}  {what}")
        lines += [f"      `{code}`"] if code else []
        lines.append(f"      fix: {fix}")
    return "\n".join(lines)


_READ_BACK = "keep it on the device and read it back every N steps: rt.log(loss=loss)"
_DECIDE = "decide on the device (torch.where, masks, (a == b).all()) or check every N steps"
_SYNC_TEXT = {  # op -> (what the user wrote, the fix)
    "item": (".item()", _READ_BACK),
    "float": ("float(tensor)", _READ_BACK),
    "int": (
        "int(tensor)",
        "a count or a size: compute it with Python ints; a result: " + _READ_BACK,
    ),
    "index": (
        "tensor used as a Python index (list/numpy indexing, slice bounds, range)",
        "index with a Python int (draw indices with random.randrange, or .tolist() them in one "
        "read), or keep the indexing on the device: x[idx] with a tensor idx",
    ),
    "tolist": (
        ".tolist()",
        "keep results on the device and read them back every N steps, in one batch (rt.log)",
    ),
    "numpy": (
        ".numpy()",
        "keep the data in tensors on the device; convert once at the end, not every step",
    ),
    "bool": ("bool(tensor) / `if tensor:`", _DECIDE),
    "equal": ("torch.equal", _DECIDE),
    "allclose": ("torch.allclose", _DECIDE),
    "print": (
        "print/str/f-string of a tensor",
        "log less often: print every N steps, or rt.log(loss=loss), which reads back in batches",
    ),
    "synchronize": ("synchronize()", "remove it outside timing code; time with CUDA Events"),
    "nonzero": (
        ".nonzero() / torch.where(cond)",
        "its size depends on the data, so the host waits for it: torch.nonzero_static(x, "
        "size=k), or compute it once outside the loop",
    ),
    "mask-index": (
        "boolean-mask indexing x[mask]",
        "its size depends on the mask, so the host waits for it: for a mask that is the same "
        "every step, index with a precomputed index (idx = mask.nonzero(as_tuple=True) once, "
        "then x[idx]); otherwise keep shapes static: torch.where(mask, x, 0), (x * mask).sum()",
    ),
    "unique": (
        "torch.unique",
        "its size depends on the data, so the host waits for it: compute it once outside the "
        "loop, or count known values with fixed shapes ((x == values[:, None]).sum(1))",
    ),
    "repeat_interleave": (
        "repeat_interleave without output_size",
        "pass output_size= (the total, known on the host) so the host does not wait for it",
    ),
}


def _sync_finding(s: Sync, model: CostModel) -> tuple[float, str, str, str]:
    label, fix = _SYNC_TEXT.get(s.op, (s.op, _READ_BACK))
    mark = "" if s.synchronised else " [potential]"
    what = f"{label} {_times(s.count)} at {_where(s.file, s.line, s.function)} ({s.device}){mark}"
    return s.count * model.sync_s, what, _code(s.file, s.line), fix


def _transfer_finding(t: Transfer, model: CostModel) -> tuple[float, str, str, str]:
    rate = model.rate(t.kind, t.pinned)
    # A blocking read-back is one round trip (which includes its launch); others a launch.
    cost = t.count * (model.sync_s if t.kind == "d2h" and t.blocking else model.copy_launch_s)
    memory = "" if t.kind == "d2d" else ", pinned" if t.pinned else ", pageable"
    what = (
        f"{t.kind} {format_bytes(t.bytes // t.count)} {_times(t.count)} "
        f"({'blocking' if t.blocking else 'non-blocking'}{memory}, {t.src} -> {t.dst}) "
        f"at {_where(t.file, t.line, t.function)}"
    )
    if t.kind == "h2d" and not t.pinned:
        fix = (
            "pin host memory (DataLoader(pin_memory=True) or tensor.pin_memory()) and copy with "
            "non_blocking=True, or let rt.setup(loader) do it"
        )
    elif t.kind == "h2d":
        fix = "copy with non_blocking=True to overlap compute" if t.blocking else _ONCE
    elif t.kind == "d2h" and t.blocking:
        fix = "the host waits: keep results on the device, read them every N steps in one batch"
    elif t.kind == "d2h":
        fix = "asynchronous: read the host copy only after an Event or stream synchronize"
    else:
        fix = "operands on different GPUs: check gk.placement(model) and keep them together"
    return cost + t.bytes / rate, what, _code(t.file, t.line), fix


_ONCE = "pinned and asynchronous already; if the data is the same each step, move it once"


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n:,} times"


def _where(file: str, line: int, function: str) -> str:
    with contextlib.suppress(ValueError):  # on another drive (Windows): keep it absolute
        relative = os.path.relpath(file)
        file = file if relative.startswith("..") else relative
    return f"{file}:{line} in {function}"


def _code(file: str, line: int) -> str:
    text = linecache.getline(file, line).strip()
    return text if len(text) <= 90 else text[:87] + "..."
