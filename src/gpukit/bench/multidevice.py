"""``multidevice``: do two devices give twice the speed?

The classic experiment: ``C = Aⁿ + Bⁿ`` with n = 10 (each power by 9 products of float32
matrices), the sum on the CPU, with A and B on one device, then on two working at once. What
runs depends on what is here (each comparison's first setup is its sequential baseline):

- two or more GPUs: A and B on cuda:0 vs A on cuda:0 and B on cuda:1, by the same code (both
  powers are queued before the host waits for either); one large product per GPU, in turn vs
  at once: the same question without copies or sum;
- a GPU: both powers on one stream vs on two streams; with the CPU, A's power on the GPU,
  waited for, then B's on the CPU, vs A's queued on the GPU while the CPU computes B's;
- no GPU, the CPU analogue (two cores of one CPU, not two devices): the powers in turn with
  one intra-op thread, at once in two Python threads with one each (torch releases the GIL
  inside an op), and in turn with torch's default threads.

Method (see :mod:`gpukit.bench.measure`): one whole computation per timed call, on the host
clock between synchronisations of every device involved, after warm-up, repeated; the last
result of each setup is compared with its baseline's (``matches``).

>>> [name for name in plan([torch.device("cpu"), torch.device("cuda", 0)])]
['Aⁿ+Bⁿ, 2 streams', 'Aⁿ+Bⁿ, CPU+GPU']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.measure import Stats, check_devices, measure, tf32_matmul
from gpukit.bench.plotting import figure
from gpukit.bench.powers import (
    POWER,
    first_power,
    in_two_threads,
    matches,
    on_two_streams,
    one_after_the_other,
    products_at_once,
    products_in_turn,
    sum_of_powers,
    tolerance,
)
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import torch_threads
from gpukit.devices import hw as _hw

TITLE = "multidevice: do two devices give twice the speed? C = A¹⁰ + B¹⁰, float32"

# Matrix sides: large enough that a GPU's products fill it; the CPU's take a second at most.
SIZES = {"gpu": 4096, "product": 8192, "cpu": 1024}
# --quick: CI sizes; a 512 side keeps each CPU product large enough to split over threads.
QUICK_SIZES = {"gpu": 1024, "product": 2048, "cpu": 512}
SEED = 0

TWO_GPUS = "Aⁿ+Bⁿ, 2 GPUs"
PRODUCTS = "1 product per GPU"
STREAMS = "Aⁿ+Bⁿ, 2 streams"
CPU_GPU = "Aⁿ+Bⁿ, CPU+GPU"
THREADS = "Aⁿ+Bⁿ, 2 CPU threads"

COLUMNS = (
    Column("comparison"),
    Column("setup"),
    Column("devices"),
    Column("size", "matrix side"),
    Column("ms", "time", "ms", 2),
    Column("speedup", "speed-up", "×", 2),
    Column("ideal", "ideal", "×", 2),
    Column("matches", "same C"),
)


@dataclass(frozen=True)
class Setup:
    """One way to compute: ``work(inputs)`` timed with every device of ``timed_on``
    synchronised, under ``threads`` intra-op threads (None: as set); ``ideal`` is its best
    possible speed-up over the baseline (None for the baseline, or when measured)."""

    name: str
    devices: str
    work: Callable[[Any], Any]
    inputs: Any
    timed_on: tuple[torch.device, ...]
    ideal: float | None = None
    threads: int | None = None


@dataclass(frozen=True)
class Comparison:
    """Setups computing the same thing on ``size``-square matrices, the first the sequential
    baseline. ``alone``: the GPU's share of a CPU+GPU baseline, timed by itself to bound the
    speed-up."""

    name: str
    size: int
    setups: list[Setup]
    alone: Setup | None = None


Timed = tuple[Stats, Any]  # a setup's timings and its last result


def plan(devices: Sequence[torch.device]) -> list[str]:
    """The comparisons that run with ``devices``.

    >>> plan([torch.device("cpu")])
    ['Aⁿ+Bⁿ, 2 CPU threads']
    >>> plan([torch.device("cuda", 0), torch.device("cuda", 1)])
    ['Aⁿ+Bⁿ, 2 GPUs', '1 product per GPU', 'Aⁿ+Bⁿ, 2 streams']
    """
    gpus = [d for d in devices if d.type == "cuda"]
    names = [TWO_GPUS, PRODUCTS] if len(gpus) >= 2 else []
    if gpus:
        names.append(STREAMS)
        if any(d.type == "cpu" for d in devices):
            names.append(CPU_GPU)
    else:
        names.append(THREADS)
    return names


def _matrices(size: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B, drawn on the CPU (the same numbers for every device), scaled by 1/√size so
    that their powers stay of order one instead of overflowing."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=gen) / size**0.5
    b = torch.randn(size, size, generator=gen) / size**0.5
    return a, b


def _two_gpus(gpus: list[torch.device], sizes: dict[str, int], _: Any) -> Comparison:
    g0, g1 = gpus[:2]
    a, b = _matrices(sizes["gpu"])
    setups = [
        Setup(f"A, B on {g0}", str(g0), sum_of_powers, (a.to(g0), b.to(g0)), (g0,)),
        Setup(
            f"A on {g0}, B on {g1}",
            f"{g0}, {g1}",
            sum_of_powers,
            (a.to(g0), b.to(g1)),
            (g0, g1),
            ideal=2.0,
        ),
    ]
    return Comparison(TWO_GPUS, sizes["gpu"], setups)


def _products(gpus: list[torch.device], sizes: dict[str, int], _: Any) -> Comparison:
    g0, g1 = gpus[:2]
    x, y = _matrices(sizes["product"])
    both, on = ((x.to(g0), y.to(g0)), (x.to(g1), y.to(g1))), (g0, g1)
    setups = [
        Setup(f"{g0}, then {g1}", f"{g0}, {g1}", products_in_turn, both, on),
        Setup(f"{g0} and {g1} at once", f"{g0}, {g1}", products_at_once, both, on, ideal=2.0),
    ]
    return Comparison(PRODUCTS, sizes["product"], setups)


def _streams(gpus: list[torch.device], sizes: dict[str, int], _: Any) -> Comparison:
    g = gpus[0]
    a, b = _matrices(sizes["gpu"])
    pair = (a.to(g), b.to(g))
    two = functools.partial(on_two_streams, streams=(torch.cuda.Stream(g), torch.cuda.Stream(g)))
    setups = [
        Setup(f"one stream of {g}", str(g), sum_of_powers, pair, (g,)),
        Setup(f"two streams of {g}", str(g), two, pair, (g,), ideal=1.0),
    ]
    return Comparison(STREAMS, sizes["gpu"], setups)


def _cpu_and_gpu(gpus: list[torch.device], sizes: dict[str, int], _: Any) -> Comparison:
    g, on = gpus[0], (torch.device("cpu"), gpus[0])
    a, b = _matrices(sizes["cpu"])  # one size for both, and the CPU's must finish in a second
    pair = (a.to(g), b)
    setups = [
        Setup(f"A on {g}, then B on cpu", f"{g}, cpu", one_after_the_other, pair, on),
        Setup(f"A on {g} while B on cpu", f"{g}, cpu", sum_of_powers, pair, on),
    ]
    alone = Setup(f"A on {g} alone", str(g), first_power, pair, (g,))
    return Comparison(CPU_GPU, sizes["cpu"], setups, alone)


def _cpu_threads(_: list[torch.device], sizes: dict[str, int], pool: Any) -> Comparison:
    on, pair = (torch.device("cpu"),), _matrices(sizes["cpu"])
    cores, default = _hw.cpu_cores()[1], torch.get_num_threads()
    two, in_turn = functools.partial(in_two_threads, pool=pool), one_after_the_other
    setups = [
        Setup("in turn, 1 thread", "cpu", in_turn, pair, on, threads=1),
        Setup("at once, 2 threads × 1", "cpu", two, pair, on, min(2.0, cores), threads=1),
        Setup(
            f"in turn, {default} threads (default)",
            "cpu",
            in_turn,
            pair,
            on,
            float(min(default, cores)),
        ),
    ]
    return Comparison(THREADS, sizes["cpu"], setups)


_BUILDERS: dict[str, Callable[[list[torch.device], dict[str, int], Any], Comparison]] = {
    TWO_GPUS: _two_gpus,
    PRODUCTS: _products,
    STREAMS: _streams,
    CPU_GPU: _cpu_and_gpu,
    THREADS: _cpu_threads,
}


def run(quick: bool = False, devices: Sequence[torch.device] | None = None) -> BenchResult:
    """Time every comparison that ``devices`` allow (default: the CPU and every GPU).

    >>> r = run(quick=True, devices=[torch.device("cpu")])  # doctest: +SKIP
    >>> [row["setup"] for row in r.rows][:2]  # doctest: +SKIP
    ['in turn, 1 thread', 'at once, 2 threads × 1']
    """
    devs = check_devices(devices, "multidevice")
    repeats, budget_s = (5, 1.0) if quick else (10, 3.0)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    notes = list(NOTES)
    gpus = [d for d in devs if d.type == "cuda"]
    # The CPU analogue's two threads, started once and warmed up with the rest: the timed
    # calls then pay for computing, not for starting threads.
    with ThreadPoolExecutor(2, thread_name_prefix="gpukit-bench") as pool:
        for name in plan(devs):
            comparison = _BUILDERS[name](gpus, QUICK_SIZES if quick else SIZES, pool)
            timed = {s.name: _time(s, repeats, budget_s) for s in comparison.setups}
            alone = None
            if comparison.alone is not None:
                alone = _time(comparison.alone, repeats, budget_s)
                summary[f"{comparison.alone.name} (ms)"] = alone[0].median * 1e3
            found, raw[name] = _rows(comparison, timed, alone)
            rows += found
            summary.update({f"speed-up, {r['setup']}": r["speedup"] for r in found[1:]})
            notes.append(_NOTES[name])
    return BenchResult(
        experiment="multidevice",
        title=TITLE,
        keys=("comparison", "setup"),
        columns=COLUMNS,
        rows=rows,
        summary=summary,
        notes=notes,
        parameters={
            "quick": quick,
            "power": POWER,
            "sizes": QUICK_SIZES if quick else SIZES,
            "dtype": "float32",
            "tolerance": tolerance(),
            "tf32": tf32_matmul(),
            "seed": SEED,
            "clock": "host",
            "repeats": repeats,
            "budget_s": budget_s,
            "threads": torch.get_num_threads(),
        },
        environment=environment_of(devs),
        raw=raw,
    )


NOTES = (
    "speed-up: the median time of the comparison's first setup (the sequential baseline) over "
    "this setup's, same run; time: one whole computation, every device involved synchronised "
    "before and after. ideal: the best speed-up the added hardware allows (below, per "
    "comparison).",
    "same C: equal to the baseline's to a relative tolerance (see parameters) of its largest "
    "entry: float32 sums in another order, or on another device, round differently.",
)
_NOTES = {
    TWO_GPUS: "2 GPUs: ideal 2.0, twice one GPU's compute, for two GPUs of one model (see the "
    "environment). The copies back and the sum on the CPU come after both powers and do not "
    "run in parallel, which keeps the speed-up below it (Amdahl's law).",
    PRODUCTS: "1 product per GPU: the same question without copies or sum: ideal 2.0.",
    STREAMS: "2 streams: ideal 1.0: streams add no compute units to the one GPU. Above 1.0 is "
    "time one stream left the GPU idle (launch gaps, a product too small to fill every SM).",
    CPU_GPU: "CPU+GPU: ideal t_seq / max(t_gpu, t_seq - t_gpu), t_seq the baseline's time and "
    "t_gpu the GPU's share (Aⁿ and its copy back) timed alone: at best the two shares overlap "
    "entirely, so the slower device bounds the speed-up.",
    THREADS: "2 CPU threads: not two devices but two cores of one CPU, sharing its memory "
    "bandwidth and caches: ideal min(threads, usable cores). Torch already spreads each product "
    "over the cores (the default-threads row), so two Python threads gain at most what "
    "intra-op threads already gave.",
}


def _time(setup: Setup, repeats: int, budget_s: float) -> Timed:
    """The setup's timings and its last result (kept from the timed calls: no extra run)."""
    last: list[Any] = [None]

    def work(inputs: Any) -> None:
        last[0] = setup.work(inputs)

    on_cpu_only = all(d.type == "cpu" for d in setup.timed_on)
    threads = torch_threads(setup.threads) if setup.threads else contextlib.nullcontext()
    warmup = 1 if on_cpu_only else 2  # a GPU's first calls also choose cuBLAS's kernels
    with threads:
        s = measure(
            work,
            setup.timed_on,
            inputs=[setup.inputs],
            repeats=repeats,
            budget_s=budget_s,
            warmup=warmup,
            clock="host",
        )
    return s, last[0]


def _rows(
    comparison: Comparison, timed: dict[str, Timed], alone: Timed | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The table's rows of one comparison, and its raw timings."""
    base = comparison.setups[0]
    base_s, reference = timed[base.name]
    rows = []
    for setup in comparison.setups:
        s, out = timed[setup.name]
        ideal = setup.ideal
        if setup is not base and alone is not None:
            gpu_share = alone[0].median
            # At best the shares overlap entirely; never below 1.0 (noise in the share).
            ideal = max(1.0, base_s.median / max(gpu_share, base_s.median - gpu_share))
        rows.append(
            {
                "comparison": comparison.name,
                "setup": setup.name,
                "devices": setup.devices,
                "size": comparison.size,
                "ms": s.median * 1e3,
                "speedup": base_s.median / s.median,
                "ideal": ideal,
                "matches": matches(out, reference),
            }
        )
    raw: dict[str, Any] = {name: s.to_dict() for name, (s, _) in timed.items()}
    if alone is not None and comparison.alone is not None:
        raw[comparison.alone.name] = alone[0].to_dict()
    return rows, raw


def plot(result: BenchResult, path: Path) -> None:
    """Horizontal bars: the time of every setup, coloured by comparison, labelled with the
    speed-up over its baseline and the ideal one."""
    rows = result.rows
    comparisons = list(dict.fromkeys(r["comparison"] for r in rows))
    colours = {name: f"C{i}" for i, name in enumerate(comparisons)}
    times = [r["ms"] for r in rows]
    spread = max(times) / min(times) if times and min(times) > 0 else 1.0
    height = 1.6 + 0.55 * len(rows)
    title = "C = A¹⁰ + B¹⁰: one device vs two at once (speed-up over the first of each colour)"
    with figure(
        path, title, "time per computation (ms)", "", logx=spread > 20, size=(9.0, height)
    ) as ax:
        ys = list(range(len(rows)))[::-1]  # the first row on top
        for name in comparisons:
            mine = [i for i, r in enumerate(rows) if r["comparison"] == name]
            ax.barh(
                [ys[i] for i in mine], [times[i] for i in mine], color=colours[name], label=name
            )
        for y, r in zip(ys, rows, strict=True):
            ax.annotate(
                _bar_text(r),
                (r["ms"], y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(ys)
        ax.set_yticklabels(
            [f"{r['setup']}\n({r['devices']}, {r['size']}²)" for r in rows], fontsize=8
        )
        ax.margins(x=0.35)  # room for the labels right of the longest bar


def _bar_text(row: dict[str, Any]) -> str:
    """A bar's label.

    >>> _bar_text({"ms": 12.34, "speedup": 1.9, "ideal": 2.0, "matches": True})
    '12.3 ms, 1.90× (ideal 2.00×)'
    """
    text = f"{row['ms']:.3g} ms, {row['speedup']:.2f}×"
    if row.get("ideal") is not None:
        text += f" (ideal {row['ideal']:.2f}×)"
    if row.get("matches") is False:
        text += ", C differs!"
    return text
