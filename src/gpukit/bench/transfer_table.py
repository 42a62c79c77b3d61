"""The ``transfer`` experiment's table: one row per copy (with its raw timings), each GPU's
best figures in the summary, and the notes that say how to read them.

Apart from the measuring, so that the figures' bookkeeping (bytes per second, share of the
PCIe peak, which rows count as moving their bytes) can be read and tested on its own.

>>> gbps(12.345e9), gbps(None)
('12.3', '?')
"""

from __future__ import annotations

from typing import Any

from gpukit._util.text import format_bytes
from gpukit.bench.measure import Stats
from gpukit.bench.result import BenchResult, Column

COLUMNS = (
    Column("device"),
    Column("test"),
    Column("memory"),
    Column("mode"),
    Column("size"),
    Column("us", "time", "µs"),
    Column("gbps", "bandwidth", "GB/s", 2),
    Column("pcie_pct", "of PCIe peak", "%", 1),
    Column("note"),
)
KEYS = ("device", "test", "memory", "mode", "size")  # each row also has its "bytes"


def add_row(
    result: BenchResult,
    label: str,
    test: str,
    memory: str,
    mode: str,
    size: int,
    s: Stats,
    peak: float | None = None,
    count: bool = True,
) -> float:
    """Append a row (and its raw timings); returns its bytes per second (0 when ``count`` is
    False: the time is not that of moving ``size`` bytes alone)."""
    bps = size / s.median if count and s.median > 0 else 0.0
    row: dict[str, Any] = {
        "device": label,
        "test": test,
        "memory": memory,
        "mode": mode,
        "bytes": size,
        "size": format_bytes(size),
        "us": s.median * 1e6,
    }
    if bps and "latency" not in test:
        row["gbps"] = bps / 1e9
        row["pcie_pct"] = 100 * bps / peak if peak else None
    result.rows.append(row)
    keys = {k: row[k] for k in KEYS}
    result.raw["stats"].append({**keys, "bytes": size, "stats": s.to_dict()})
    return bps


def summarise(
    result: BenchResult,
    dev: str,
    figures: dict[str, float],
    peak: float | None,
    gain: float | None,
) -> None:
    """Each GPU's best figures in the summary: GB/s, pinned over pageable, share of the PCIe
    peak, latencies and the overlap's gain."""
    s = result.summary
    for key, value in figures.items():
        if key.endswith("_bps"):
            s[f"{dev} {key[:-4].replace('_', ' ')} best GB/s"] = value / 1e9
    for way in ("h2d", "d2h"):
        pinned, pageable = figures.get(f"{way}_pinned_bps"), figures.get(f"{way}_pageable_bps")
        if pinned and pageable:
            s[f"{dev} {way} pinned/pageable ×"] = pinned / pageable
        if pinned and peak:
            s[f"{dev} {way} pinned % of PCIe peak"] = 100 * pinned / peak
    s[f"{dev} PCIe peak GB/s"] = peak / 1e9 if peak else None
    s[f"{dev} h2d latency µs"] = figures["h2d_latency_s"] * 1e6
    s[f"{dev} d2h latency µs"] = figures["d2h_latency_s"] * 1e6
    s[f"{dev} overlap gain ×"] = gain


def gbps(bps: float | None) -> str:
    """GB/s to one decimal, "?" when unknown."""
    return f"{bps / 1e9:.1f}" if bps else "?"


def notes(gpus: bool, latency_batch: int) -> list[str]:
    """How to read the table, with a GPU or without."""
    notes = [
        "time: median of the repeats of one copy of `size` bytes; bandwidth: size / time, in "
        "GB/s (1e9 bytes/s)",
    ]
    if not gpus:
        return [
            *notes,
            "no GPU here: host<->device rows need one; h2h is copy_ between two host tensors "
            "(the host memory's speed: it reads and writes every byte), h2h latency one 4-byte "
            "copy_ (the cost of one torch op)",
        ]
    return [
        *notes,
        "h2d/d2h: pageable copies block (torch stages them through a pinned buffer), pinned "
        "ones are queued with non_blocking=True; both timed with CUDA events",
        "of PCIe peak: over the link's peak in one direction, lanes × per-lane rate at its "
        "best generation (gen3 0.985, gen4 1.969, gen5 3.938 GB/s per lane); packet overhead "
        "keeps the best copies near 80-90% of it",
        "d2d within one GPU reads and writes every byte: its memory moves twice the GB/s shown",
        f"latency: one blocking 4-byte copy as the host waits for it (host clock, batches of "
        f"{latency_batch}); a d2h read-back is one round trip, the least .item() costs",
        "overlap: copy ∥ matmul queues a pinned copy on a side stream and the matmul on the "
        "default one; its note compares it with a blocking copy, then the matmul",
    ]
