"""Out-of-memory errors explained in numbers, with remedies ranked by what they would free.

:func:`~gpukit.diagnostics.oom_message.parse` reads the numbers out of PyTorch's messages (see
:mod:`gpukit.diagnostics.oom_message`); :func:`explain` ranks remedies by how much of the
shortfall each plausibly covers.

>>> from gpukit.diagnostics.oom import explain
>>> print(explain("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
...               "23.65 GiB of which 1.02 GiB is free. Of the allocated memory 21.89 GiB is "
...               "allocated by PyTorch, and 268.03 MiB is reserved by PyTorch but unallocated."))
out of memory on cuda:0: asked for 2 GiB with 1 GiB free of 23.7 GiB
  PyTorch tensors 21.9 GiB, cached but unused 268 MiB
  what to try, best first:
  1. smaller micro-batch: PyTorch tensors take 21.9 GiB (activations, weights and optimizer
     state); halve the samples per micro-batch and accumulate 2 to keep the effective batch:
     Runtime(accumulate=2) or gpukit train --accumulate 2; Runtime(oom="recover") does this by
     itself
  2. activation checkpointing and bf16: ...
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

from gpukit._util.text import described, safe_repr
from gpukit._util.text import format_bytes as _fb
from gpukit.diagnostics.oom_message import OomNumbers, parse
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.strategies import STRATEGIES, Strategy, make_strategy


@dataclass(frozen=True)
class Remedy:
    """One thing to try: ``score`` is the share of the shortfall it plausibly covers (0..1).

    >>> Remedy("smaller micro-batch", "use 16 samples instead of 32", 0.9).title
    'smaller micro-batch'
    """

    title: str
    detail: str
    score: float


@dataclass(frozen=True)
class OomExplanation:
    """An out-of-memory error in numbers, with remedies best first; ``str()`` reads as a report.

    >>> e = explain("DefaultCPUAllocator: not enough memory: you tried to allocate 1024 bytes.")
    >>> e.numbers.requested, e.to_dict()["remedies"][0]["title"]
    (1024, 'smaller batch')
    """

    numbers: OomNumbers | None
    remedies: tuple[Remedy, ...]
    raw: str

    def __str__(self) -> str:
        n = self.numbers
        if n is None:
            first = (self.raw.strip().splitlines() or [""])[0][:160]
            lines = [f"out of memory; gpukit found no numbers in the message: {first!r}"]
        else:
            free = "" if n.free is None else f" with {_fb(n.free)} free"
            total = "" if n.total is None else f" of {_fb(n.total)}"
            lines = [
                f"out of memory on {n.device or 'an unknown device'}: "
                f"asked for {_fb(n.requested)}{free}{total}"
            ]
            parts = [
                f"{name} {_fb(value)}"
                for name, value in (
                    ("PyTorch tensors", n.allocated),
                    ("cached but unused", n.reserved_unallocated),
                    ("this process", n.this_process),
                    ("other processes", n.other_processes),
                )
                if value is not None
            ]
            lines += ["  " + ", ".join(parts)] if parts else []
        injected = re.search(r"injected by GPUKIT_FAULT_OOM_ABOVE=\d+[^)]*", self.raw)
        if injected:  # a test of recovery, not a real shortage: say so before the numbers matter
            lines.append(f"  (not a real shortage: {injected.group(0)})")
        lines.append("  what to try, best first:")
        for i, r in enumerate(self.remedies, 1):
            lines += textwrap.wrap(
                f"{i}. {r.title}: {r.detail}",
                96,
                initial_indent="  ",
                subsequent_indent="     ",
                break_on_hyphens=False,
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json`` output."""
        numbers = None if self.numbers is None else asdict(self.numbers)
        return {"numbers": numbers, "remedies": [asdict(r) for r in self.remedies], "raw": self.raw}


def _check(name: str, value: object, low: float, kind: type | tuple[type, ...]) -> None:
    ok = value is None or (
        isinstance(value, kind) and not isinstance(value, bool) and value >= low  # type: ignore[operator]
    )
    if not ok:
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"explain({name}={described(value)}): give {what} >= {low:g}, or None")


def explain(
    err: BaseException | str,
    *,
    state_bytes: int | None = None,
    strategy: str | Strategy | None = None,
    imbalance: float | None = None,
    micro_batch: int | None = None,
) -> OomExplanation:
    """Explain an out-of-memory error (or its message) in numbers, remedies best first.

    ``state_bytes``: weights + gradients + optimizer state on that device, when known;
    ``strategy``: the training strategy (or its name), whose own advice joins the ranking
    (``dp``: balance the devices); ``imbalance``: max/min peak memory over the
    devices in use; ``micro_batch``: samples per micro-batch when it failed.

    >>> e = explain("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    ...             "capacity of 79.15 GiB of which 12.75 MiB is free.", micro_batch=32)
    >>> "16 samples per micro-batch" in str(e)
    True
    """
    if not isinstance(err, BaseException | str):
        raise ConfigError(
            f"explain() takes an exception or its message (str); got {type(err).__name__} "
            f"{safe_repr(err)}: pass the caught exception itself"
        )
    _check("state_bytes", state_bytes, 0, int)
    _check("micro_batch", micro_batch, 1, int)
    _check("imbalance", imbalance, 1, (int, float))
    if isinstance(strategy, str):
        # A name gpukit has no strategy for ("auto", a name of yours) has no advice to add.
        strategy = make_strategy(strategy) if strategy in STRATEGIES else None
    elif strategy is not None and not isinstance(strategy, Strategy):
        raise ConfigError(
            f"explain(strategy={described(strategy)}): give a strategy name such as 'dp', or the "
            "strategy object (rt.strategy)"
        )
    cause = err.__cause__ if isinstance(err, OutOfMemory) else None
    raw = str(cause if cause is not None else err)
    numbers = parse(raw)
    return OomExplanation(
        numbers,
        _rank(numbers or OomNumbers(), raw, state_bytes, strategy, imbalance, micro_batch),
        raw,
    )


# What each remedy says; {fields} come from the numbers.
_TEXT = {
    "shape": (
        "check tensor shapes",
        "one tensor of {req} is larger than the whole device "
        "({total}): look for an accidental broadcast, e.g. (N, 1) - (N,) is N x N",
    ),
    "batch": (
        "smaller batch",
        "not enough RAM for {req}: halve the samples per batch and keep "
        "the effective batch with Runtime(accumulate=2)",
    ),
    "workers": (
        "fewer DataLoader workers",
        "each worker process holds its own copy of what the "
        "dataset keeps in memory: lower DataLoader(num_workers=...)",
    ),
    "stream": (
        "stream the dataset",
        "read samples lazily (an IterableDataset, numpy.memmap) "
        "instead of loading the whole dataset into RAM",
    ),
    "frag": (
        "expandable segments",
        "{unused} is cached by PyTorch but in pieces too small for "
        "this request; set {var}=expandable_segments:True before the first CUDA call",
    ),
    "others": (
        "free the GPU",
        "other processes hold {others} of {device}: stop them (nvidia-smi "
        "lists them) or pick a free GPU with CUDA_VISIBLE_DEVICES (see gpukit devices)",
    ),
    "state": (
        "smaller weights and optimizer state",
        "weights, gradients and optimizer state "
        "take {state} of {total}: keep weights in bf16, use an 8-bit optimizer or shard "
        "its state over GPUs (FSDP / ZeRO), or train a smaller model",
    ),
    "micro": (
        "smaller micro-batch",
        "{act}{fewer} and accumulate {steps} to keep the effective "
        "batch: Runtime(accumulate={steps}) or gpukit train --accumulate {steps}; "
        'Runtime(oom="recover") does this by itself',
    ),
    "ckpt": (
        "activation checkpointing and bf16",
        "wrap the largest blocks in torch.utils."
        "checkpoint.checkpoint(block, x, use_reentrant=False) to recompute activations in "
        'backward, and train with precision="bf16-mixed" to halve most of them',
    ),
    "mps": (
        "raise the MPS limit",
        "MPS caps this process at {total}: raise "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO (0.0 removes the cap but can freeze the machine), "
        "or call torch.mps.empty_cache() between phases",
    ),
    "look": (
        "look at memory",
        "print(gk.memory()) shows allocated, reserved and peak memory "
        "per device; torch.cuda.memory_summary() shows the allocator's detail",
    ),
}


def _rank(
    n: OomNumbers,
    raw: str,
    state: int | None,
    strategy: Strategy | None,
    imbalance: float | None,
    micro_batch: int | None,
) -> tuple[Remedy, ...]:
    total, req, unused, allocated = n.total, n.requested, n.reserved_unallocated, n.allocated
    # A failed allocation is rarely the step's last, so a remedy must cover the missing bytes
    # plus a margin: 5% of the device, about what the rest of a step allocates.
    margin = total // 20 if total else (req or 0)
    need = max(0, (req or 0) - (n.free or 0)) + margin if (req or total) else 0
    found: list[tuple[float, int, Remedy]] = []

    def add(key: str, freed: int | None, confidence: float, **fields: object) -> None:
        covered = 0.5 if freed is None or not need else min(1.0, freed / need)
        title, text = _TEXT[key]
        detail = text.format(req=_fb(req), total=_fb(total), **fields)
        found.append((round(confidence * covered, 2), freed or 0, Remedy(title, detail, 0.0)))

    if req and total and req > total:
        add("shape", req, 1.0)
    if n.format == "cpu":
        add("batch", None, 1.0)
        add("workers", None, 0.8)
        add("stream", None, 0.6)
        return _sorted(found)
    if unused and (unused >= (req or 0) or (total is not None and unused >= total // 10)):
        var = "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in raw else "PYTORCH_CUDA_ALLOC_CONF"
        add("frag", unused, 0.9, unused=_fb(unused), var=var)
    others, sure = n.other_processes, 0.8
    if n.format == "pre-2.1" and total and n.free is not None and allocated is not None:
        # Only the remainder is known, and it holds this process's CUDA context (~1 GiB) too.
        others, sure = total - n.free - allocated - (unused or 0) - 2**30, 0.5
    if others and total and others >= total // 20:
        add("others", others, sure, others=_fb(others), device=n.device or "this GPU")
    if state is not None and total and (state >= 0.6 * total or state + (req or 0) > total):
        # bf16 weights and 8-bit or sharded optimizer state roughly halve the state.
        # When nothing else fits, no other remedy can help; at 60% it is the root cause.
        add("state", state // 2, 1.0 if state + (req or 0) > total else 0.95, state=_fb(state))
    known = state is not None and allocated is not None
    act = None if allocated is None else max(0, allocated - (state or 0))
    said = "" if act is None else f"activations take {_fb(act)}; "
    if act is not None and not known:
        said = f"PyTorch tensors take {_fb(act)} (activations, weights and optimizer state); "
    if micro_batch is None:
        freed = None if act is None else act // 2
        add(
            "micro",
            freed,
            0.9 if known else 0.6,
            act=said,
            steps=2,
            fewer="halve the samples per micro-batch",
        )
    elif micro_batch >= 2:
        small = micro_batch // 2
        freed = None if act is None else act - act * small // micro_batch
        add(
            "micro",
            freed,
            0.9 if known else 0.6,
            act=said,
            steps=math.ceil(micro_batch / small),
            fewer=f"run {small} samples per micro-batch instead of {micro_batch}",
        )
    add("ckpt", None if act is None else act // 2, 0.7 if known else 0.4)
    advice = None
    if strategy is not None:
        peak = None if allocated is None else allocated + (unused or 0)
        advice = strategy.recovery.advice(peak, imbalance)
    if advice is not None:  # what only the strategy knows: how it spreads memory
        covered = 0.5 if advice.freed is None or not need else min(1.0, advice.freed / need)
        remedy = Remedy(advice.title, advice.detail, 0.0)
        found.append((round(advice.confidence * covered, 2), advice.freed or 0, remedy))
    if n.format == "mps":
        add("mps", need, 0.6)
    if total is None:
        add("look", None, 0.2)
    return _sorted(found)


def _sorted(found: list[tuple[float, int, Remedy]]) -> tuple[Remedy, ...]:
    # Ties go to the remedy that frees more bytes, then to the order they were added in.
    ordered = sorted(found, key=lambda f: (-f[0], -f[1]))
    return tuple(Remedy(r.title, r.detail, min(1.0, s)) for s, _, r in ordered)
