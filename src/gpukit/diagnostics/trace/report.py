"""The text of ``Trace.report()``: findings ranked by estimated cost, each with a fix."""

from __future__ import annotations

import contextlib
import linecache
import os
from collections.abc import Sequence

from gpukit._util.text import format_bytes
from gpukit.diagnostics.trace.records import HOST, Sync, Transfer

# Rough costs on a current GPU, only to rank the findings (see Trace.report).
SYNC_S = 30e-6  # one host<->device round trip: 10-50 us stall, and the GPU's queue runs dry
COPY_LAUNCH_S = 10e-6
PAGEABLE_BPS, PINNED_BPS, PEER_BPS = 12e9, 25e9, 50e9


def render(
    ops_per_device: dict[str, int], transfers: Sequence[Transfer], syncs: Sequence[Sync]
) -> str:
    """The report of a trace's records (see ``Trace.report``)."""
    ops = sum(ops_per_device.values())
    found = [_transfer_finding(t) for t in transfers]
    found += [_sync_finding(s) for s in syncs if s.op != "d2h-copy"]
    if not found:
        return f"gk.trace: {ops:,} ops; no host<->device copies or synchronisations found"
    per_dev = ", ".join(f"{d} {n:,}" for d, n in ops_per_device.items())
    waits, copies = sum(s.count for s in syncs), sum(t.count for t in transfers)
    moved = format_bytes(sum(t.bytes for t in transfers))
    lines = [
        f"gk.trace: {ops:,} ops ({per_dev}); synchronisations: {waits:,}; "
        f"copies: {copies:,} ({moved})",
        "ranked by estimated cost on a GPU (30 us per sync; copies 10 us + 12 GB/s "
        "pageable, 25 GB/s pinned); [potential]: ran on the CPU, would wait on a GPU",
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


def _sync_finding(s: Sync) -> tuple[float, str, str, str]:
    label, fix = _SYNC_TEXT.get(s.op, (s.op, _READ_BACK))
    mark = "" if s.synchronised else " [potential]"
    what = f"{label} {_times(s.count)} at {_where(s.file, s.line, s.function)} ({s.device}){mark}"
    return s.count * SYNC_S, what, _code(s.file, s.line), fix


def _transfer_finding(t: Transfer) -> tuple[float, str, str, str]:
    rate = PEER_BPS if t.kind == "d2d" else PINNED_BPS if t.pinned else PAGEABLE_BPS
    cost = t.count * (COPY_LAUNCH_S + (SYNC_S if t.kind == "d2h" and t.blocking else 0))
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
