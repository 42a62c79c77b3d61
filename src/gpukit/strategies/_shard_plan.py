"""What fsdp did to a model, in numbers: its groups, and the bytes each rank keeps.

Printed on rank 0 when the model is set up (once per process for the same plan: a loop that
sets up the same model again, such as a new Runtime per trial or a benchmark's repeated runs,
shows it once), and kept as ``strategy.plans`` (one per model):

    fsdp over 2 ranks (2 sharding, no replicas, no tensor parallel): 3 groups
    group      parameters   full size   per rank
    blocks.0       49,984    390.5 KiB  195.2 KiB
    ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gpukit._util.text import format_bytes, render_table
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies._groups import Group, tied_names
from gpukit.strategies._user_sharded import casts, mixed_policies


@dataclass(frozen=True)
class GroupShare:
    """One group: its name, parameter count, full bytes and the bytes this rank keeps."""

    name: str
    parameters: int
    full_bytes: int
    local_bytes: int


@dataclass(frozen=True)
class ShardPlan:
    """A sharded model's groups (the root's last), and the settings that shaped them."""

    groups: list[GroupShare]
    world_size: int
    shard: int
    replicas: int
    tp: int
    settings: dict[str, Any]
    tied: list[list[str]]
    note: str = ""

    @property
    def full_bytes(self) -> int:
        return sum(g.full_bytes for g in self.groups)

    @property
    def local_bytes(self) -> int:
        return sum(g.local_bytes for g in self.groups)

    def render(self) -> str:
        rows = [
            [g.name, f"{g.parameters:,}", format_bytes(g.full_bytes), format_bytes(g.local_bytes)]
            for g in self.groups
        ]
        rows.append(
            [
                "total",
                f"{sum(g.parameters for g in self.groups):,}",
                format_bytes(self.full_bytes),
                format_bytes(self.local_bytes),
            ]
        )
        layout = f"{self.shard} sharding"
        layout += f" x {self.replicas} replicas" if self.replicas > 1 else ", no replicas"
        layout += f" x {self.tp} tensor parallel" if self.tp > 1 else ", no tensor parallel"
        title = (
            f"gpukit: fsdp over {self.world_size} rank(s) ({layout}): {len(self.groups)} "
            "group(s), each all-gathered only while it computes"
        )
        lines = [render_table(title, ["group", "parameters", "full size", "per rank"], rows)]
        lines.append(", ".join(f"{k}: {v}" for k, v in self.settings.items()))
        for names in self.tied:
            lines.append(f"tied: {' = '.join(names)} (kept in one group)")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


# The plans this process has printed, as text.
_SHOWN: set[str] = set()


def show_once(plan: ShardPlan) -> None:
    """Print ``plan`` unless this process printed the same plan before (a different model,
    rank count or setting is a different plan, and is printed)."""
    text = plan.render()
    if text not in _SHOWN:
        _SHOWN.add(text)
        print(text, flush=True)


def describe_plan(
    module: nn.Module, groups: list[Group], strategy: Any, *, already: list[nn.Module]
) -> ShardPlan:
    """The plan of ``module`` once sharded into ``groups`` and the root; ``already``: the
    modules the user sharded with ``fully_shard`` (then ``groups`` is empty), each listed with
    the parameters no group inside it holds."""
    shares: list[GroupShare] = []
    counted: set[int] = set()
    for group in groups:
        params = [p for p in group.parameters if id(p) not in counted]
        counted.update(id(p) for p in params)
        shares.append(_share(", ".join(_short(group.names)), params))
    names = {id(m): name for name, m in module.named_modules()}
    for sharded in reversed(already):  # modules() lists outer groups first: inner ones first
        if sharded is module or id(sharded) not in names:
            continue  # the root's are "the rest"
        params = [p for p in sharded.parameters() if id(p) not in counted]
        counted.update(id(p) for p in params)
        shares.append(_share(names[id(sharded)], params))
    shares[len(groups) :] = shares[len(groups) :][::-1]  # back in the model's order
    rest = [p for p in module.parameters() if id(p) not in counted]
    if rest:
        shares.append(_share("(root: the rest)", rest))
    o = strategy.options
    note = ""
    if already:
        note = "the model was already sharded with fully_shard: its own groups are kept"
    elif groups and groups[0].declared:
        note = f"groups: the blocks the model names in _no_split_modules ({groups[0].declared})"
    elif not groups:
        note = (
            "no repeated blocks (a list of two or more modules of one class) were found: the "
            "whole model is one group, so its full weights are gathered at once during each "
            "forward and backward"
        )
    return ShardPlan(
        groups=shares,
        world_size=strategy.world_size,
        shard=strategy.shard_size,
        replicas=o.replicas,
        tp=o.tp,
        settings={
            "reshard": o.reshard,
            "mixed": _mixed(o.mixed, already),
            "activation checkpointing": o.activation_checkpointing,
            "compile": o.compile,
            "accumulation": o.accumulation,
            **({"float8": o.float8} if o.float8 else {}),  # shown only where it is on
        },
        tied=tied_names(module),
        note=note,
    )


def _share(name: str, params: list[nn.Parameter]) -> GroupShare:
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum(_local(p).numel() * p.element_size() for p in params)
    return GroupShare(name, sum(p.numel() for p in params), full, local)


def _local(p: Any) -> Any:
    return p.to_local() if is_dtensor(p) else p


def _short(names: list[str]) -> list[str]:
    return names if len(names) <= 3 else [*names[:2], f"... {names[-1]}"]


def _mixed(option: Any, already: list[nn.Module]) -> str | None:
    """The mixed precision the groups compute with, as the plan shows it: the user's own
    ``mp_policy`` when they sharded the model (gpukit's ``mixed`` option is then refused)."""
    if already:
        policies = [p for p in mixed_policies(already) if casts(p)]
        if not policies:
            return None
        dtypes = {str(getattr(p, "param_dtype", None)).replace("torch.", "") for p in policies}
        return f"your mp_policy (parameters in {', '.join(sorted(dtypes))})"
    return option if isinstance(option, (str, type(None))) else "policy"
