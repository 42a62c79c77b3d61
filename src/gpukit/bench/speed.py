"""``speed``: what gpukit costs in throughput at a real model size, against the loop a user
would otherwise tune by hand, measured side by side.

Two models, each against its own hand-written reference:

- ``gpt2`` (GPT-2 small: 124M parameters, 1,024 tokens a sequence, 12 sequences a step) through
  the three loops of :mod:`gpukit.bench.speed_loops`: ``nanogpt`` (plain PyTorch in nanoGPT's
  habits, the reference), ``runtime`` (``gk.Runtime`` in a user's loop) and ``train``
  (``gpukit train``'s loop and defaults);
- ``llama`` (Llama 3.2 1B's shape: 1.24B parameters, 2,048 tokens a sequence, 4 sequences a
  step) under FSDP2 through those of :mod:`gpukit.bench.speed_fsdp`: ``fsdp2`` (plain PyTorch
  as torchtitan's trainer writes it, the reference), ``runtime`` (``gk.Runtime`` with
  ``FSDP(mixed="bf16")``) and ``train`` (``gpukit train --strategy fsdp --fsdp-mixed bf16``).

With ``--quick``, or on a machine without a GPU, each is a few narrow layers on the CPU. Every
loop of a model starts from the same weights, sees the same random-token batches and uses the
same optimizer, all in this one process; TF32 matmuls are on for all of them on a GPU (as
nanoGPT sets them), and restored after.

Method (see :mod:`gpukit.bench.timing`): each loop's first call (``steps`` steps) measures its
peak GPU memory and keeps every step's loss; then, after one more untimed call each, ``rounds``
rotated rounds time ``steps`` steps of every loop, the GPU synchronised before each clock read.
On a CPU each loop is built 3 times and its copies take turns over the rounds, as in
``overhead``.
Per loop: tokens/s (the median over the rounds), its ratio to its model's reference (the
median of the per-round ratios), MFU against the GPU's datasheet dense bf16 peak, the peak
memory, and the largest relative difference of its first steps' losses from the reference's:
exactly 0 in float32 without compiling (the same computation), within bfloat16's rounding
otherwise.

>>> result = run(quick=True, steps=2, rounds=1)
>>> [(row["model"], row["variant"]) for row in result.rows]  # doctest: +NORMALIZE_WHITESPACE
[('gpt2', 'nanogpt'), ('gpt2', 'runtime'), ('gpt2', 'train'),
 ('llama', 'fsdp2'), ('llama', 'runtime'), ('llama', 'train')]
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpukit.bench import speed_fsdp
from gpukit.bench import speed_loops as loops
from gpukit.bench.environment import environment_of
from gpukit.bench.measure import check_devices, device_name
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import check_count, synchronizer, take_turns, time_rounds
from gpukit.workloads.flops import mfu

TITLE = (
    "tokens/s of gpt2 and Llama 1B through gpukit train, gk.Runtime and the plain loops of "
    "nanoGPT and torchtitan"
)
MODELS = ("gpt2", "llama")
# Each model's hand-written reference loop, and every loop it is timed through.
REFERENCES = {"gpt2": "nanogpt", "llama": "fsdp2"}
BUILDERS: dict[str, dict[str, Callable[[loops.Setup, Sequence[loops.Batch]], loops.Loop]]] = {
    "gpt2": loops.BUILDERS,
    "llama": speed_fsdp.BUILDERS,
}
# Largest relative difference of a loop's first losses from the reference's that still counts
# as the same training, where bfloat16 or compiling reorders the arithmetic (bfloat16 keeps
# about 3 significant digits); in float32 without compiling the losses must be equal.
TOLERANCE = 2e-2
FIRST_STEPS = 3  # the first steps' losses compared
INSTANCES = 3  # copies of each loop taking turns on a CPU (see _instances)

COLUMNS = (
    Column("device"),
    Column("model"),
    Column("variant"),
    Column("tokens_per_s", "tokens/s", "", 0),
    Column("ratio", "x reference", "", 3),
    Column("mfu", "MFU", "", 3),
    Column("peak_memory", "peak memory", "B", 0),
    Column("loss_delta", "first losses vs reference", "", 6),
    Column("status"),
)


@dataclass(frozen=True)
class SpeedTiming:
    """How much to run: the model (``gpt2`` or ``llama``), its sizes (``{}``: GPT-2 small or
    Llama 3.2 1B), tokens a llama sequence, sequences per step, steps per timed call, rounds,
    and whether the loops compile."""

    model: str
    sizes: dict[str, Any]
    seq_len: int
    batch: int
    steps: int
    rounds: int
    compile: bool


def settings(quick: bool, device: torch.device, model: str = "gpt2") -> SpeedTiming:
    """GPT-2 small and Llama 3.2 1B on a GPU; a few narrow layers on a CPU or with ``quick``.

    >>> settings(quick=True, device=torch.device("cpu")).batch
    4
    >>> settings(quick=False, device=torch.device("cuda"), model="llama").seq_len
    2048
    """
    llama = model == "llama"
    tiny = speed_fsdp.TINY if llama else loops.TINY
    if quick:
        return SpeedTiming(model, tiny, 64, batch=4, steps=10, rounds=2, compile=False)
    if device.type == "cuda":
        # A GPU's rounds differ little; compiling each loop (about a minute each at these
        # sizes) is most of the run, and what gpu-check's budget must hold.
        batch = 4 if llama else 12
        return SpeedTiming(model, {}, 2048, batch=batch, steps=10, rounds=3, compile=True)
    return SpeedTiming(model, tiny, 64, batch=12, steps=20, rounds=5, compile=False)


def run(
    quick: bool = False,
    devices: Sequence[torch.device] | None = None,
    steps: int | None = None,
    rounds: int | None = None,
) -> BenchResult:
    """Compare the loops on each of ``devices`` (default: a GPU where there is one, else the
    CPU); ``steps`` and ``rounds`` override the settings' (see the module docstring)."""
    chosen = check_devices(devices or _default_devices(), "speed")
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    used: list[dict[str, Any]] = []
    if steps is not None:
        check_count("steps", steps, "steps per timed call")
    if rounds is not None:
        check_count("rounds", rounds, "rotated rounds over the loops")
    for device in chosen:
        for model in MODELS:
            s = settings(quick, device, model)
            s = dataclasses.replace(
                s,
                steps=s.steps if steps is None else steps,
                rounds=s.rounds if rounds is None else rounds,
            )
            device_rows, device_raw = compare(device, s)
            rows += device_rows
            raw.append(device_raw)
            used.append({"device": device_name(device), **s.__dict__})
    return BenchResult(
        experiment="speed",
        title=TITLE,
        keys=("device", "model", "variant"),
        columns=COLUMNS,
        rows=rows,
        summary=_summary(rows),
        notes=_notes(),
        parameters={"quick": quick, "runs": used, "seed": loops.SEED},
        environment=environment_of(chosen),
        raw={"devices": raw},
    )


def _default_devices() -> list[torch.device]:
    return [torch.device("cuda", 0)] if torch.cuda.is_available() else [torch.device("cpu")]


def compare(device: torch.device, s: SpeedTiming) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every loop of ``s.model`` on ``device``: its rows and its raw timings and losses."""
    setup = loops.Setup(device, s.sizes, s.batch, s.compile, model=s.model, seq_len=s.seq_len)
    workload = setup.workload()
    context = workload.dataset[0][0].numel()  # tokens a sequence
    tokens = s.batch * context
    batches = loops.make_batches(setup, s.steps)
    builders = BUILDERS[s.model]
    group = speed_fsdp.process_group(device) if s.model == "llama" else contextlib.nullcontext()
    with _tf32(device), group:
        # fsdp prints its plan at setup: the runs' output is the result.
        with contextlib.redirect_stdout(io.StringIO()):
            copies = {
                name: [build(setup, batches) for _ in range(_instances(device))]
                for name, build in builders.items()
            }
        try:
            peaks: dict[str, int | None] = {}
            for name, made in copies.items():
                # Every copy's first call; the first copy's gives the peak (one copy on a GPU).
                measured = [_first_call(loop, batches, device) for loop in made]
                peaks[name] = measured[0]
            runs = {name: take_turns(made, batches) for name, made in copies.items()}
            timings = time_rounds(
                runs, s.rounds, per=s.steps, warmup=1, synchronize=synchronizer(device)
            )
        finally:
            for made in copies.values():  # before the process group goes
                for loop in made:
                    loop.close()
    built = {name: made[0] for name, made in copies.items()}
    reference_name = REFERENCES[s.model]
    reference = built[reference_name].first[:FIRST_STEPS]
    exact = setup.precision == "32" and not s.compile
    rows = []
    for name, loop in built.items():
        seconds = timings.median(name)
        flops = workload.flops_per_sample * s.batch / seconds
        delta = _largest_difference(loop.first[:FIRST_STEPS], reference)
        agrees = delta == 0.0 if exact else delta <= TOLERANCE
        rows.append(
            {
                "device": device_name(device),
                "model": s.model,
                "variant": name,
                "tokens_per_s": tokens / seconds,
                "ratio": timings.ratio(reference_name, name),  # its speed over the reference's
                "mfu": _mfu(flops, device),
                "peak_memory": peaks[name],
                "loss_delta": delta,
                "status": "ok" if agrees else f"losses differ from {reference_name}'s",
            }
        )
    raw = {
        "device": device_name(device),
        "model": s.model,
        "reference": reference_name,
        "precision": setup.precision,
        "tokens_per_step": tokens,
        "seconds_per_step_by_round": dict(timings.seconds),
        "speed_over_reference_by_round": {
            n: list(timings.ratios(reference_name, n)) for n in built
        },
        "first_losses": {name: loop.first for name, loop in built.items()},
        "losses_read_back": {name: loop.losses for name, loop in built.items()},
    }
    return rows, raw


def _instances(device: torch.device) -> int:
    """Copies of each loop taking turns over the rounds: on a CPU one model's place in memory
    can make it a few percent faster or slower than an identical one (as in ``overhead``), and
    taking turns spreads that over the rounds; on a GPU the kernels' time dwarfs it, and each
    copy would cost a compilation and its memory."""
    return INSTANCES if device.type == "cpu" else 1


def _first_call(loop: loops.Loop, batches: list[loops.Batch], device: torch.device) -> int | None:
    """Run ``loop``'s first call; the peak of GPU memory allocated during it (None on a CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    loop(batches)
    if not cuda:
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def _largest_difference(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference between ``losses`` and ``reference``, step by step.

    >>> _largest_difference([2.0, 1.0], [2.0, 1.1]) == abs(1.0 - 1.1) / 1.1
    True
    """
    pairs = list(zip(losses, reference, strict=True))
    return max((abs(a - b) / abs(b) if b else abs(a - b) for a, b in pairs), default=0.0)


def _mfu(flops_per_s: float, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return mfu(flops_per_s, torch.cuda.get_device_name(device), gpus=1)


@contextlib.contextmanager
def _tf32(device: torch.device) -> Iterator[None]:
    """TF32 matmuls and convolutions on a GPU, as nanoGPT sets them, restored after."""
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for row in rows:
        reference = REFERENCES[row["model"]]
        if row["variant"] != reference:
            key = f"{row['device']} {row['model']} {row['variant']}"
            summary[f"{key} x {reference}"] = row["ratio"]
            summary[f"{key} losses"] = row["status"]
    return summary


def _notes() -> list[str]:
    return [
        "x reference: the loop's tokens/s over its model's plain loop's (gpt2: nanoGPT's, "
        "llama: torchtitan's FSDP2), per round, median over the rounds (above 1: faster than "
        "the hand-written loop).",
        "gpt2's loops use nanoGPT's AdamW (decay on matrices, betas 0.9/0.95), llama's "
        "torchtitan's (decay 0.1 on all, betas 0.9/0.95), fused on a GPU, from the same "
        "weights on the same batches, without clipping: only the loop differs. On a GPU the "
        "plain loops and runtime compile (llama: each block), and train compiles as its "
        "--compile auto does for a long run.",
        "MFU: model FLOPs (6 per parameter and token, plus attention) per second over the GPU's "
        "datasheet dense bf16 peak; none on a CPU.",
    ]


def plot(result: BenchResult, path: Path) -> None:
    """Tokens/s per loop, model and device, each bar labelled with its ratio to its reference."""
    rows = result.rows
    labels = [f"{r['model']} {r['variant']}\n{r['device']}" for r in rows]
    with figure(
        path, "Training speed, side by side", "tokens/s (median of the rounds)", "loop"
    ) as ax:
        bars = ax.barh(labels, [r["tokens_per_s"] for r in rows], color="tab:blue", alpha=0.8)
        ax.invert_yaxis()
        for bar, row in zip(bars, rows, strict=True):
            ax.annotate(
                f"x{row['ratio']:.3f}",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                va="center",
                fontsize=8,
            )
