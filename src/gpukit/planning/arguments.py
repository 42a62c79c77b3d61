"""The arguments of ``gk.plan`` checked and resolved: the workload built, the device counts
and strategies chosen, the target and its precision.

Apart from the planning itself, so that every error a caller can make is said in one place,
before anything is predicted, naming what was passed and what is allowed.

>>> counts([8, 1, 2, 2]), precision("auto", target("cpu", None))
([1, 2, 8], '32')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpukit.errors import ConfigError
from gpukit.planning import registered
from gpukit.planning.closed_form import MIXED
from gpukit.planning.targets import Target, with_memory
from gpukit.planning.targets import target as resolve_target
from gpukit.runtime.step.precision import refuse_on_device
from gpukit.workloads.base import Workload, load_workload

CHECKPOINTING = ("off", "full", "selective")
PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")


def workload(workload: Any) -> Workload:
    """The Workload that ``workload`` names or builds (see :func:`gpukit.plan`)."""
    if isinstance(workload, Workload):
        return workload
    if isinstance(workload, str):
        return load_workload(workload, seed=0, meta=True)  # planned without materialising
    if callable(workload):
        built = workload()
        if isinstance(built, Workload):
            return built
        raise ConfigError(
            f"the workload function returned {type(built).__name__}: return a gpukit Workload"
        )
    raise ConfigError(
        f"workload={type(workload).__name__}: give a built-in's name (mlp, cnn, gpt, gpt2), "
        "'module:function', a Workload or a function returning one"
    )


def counts(devices: int | Sequence[int]) -> list[int]:
    """The device counts to plan, sorted and once each."""
    values = [devices] if isinstance(devices, int) else list(devices)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ConfigError(
            f"devices={devices!r}: give a device count of at least 1, or a list of them "
            "(e.g. [1, 2, 8])"
        )
    return sorted(set(values))


def strategies(
    strategies: Sequence[str] | None, counts: list[int], checkpointing: str
) -> list[str]:
    """The strategies to plan, in the registry's order (None: the registry's defaults for
    ``counts``); refused where activation checkpointing is asked of one without it."""
    if strategies is None:
        return registered.defaults(counts, checkpointing)
    if isinstance(strategies, str):
        strategies = [strategies]
    chosen = list(strategies)
    known = registered.names()
    having = registered.with_checkpointing()
    others = [c for c in chosen if c not in having]
    if checkpointing != "off" and others:
        first = having[0] if having else "..."
        raise ConfigError(
            f"activation_checkpointing={checkpointing!r} with {', '.join(map(str, others))}: "
            f"activation checkpointing is an {' and '.join(having) or 'unused'} setting in "
            f"gpukit (gpukit train --strategy {first} --activation-checkpointing ...); plan "
            f"strategies={list(having)!r}, or leave activation_checkpointing='off' for the others"
        )
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise ConfigError(f"strategies={chosen!r}: choose among {', '.join(known)}")
    return [s for s in known if s in chosen]


def target(spec: str | Target | None, memory: int | None) -> Target:
    """The GPU (or CPU) planned for, with ``memory`` bytes when given."""
    goal = spec if isinstance(spec, Target) else resolve_target(spec)
    if memory is not None:
        goal = with_memory(goal, memory)
    return goal


def precision(precision: str, goal: Target) -> str:
    """The precision planned: "auto" is what gpukit picks on ``goal``."""
    choice("precision", precision, PRECISIONS)
    if precision != "auto":
        # The run's own check, on the target: a plan must not recommend what a run refuses.
        cuda = goal.kind == "cuda"
        shown = goal.name if cuda else "cpu"
        refuse_on_device(precision, shown, cuda=cuda, bf16="bf16" in goal.peak_flops)
        return precision
    # What gpukit's "auto" picks on that device: bf16 autocast on GPUs that compute bf16.
    if goal.kind != "cuda":
        return "32"
    return "bf16-mixed" if "bf16" in goal.peak_flops else "16-mixed"


def mixed(value: Any, chosen: Sequence[str]) -> str | None:
    """``fsdp_mixed``: None, or a policy the closed form models, with a strategy that gathers
    weights among ``chosen``."""
    if value is None:
        return None
    if value not in MIXED:
        raise ConfigError(
            f"fsdp_mixed={value!r}: choose among {', '.join(MIXED)} (FSDP2's mixed precision: "
            "bf16 parameters and compute, float32 gradient reduction), or None"
        )
    gathering = [s for s in registered.names() if registered.traits(s).gathers_weights]
    if not any(s in gathering for s in chosen):
        raise ConfigError(
            f"fsdp_mixed={value!r} applies to {', '.join(gathering)}, which strategies="
            f"{list(chosen)!r} leaves out: add it, or leave fsdp_mixed out"
        )
    return str(value)


def positive(name: str, value: Any) -> int:
    """``value``, a whole number of at least 1, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
    return value


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value``, one of ``allowed``, or an error listing them."""
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: choose among {', '.join(allowed)}")
    return str(value)
