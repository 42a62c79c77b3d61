"""``matmul``: how fast one square matrix product runs on the CPU and on each GPU, per dtype
and size, and from which size a GPU beats the CPU, with and without the copies to it.

For each n (powers of two, 16 to 8192; quick: 16 to 1024), C = A @ B with A and B n×n:

- ``time``: the median of the repeats (see :mod:`gpukit.bench.measure`) of one product on
  inputs already on the device, rotating through a pool of distinct (A, B) pairs and writing
  into one preallocated C, so neither a cache nor the allocator flatters the figure; a GPU's
  stream is timed with CUDA events, so a tiny product's time includes its launch;
- ``TFLOP/s``: 2n³ / time (one product is n³ multiply-adds);
- ``% of peak``: that over the GPU's published dense peak for the dtype
  (:func:`gpukit.workloads.flops.peak_flops`); "-" on the CPU, whose peak gpukit does not
  know, and on a GPU missing from that table;
- ``with copies`` (each GPU, fp32): A and B copied from pageable host memory, the product, and
  C copied back, on the host clock: what offloading one product from a CPU program costs.

dtypes: fp32 on every device (on a GPU with TF32 off, whatever the process had set); on a GPU
also tf32 (float32 tensors multiplied on the tensor cores: ``allow_tf32`` is set only while
measuring, then restored), bf16 (compute capability 8.0 and later) and fp16.

A sweep stops before a size whose product would take more than :data:`CAP_S` seconds (the time
of the size before, times the ratio of the n³): an 8192-square product takes half a minute on
a 2-core CPU. Such sizes are rows marked skipped, with the reason, and a note.

>>> crossover({16: 1.0, 32: 2.0, 64: 8.0}, {16: 5.0, 32: 1.0, 64: 1.0})
32
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.measure import Stats, check_devices, device_name, measure
from gpukit.bench.plotting import figure, size_axes
from gpukit.bench.result import BenchResult, Column
from gpukit.devices import hw as _hw
from gpukit.diagnostics.oom_message import OOM_ERROR
from gpukit.errors import ConfigError
from gpukit.workloads.flops import peak_flops

TITLE = "matmul: n×n @ n×n products per device and dtype: time, TFLOP/s, share of peak"

SIZES = tuple(2**k for k in range(4, 14))  # 16 .. 8192
QUICK_SIZES = tuple(2**k for k in range(4, 11))  # 16 .. 1024
CAP_S = 5.0  # seconds of one product beyond which a sweep stops
# Distinct (A, B) pairs the repeats rotate through: enough to leave the caches of a small
# problem cold, few enough that an 8192-square fp32 pool (256 MiB a matrix) stays small.
POOL_SMALL, POOL_LARGE, LARGE_N = 4, 2, 2048
FULL = {"repeats": 30, "min_repeats": 3, "budget_s": 2.0}
QUICK = {"repeats": 10, "min_repeats": 3, "budget_s": 0.2}
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
AMPERE = (8, 0)  # the first compute capability with tf32 and bf16 tensor cores

COLUMNS = (
    Column("device"),
    Column("dtype"),
    Column("n"),
    Column("ms", "time", "ms"),
    Column("tflops", "TFLOP/s"),
    Column("peak_pct", "of peak", "%", 1),
    Column("ms_with_copies", "with copies", "ms"),
    Column("tflops_with_copies", "TFLOP/s with copies"),
    Column("note"),
)


def run(quick: bool = False, devices: Sequence[torch.device] | None = None) -> BenchResult:
    """Time the products on ``devices`` (default: the CPU and every GPU); see the module
    docstring for what each row holds. ConfigError for a device this machine lacks."""
    chosen = check_devices(devices, "matmul")
    sizes = QUICK_SIZES if quick else SIZES
    timing = QUICK if quick else FULL
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    notes = _notes()
    dtypes = {str(dev): dtypes_of(dev, notes) for dev in chosen}
    for dev in chosen:
        for dtype in dtypes[str(dev)]:
            _sweep(dev, dtype, sizes, timing, rows, raw, notes)
    return BenchResult(
        experiment="matmul",
        title=TITLE,
        keys=("device", "dtype", "n"),
        columns=COLUMNS,
        rows=rows,
        summary=summarise(rows, chosen),
        notes=notes,
        parameters={
            "sizes": list(sizes),
            "dtypes": dtypes,
            "quick": quick,
            **timing,
            "pool": {"n < 2048": POOL_SMALL, "n >= 2048": POOL_LARGE},
            "cap_s": CAP_S,
        },
        environment=environment_of(chosen),
        raw={"stats": raw},
    )


def dtypes_of(dev: torch.device, notes: list[str]) -> list[str]:
    """The dtypes measured on ``dev``; a note for those a GPU lacks."""
    if dev.type != "cuda":
        return ["fp32"]
    props = _hw.cuda_properties(_index(dev))
    if props.capability >= AMPERE:
        return ["fp32", "tf32", "bf16", "fp16"]
    major, minor = props.capability
    notes.append(
        f"{dev} ({props.name}): tf32 and bf16 not measured: their tensor cores need compute "
        f"capability 8.0 (Ampere) or later, this GPU has {major}.{minor}"
    )
    return ["fp32", "fp16"]


def _sweep(
    dev: torch.device,
    dtype: str,
    sizes: Sequence[int],
    timing: dict[str, Any],
    rows: list[dict[str, Any]],
    raw: list[dict[str, Any]],
    notes: list[str],
) -> None:
    """One row per size of ``dtype`` on ``dev``, in increasing n, until a product would take
    longer than CAP_S or the device runs out of memory (the larger sizes are then skipped)."""
    label = device_name(dev)
    peak = peak_flops(_hw.cuda_properties(_index(dev)).name, dtype) if dev.type == "cuda" else None
    expected, stopped = 0.0, ""
    for i, n in enumerate(sizes):
        row: dict[str, Any] = {"device": label, "dtype": dtype, "n": n}
        rows.append(row)
        if not stopped and expected > CAP_S:
            stopped = f"skipped: one product would take ~{expected:.0f} s (over {CAP_S:g} s)"
            notes.append(
                f"{label} {dtype}: n >= {n} skipped: one product would take ~{expected:.0f} s "
                f"(the n={sizes[i - 1]} time × {n}³/{sizes[i - 1]}³), over the {CAP_S:g} s "
                "a sweep allows"
            )
        if stopped:
            row["note"] = stopped
            continue
        # A product of over half a second needs no second warm-up to reach its steady state.
        warmup = 1 if expected > 0.5 else 2
        try:
            stats = _time_product(dev, dtype, n, timing, warmup)
            offload = (
                _time_offload(dev, n, timing, warmup)
                if dev.type == "cuda" and dtype == "fp32"
                else None
            )
        except OOM_ERROR:  # torch.OutOfMemoryError from torch 2.5
            stopped = f"skipped: out of memory from n={n}"
            notes.append(f"{label} {dtype}: n >= {n} skipped: the device ran out of memory")
            row["note"] = stopped
            continue
        finally:
            _free(dev)  # the inputs went with the timing functions' frames
        flops = 2.0 * n**3
        row["ms"] = stats.median * 1e3
        row["tflops"] = flops / stats.median / 1e12
        row["peak_pct"] = 100 * flops / stats.median / peak if peak else None
        raw.append(
            {
                "device": label,
                "dtype": dtype,
                "n": n,
                "variant": "on device",
                "stats": stats.to_dict(),
            }
        )
        if offload is not None:
            row["ms_with_copies"] = offload.median * 1e3
            row["tflops_with_copies"] = flops / offload.median / 1e12
            raw.append(
                {
                    "device": label,
                    "dtype": dtype,
                    "n": n,
                    "variant": "with copies",
                    "stats": offload.to_dict(),
                }
            )
        if i + 1 < len(sizes):
            expected = stats.median * (sizes[i + 1] / n) ** 3


def _time_product(
    dev: torch.device, dtype: str, n: int, timing: dict[str, Any], warmup: int
) -> Stats:
    """Seconds of one product on inputs already on ``dev``."""
    pool = POOL_SMALL if n < LARGE_N else POOL_LARGE
    with _on(dev):
        pairs = [
            (
                torch.randn(n, n, device=dev, dtype=DTYPES[dtype]),
                torch.randn(n, n, device=dev, dtype=DTYPES[dtype]),
            )
            for _ in range(pool)
        ]
        out = torch.empty(n, n, device=dev, dtype=DTYPES[dtype])
        with _tf32(dev, dtype == "tf32"):
            return measure(
                lambda ab: torch.mm(ab[0], ab[1], out=out),
                dev,
                inputs=pairs,
                warmup=warmup,
                **timing,
            )


def _time_offload(dev: torch.device, n: int, timing: dict[str, Any], warmup: int) -> Stats:
    """Seconds of one fp32 product of host tensors on GPU ``dev``: both copies in, the
    product, the copy out. Host clock: the program waits for its result by design."""
    pool = POOL_SMALL if n < LARGE_N else POOL_LARGE
    pairs = [(torch.randn(n, n), torch.randn(n, n)) for _ in range(pool)]  # pageable
    with _on(dev), _tf32(dev, False):
        return measure(
            lambda ab: torch.mm(ab[0].to(dev), ab[1].to(dev)).cpu(),
            dev,
            inputs=pairs,
            warmup=warmup,
            clock="host",
            **timing,
        )


@contextlib.contextmanager
def _tf32(dev: torch.device, enabled: bool) -> Iterator[None]:
    """cuBLAS with TF32 on or off for float32 products on a GPU, every setting restored after.

    Set through ``allow_tf32``, which sets torch's legacy setting and its newer
    ``fp32_precision`` together: cuBLAS refuses to multiply while the two disagree. Restored
    through both, since ``allow_tf32`` alone cannot say "medium" or "none" (inherit)."""
    if dev.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        before = bool(matmul.allow_tf32)
    except RuntimeError as err:
        raise ConfigError(
            "torch's TF32 setting for CUDA matmuls was set through both "
            "torch.backends.cuda.matmul.fp32_precision (or torch.backends.fp32_precision) and "
            f"allow_tf32 or set_float32_matmul_precision, and torch refuses to read it ({err}); "
            "set it one way only before running this benchmark"
        ) from None
    legacy = _precision()
    newer = getattr(matmul, "fp32_precision", None)  # torch 2.9 and later
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = before
        if legacy is not None and _precision() != legacy:
            torch.set_float32_matmul_precision(legacy)
        if newer is not None:
            matmul.fp32_precision = newer


def _precision() -> str | None:
    """``torch.get_float32_matmul_precision()``, or None where torch refuses to read it (the
    process mixed its two TF32 settings)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def summarise(rows: Sequence[dict[str, Any]], devices: Sequence[torch.device]) -> dict[str, Any]:
    """The headline figures: per GPU, the smallest n from which it beats the CPU at fp32
    (with and without the copies; None when it never does up to the largest n both ran),
    and the best TFLOP/s of each device and dtype."""
    summary: dict[str, Any] = {}
    cpu = {r["n"]: r["ms"] for r in rows if r["device"] == "cpu" and r.get("ms") is not None}
    for dev in devices:
        if dev.type != "cuda" or not cpu:
            continue
        fp32 = [r for r in rows if r["device"] == device_name(dev) and r["dtype"] == "fp32"]
        on_device = {r["n"]: r.get("ms") for r in fp32}
        with_copies = {r["n"]: r.get("ms_with_copies") for r in fp32}
        summary[f"{dev} fp32 faster than cpu from n"] = crossover(cpu, on_device)
        summary[f"{dev} fp32 with copies faster than cpu from n"] = crossover(cpu, with_copies)
    for dev in devices:
        for dtype in DTYPES:
            found = [
                r["tflops"]
                for r in rows
                if r["device"] == device_name(dev) and r["dtype"] == dtype and "tflops" in r
            ]
            if found:
                summary[f"{dev} {dtype} best TFLOP/s"] = max(found)
    return summary


def crossover(slow: dict[int, float], fast: dict[int, float | None]) -> int | None:
    """The smallest n from which ``fast`` takes less time than ``slow`` at every larger n
    both measured; None when it is not faster at the largest such n.

    >>> crossover({16: 1.0, 32: 1.0, 64: 1.0}, {16: 0.5, 32: 2.0, 64: 0.5})
    64
    >>> crossover({16: 1.0}, {16: 2.0, 32: 0.1}) is None
    True
    """
    start = None
    for n in sorted(n for n in slow if fast.get(n) is not None):
        faster = (fast[n] or 0.0) < slow[n]
        start = (n if start is None else start) if faster else None
    return start


def plot(result: BenchResult, path: Path) -> None:
    """TFLOP/s against n, one line per device and dtype; dashed: fp32 with the copies."""
    sizes = sorted({r["n"] for r in result.rows})
    names = [f"{d['device']}: {d['name']}" for d in result.environment.get("devices", [])]
    title = "matmul: 2n³ / median time of one n×n @ n×n product"
    if names:
        title += "\n" + "; ".join(names)
    with figure(path, title, "n (matrix side)", "TFLOP/s (log scale)") as ax:
        for device in dict.fromkeys(r["device"] for r in result.rows):
            short = device.split(" (")[0]
            for dtype in dict.fromkeys(r["dtype"] for r in result.rows if r["device"] == device):
                mine = [r for r in result.rows if r["device"] == device and r["dtype"] == dtype]
                points = [(r["n"], r["tflops"]) for r in mine if r.get("tflops")]
                if not points:
                    continue
                (line,) = ax.plot(
                    *zip(*points, strict=True), marker="o", ms=3, label=f"{short} {dtype}"
                )
                copies = [
                    (r["n"], r["tflops_with_copies"]) for r in mine if r.get("tflops_with_copies")
                ]
                if copies:
                    ax.plot(
                        *zip(*copies, strict=True),
                        marker="x",
                        ms=4,
                        linestyle="--",
                        color=line.get_color(),
                        label=f"{short} {dtype} + copies",
                    )
        size_axes(ax, sizes, [str(n) for n in sizes])


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else _hw.cuda_current()


def _on(dev: torch.device) -> contextlib.AbstractContextManager[object]:
    """``dev`` as the current CUDA device (so that streams, events and the allocator are that
    GPU's); nothing on the CPU."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _free(dev: torch.device) -> None:
    """Give a GPU's cached blocks back, so the next size starts from the same free memory."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def _notes() -> list[str]:
    return [
        "time: median of the repeats of one product on inputs already on the device; TFLOP/s: "
        "2n³ / time",
        "of peak: TFLOP/s over the GPU's published dense peak for that dtype "
        "(gpukit.workloads.flops.DENSE_PEAK_FLOPS); '-' on the CPU, whose peak gpukit does not "
        "know, and on GPUs missing from that table",
        "with copies (GPU fp32): A and B copied in from pageable host memory, the product, C "
        "copied back, on the host clock: what offloading one product costs a CPU program",
        "tf32: float32 tensors multiplied on the tensor cores (10-bit mantissa); fp32 rows run "
        "with TF32 off",
    ]
