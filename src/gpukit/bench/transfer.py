"""``transfer``: how fast data moves between the host and each GPU, and what a copy costs.

On each GPU, for sizes of 4 KiB to 1 GiB (quick: to 16 MiB), each ×4 the one before:

- ``h2d`` / ``d2h``: host to device and back, from or into **pageable** memory (what a plain
  tensor lives in, and what ``tensor.to("cuda")`` copies from: torch stages it through a
  pinned buffer, blocking the host) and **pinned** (page-locked) memory, which the GPU's copy
  engine reads directly, queued with ``non_blocking=True``; CUDA events time the copy on the
  GPU's stream;
- ``d2d``: to the next GPU given (two or more), on the host clock between synchronisations of
  both; with one GPU, between two buffers of the same GPU;
- ``latency``: one blocking 4-byte copy each way, as the host waits for it (host clock, the
  median of batches of :data:`LATENCY_BATCH`): a d2h read-back is one round trip, the least
  that ``.item()`` costs;
- ``overlap``: a pinned h2d copy on a side stream while a float32 matmul runs on the default
  stream, against a blocking copy then the matmul (the copy sized to last about as long as
  the matmul, where overlapping can at best halve the time); the gain is their ratio;
- ``of PCIe peak``: GB/s over the link's per-direction peak (NVML: lanes × per-lane rate).

On the CPU: the bandwidth of ``copy_`` between two host tensors (the host's memory speed) and
the latency of a 4-byte ``copy_`` (the cost of one torch op); host<->device rows need a GPU.

Each GPU's best figures are kept for ``gk.trace``'s report (:mod:`gpukit.devices.measured`);
``remember=False`` keeps nothing. GB/s are 1e9 bytes per second.

>>> [format_bytes(s) for s in SIZES][::3]
['4 KiB', '256 KiB', '16 MiB', '1 GiB']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit._util.text import format_bytes
from gpukit.bench.environment import environment_of
from gpukit.bench.measure import Stats, check_devices, device_name, measure, stats
from gpukit.bench.plotting import figure, size_axes
from gpukit.bench.result import BenchResult
from gpukit.bench.transfer_table import COLUMNS, KEYS, add_row, gbps, notes, summarise
from gpukit.devices import hw as _hw
from gpukit.devices import measured, nvml
from gpukit.diagnostics.oom_message import OOM_ERROR

TITLE = "transfer: host<->device copies (pageable, pinned), device<->device, latency, overlap"

KiB, MiB = 1024, 1024**2
SIZES = tuple(4 * KiB * 4**k for k in range(10))  # 4 KiB .. 1 GiB
QUICK_SIZES = SIZES[:7]  # 4 KiB .. 16 MiB
POOL, POOL_UP_TO = 4, 16 * MiB  # buffers the repeats rotate through, for sizes up to this
LATENCY_BATCH = 100  # tiny copies per timed call: one host clock read per copy is too coarse
FULL = {"repeats": 30, "min_repeats": 5, "budget_s": 1.0}
QUICK = {"repeats": 10, "min_repeats": 3, "budget_s": 0.1}
OVERLAP_N = {True: 2048, False: 4096}  # the matmul's side, quick and full


def run(
    quick: bool = False, devices: Sequence[torch.device] | None = None, remember: bool = True
) -> BenchResult:
    """Measure the copies of every device in ``devices`` (default: the CPU and every GPU);
    with ``remember``, keep each GPU's figures for ``gk.trace``. See the module docstring."""
    chosen = check_devices(devices, "transfer")
    sizes = QUICK_SIZES if quick else SIZES
    timing = QUICK if quick else FULL
    gpus = [d for d in chosen if d.type == "cuda"]
    result = BenchResult(
        experiment="transfer",
        title=TITLE,
        keys=KEYS,
        columns=COLUMNS,
        notes=notes(bool(gpus), LATENCY_BATCH),
        parameters={
            "sizes": list(sizes),
            "quick": quick,
            **timing,
            "pool": POOL,
            "pool_up_to": POOL_UP_TO,
            "latency_batch": LATENCY_BATCH,
            "overlap_n": OVERLAP_N[quick],
            "remember": remember,
        },
        environment=environment_of(chosen),
        raw={"stats": []},
    )
    for dev in chosen:
        if dev.type == "cuda":
            peer = gpus[(gpus.index(dev) + 1) % len(gpus)] if len(gpus) > 1 else None
            _gpu(result, dev, peer, sizes, timing, quick, remember)
        else:
            _host(result, dev, sizes, timing)
    return result


def _host(
    result: BenchResult, dev: torch.device, sizes: Sequence[int], timing: dict[str, Any]
) -> None:
    """Copies between two host tensors, and the latency of a tiny one."""
    label, best = device_name(dev), 0.0
    for size in sizes:
        pool = POOL if size <= POOL_UP_TO else 1
        if not _fits(result, dev, size, 2 * pool):
            break
        # ones/zeros touch every page, so no page fault lands on the clock.
        pairs = [
            (torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8))
            for _ in range(pool)
        ]
        s = measure(lambda p: p[1].copy_(p[0]), dev, inputs=pairs, **timing)
        del pairs
        best = max(best, add_row(result, label, "h2h", "pageable", "blocking", size, s))
    src, dst = torch.ones(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    tiny = _latency(lambda: dst.copy_(src), dev, timing)
    add_row(result, label, "h2h latency", "pageable", "blocking", 4, tiny)
    result.summary[f"{dev} h2h best GB/s"] = best / 1e9
    result.summary[f"{dev} h2h latency µs"] = tiny.median * 1e6


def _gpu(
    result: BenchResult,
    dev: torch.device,
    peer: torch.device | None,
    sizes: Sequence[int],
    timing: dict[str, Any],
    quick: bool,
    remember: bool,
) -> None:
    """Every measurement of one GPU (see the module docstring), its summary and its store."""
    label, short = device_name(dev), str(dev)
    props = _hw.cuda_properties(dev.index if dev.index is not None else _hw.cuda_current())
    link = nvml.pcie_link(props.uuid) if props.uuid else None
    peak = link.peak_bps() if link is not None else None
    best: dict[str, float] = {}
    with torch.cuda.device(dev):
        for size in sizes:
            try:
                if not _bandwidths(result, dev, peer, size, timing, peak, best):
                    break
            except OOM_ERROR:  # torch.OutOfMemoryError from torch 2.5
                result.notes.append(
                    f"{label}: sizes from {format_bytes(size)} skipped: out of GPU memory"
                )
                break
            finally:
                _free()
        host, on_dev = torch.ones(1), torch.zeros(1, device=dev)  # 4 bytes, pageable
        h2d = _latency(lambda: on_dev.copy_(host), dev, timing)
        d2h = _latency(lambda: host.copy_(on_dev), dev, timing)
        add_row(result, label, "h2d latency", "pageable", "blocking", 4, h2d)
        add_row(result, label, "d2h latency", "pageable", "blocking", 4, d2h)
        gain = _overlap(result, dev, best.get("h2d pinned"), sizes[-1], timing, quick)
        _free()
    if peak and max(best.get("h2d pinned", 0.0), best.get("d2h pinned", 0.0)) > 1.1 * peak:
        # Faster than the PCIe link can carry: the host link is another (NVLink-C2C).
        result.notes.append(
            f"{label}: copies beat the {gbps(peak)} GB/s of its PCIe link, so "
            "they do not take it (NVLink-C2C?): no share of its peak"
        )
        peak = None
        for row in result.rows:
            if row["device"] == label:
                row["pcie_pct"] = None
    elif link is not None:
        result.notes.append(f"{label}: {link.describe()}, {gbps(peak)} GB/s each way at best")
    else:
        result.notes.append(f"{label}: PCIe link unknown (no NVML): no share of its peak")
    if peer is not None:
        direct = torch.cuda.can_device_access_peer(dev, peer)
        access = "direct" if direct else "none, the copies go through host memory"
        result.notes.append(f"{label} -> {peer}: peer access {access}")
    figures = {f"{k.replace(' ', '_')}_bps": v for k, v in best.items()}
    figures.update(h2d_latency_s=h2d.median, d2h_latency_s=d2h.median)
    summarise(result, short, figures, peak, gain)
    if remember:
        _remember(result, props.name, figures, quick)


def _bandwidths(
    result: BenchResult,
    dev: torch.device,
    peer: torch.device | None,
    size: int,
    timing: dict[str, Any],
    peak: float | None,
    best: dict[str, float],
) -> bool:
    """One size's h2d, d2h and d2d rows; False (and a note) when it does not fit in memory."""
    label = device_name(dev)
    pool = POOL if size <= POOL_UP_TO else 1
    fits = _fits(result, torch.device("cpu"), size, 2 * pool) and _fits(result, dev, size, 2 * pool)
    if not fits:
        return False
    # Host buffers are written once, so no page fault lands on the clock; pin_memory is only
    # ever asked for here, on a machine with a GPU (a CPU-only build cannot pin).
    pageable = [torch.ones(size, dtype=torch.uint8) for _ in range(pool)]
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(pool)]
    on_dev = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(pool)]
    there = peer or dev
    other = [torch.empty(size, dtype=torch.uint8, device=there) for _ in range(pool)]
    d2d = "to " + str(peer) if peer is not None else "within"

    def copy(p: tuple[torch.Tensor, torch.Tensor]) -> None:
        p[1].copy_(p[0])

    def queue(p: tuple[torch.Tensor, torch.Tensor]) -> None:
        p[1].copy_(p[0], non_blocking=True)

    variants: list[tuple[str, str, str, Callable[[Any], None], list[Any]]] = [
        ("h2d", "pageable", "blocking", copy, list(zip(pageable, on_dev, strict=True))),
        ("h2d", "pinned", "non_blocking", queue, list(zip(pinned, on_dev, strict=True))),
        ("d2h", "pageable", "blocking", copy, list(zip(on_dev, pageable, strict=True))),
        ("d2h", "pinned", "non_blocking", queue, list(zip(on_dev, pinned, strict=True))),
        ("d2d", d2d, "queued", copy, list(zip(on_dev, other, strict=True))),
    ]
    for test, memory, mode, work, pairs in variants:
        if test == "d2d" and peer is not None:
            # The copy runs on the source GPU's stream and is waited for on both GPUs.
            s = measure(work, [dev, peer], inputs=pairs, clock="host", **timing)
        else:
            s = measure(work, dev, inputs=pairs, clock="events", **timing)
        bps = add_row(result, label, test, memory, mode, size, s, peak if test != "d2d" else None)
        key = f"{test} {memory}" if test != "d2d" else ("d2d peer" if peer else "d2d local")
        best[key] = max(best.get(key, 0.0), bps)
    return True  # the buffers go with this frame, before the caller empties the cache


def _overlap(
    result: BenchResult,
    dev: torch.device,
    pinned_bps: float | None,
    largest: int,
    timing: dict[str, Any],
    quick: bool,
) -> float | None:
    """The overlap rows; returns the gain (one after the other / overlapped)."""
    label, n = device_name(dev), OVERLAP_N[quick]
    if not pinned_bps:
        return None
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    c = torch.empty(n, n, device=dev)
    product = measure(lambda _: torch.mm(a, b, out=c), dev, clock="host", **timing)
    # A copy as long as the product: where overlapping gains the most (at best 2x).
    size = min(max(MiB, round(pinned_bps * product.median / MiB) * MiB), largest)
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    side, main = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)

    def one_after_the_other(_: object) -> None:
        dst.copy_(src)  # blocking: the host waits for the copy before it queues the product
        torch.mm(a, b, out=c)

    def overlapped(_: object) -> None:
        side.wait_stream(main)  # nothing queued before on the main stream may still use dst
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        torch.mm(a, b, out=c)
        main.wait_stream(side)  # what the main stream queues next sees the copied data

    copy = measure(lambda _: dst.copy_(src, non_blocking=True), dev, clock="host", **timing)
    serial = measure(one_after_the_other, dev, clock="host", **timing)
    both = measure(overlapped, dev, clock="host", **timing)
    gain = serial.median / both.median
    ideal = (copy.median + product.median) / max(copy.median, product.median)
    add_row(result, label, "overlap", "pinned", f"matmul {n}² alone", size, product, count=False)
    add_row(result, label, "overlap", "pinned", "copy alone", size, copy)
    add_row(result, label, "overlap", "pinned", "copy, then matmul", size, serial, count=False)
    add_row(result, label, "overlap", "pinned", "copy ∥ matmul", size, both, count=False)
    result.rows[-1]["note"] = f"{gain:.2f}× faster than one after the other (at best {ideal:.2f}×)"
    result.summary[f"{dev} overlap at best ×"] = ideal
    return gain  # the tensors go with this frame, before the caller empties the cache


def _latency(copy: Callable[[], object], dev: torch.device, timing: dict[str, Any]) -> Stats:
    """Seconds of one blocking tiny copy, timed in batches on the host clock."""

    def batch(_: object) -> None:
        for _ in range(LATENCY_BATCH):
            copy()

    s = measure(batch, dev, clock="host", **timing)
    return stats([v / LATENCY_BATCH for v in s.raw])


def _remember(result: BenchResult, name: str, figures: dict[str, float], quick: bool) -> None:
    """Keep ``figures`` for gk.trace, unless a quick run would replace those of a full one.
    A store that cannot be written costs a note, never the measurements."""
    kept = measured.load(name)
    if quick and kept is not None and not kept["quick"]:
        result.notes.append(
            f"{name}: kept the figures of the full run of {kept['date'][:10]} "
            "for gk.trace (a quick run does not replace them)"
        )
        return
    try:
        where = measured.save(name, figures, quick=quick)
    except OSError as err:
        result.notes.append(
            f"{name}: could not keep these figures for gk.trace ({err}); it "
            "ranks with its rough costs, and nothing here is lost"
        )
        return
    result.notes.append(f"{name}: figures kept in {where} for gk.trace's cost estimates")


def _fits(result: BenchResult, dev: torch.device, size: int, buffers: int) -> bool:
    """Whether ``buffers`` buffers of ``size`` take at most half the memory available on the
    host, and on ``dev`` if it is a GPU (a note says which sizes are skipped if not)."""
    free = _hw.ram_available() if dev.type == "cpu" else torch.cuda.mem_get_info(dev)[0]
    if free is None or size * buffers <= free // 2:
        return True
    where = "host memory" if dev.type == "cpu" else "GPU memory"
    result.notes.append(
        f"{device_name(dev)}: sizes from {format_bytes(size)} skipped: {buffers} "
        f"buffers of that size need over half the {format_bytes(free)} of "
        f"{where} available"
    )
    return False


def _free() -> None:
    """Give the cached device memory back (and the pinned host memory, where torch can), so
    each size starts from the same free memory."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty_host is not None:
        empty_host()


def plot(result: BenchResult, path: Path) -> None:
    """Bandwidth against copy size, one line per device, direction and memory (dashed:
    pageable); dotted: each GPU's PCIe peak."""
    rows = [r for r in result.rows if r.get("gbps") and r["test"] in ("h2d", "d2h", "d2d", "h2h")]
    sizes = sorted({r["bytes"] for r in rows})
    with figure(
        path,
        "transfer: bandwidth of one copy against its size",
        "copy size",
        "bandwidth (GB/s, log scale)",
    ) as ax:
        groups = dict.fromkeys((r["device"], r["test"], r["memory"]) for r in rows)
        for device, test, memory in groups:
            mine = sorted(
                (r["bytes"], r["gbps"])
                for r in rows
                if (r["device"], r["test"], r["memory"]) == (device, test, memory)
            )
            style = "--" if memory == "pageable" and test != "h2h" else "-"
            short = device.split(" (")[0]
            ax.plot(
                *zip(*mine, strict=True),
                marker="o",
                ms=3,
                linestyle=style,
                label=f"{short} {test} {memory}",
            )
        for key, value in result.summary.items():
            if key.endswith("PCIe peak GB/s") and value:
                ax.axhline(value, linestyle=":", color="grey", linewidth=1)
                ax.annotate(
                    f"{key.split()[0]} PCIe peak",
                    (sizes[0] if sizes else 1, value),
                    fontsize=7,
                    va="bottom",
                    color="grey",
                )
        size_axes(ax, sizes, [format_bytes(s) for s in sizes])
        ax.tick_params(axis="x", labelrotation=30)
