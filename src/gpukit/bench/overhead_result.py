"""What the ``overhead`` experiment measured: per variant its timings over the rounds and their
ratios to plain PyTorch, with the machine and the workload; as a table, JSON, and the suite's
result form.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from gpukit.bench import overhead_loops as loops
from gpukit.bench.result import BenchResult, Column
from gpukit.errors import ConfigError

WORKLOAD = {
    "model": "mlp 32-64-64-4, ReLU",
    "optimizer": f"AdamW(lr={loops.LR})",
    "loss": "cross_entropy",
    "batch_size": loops.BATCH_SIZE,
    "dtype": "float32",
    "device": "cpu",
    "seed": loops.SEED,
    "data": "a list of batches built once, in memory",
}


@dataclass(frozen=True)
class VariantResult:
    """One variant's timings, per round; empty with a ``note`` when it could not run."""

    name: str
    version: str | None
    seconds: tuple[float, ...] = ()  # seconds per step, one per round
    ratios: tuple[float, ...] = ()  # these seconds / plain's in the same round
    note: str = ""  # "not installed", or why it failed
    settings: dict[str, Any] = field(default_factory=dict)  # what the wrapper was built with
    baseline: str = "plain"
    baseline_ratios: tuple[float, ...] = ()  # these seconds / the baseline's, per round

    @property
    def available(self) -> bool:
        return bool(self.seconds)

    @property
    def seconds_per_step(self) -> float | None:
        """Median over the rounds of the seconds per step."""
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def ratio(self) -> float | None:
        """Median over the rounds of the ratio to plain (exactly 1.0 for plain)."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def baseline_ratio(self) -> float | None:
        """Median over the rounds of the ratio to this variant's own baseline."""
        return statistics.median(self.baseline_ratios) if self.baseline_ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "version": self.version,
            "note": self.note,
            "settings": dict(self.settings),
            "seconds_per_step": self.seconds_per_step,
            "ratio_to_plain": self.ratio,
            "seconds_per_step_by_round": list(self.seconds),
            "ratio_to_plain_by_round": list(self.ratios),
            "baseline": self.baseline,
            "ratio_to_baseline": self.baseline_ratio,
        }


@dataclass(frozen=True)
class OverheadResult:
    """What :func:`run_overhead` measured, with the machine and settings it measured on."""

    steps: int
    rounds: int
    variants: tuple[VariantResult, ...]
    environment: dict[str, Any]

    def variant(self, name: str) -> VariantResult:
        """The result of variant ``name`` (one of :data:`VARIANTS`' names)."""
        for v in self.variants:
            if v.name == name:
                return v
        names = ", ".join(v.name for v in self.variants)
        raise ConfigError(f"no variant {name!r} in this result: it has {names}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, environment, and per variant its medians and raw rounds."""
        return {
            "schema_version": 1,
            "benchmark": "overhead",
            "steps": self.steps,
            "rounds": self.rounds,
            "warmup_steps": self.steps,
            "workload": dict(WORKLOAD),
            "environment": self.environment,
            "variants": [v.to_dict() for v in self.variants],
        }

    def table(self) -> Table:
        """A rich table: one row per variant, the environment in the caption."""
        env = self.environment
        table = Table(
            title=f"gpukit bench overhead: {self.steps} steps × {self.rounds} rounds, "
            f"CPU, {env['threads']} thread(s)",
            caption=f"{env['cpu']}; torch {env['torch']}; Python {env['python']}; "
            f"{env['date']}\nratio: median of the per-round ratios to plain; range: their "
            "lowest and highest; × baseline: the same, to the plain loop doing the same work ("
            + ", ".join(f"{v.name}: {v.baseline}" for v in self.variants if v.baseline != "plain")
            + ")",
            title_justify="left",
            caption_justify="left",
            header_style="bold",
        )
        columns = (
            "variant",
            "version",
            "µs/step (median)",
            "× plain",
            "range",
            "× baseline",
            "settings",
        )
        for column in (*columns, "note"):
            table.add_column(column, overflow="fold", no_wrap=column in ("variant", "note"))
        for v in self.variants:
            settings = ", ".join(f"{k}={val}" for k, val in v.settings.items())
            if v.seconds_per_step is None or v.ratio is None:
                table.add_row(v.name, v.version or "-", "-", "-", "-", "-", settings, v.note)
                continue
            spread = f"{min(v.ratios):.3f}-{max(v.ratios):.3f}"
            per_step = f"{v.seconds_per_step * 1e6:.1f}"
            own = "-" if v.baseline == "plain" else f"{v.baseline_ratio:.3f}"
            table.add_row(v.name, v.version, per_step, f"{v.ratio:.3f}", spread, own, settings, "")
        return table


def as_result(result: OverheadResult, quick: bool = False) -> BenchResult:
    """The overhead result in the suite's form: one row per variant."""
    rows = []
    for v in result.variants:
        rows.append(
            {
                "variant": v.name,
                "version": v.version,
                "us_per_step": v.seconds_per_step * 1e6 if v.seconds_per_step else None,
                "ratio": v.ratio,
                "low": min(v.ratios) if v.ratios else None,
                "high": max(v.ratios) if v.ratios else None,
                "baseline": v.baseline,
                "ratio_to_baseline": v.baseline_ratio if v.baseline != "plain" else None,
                "settings": ", ".join(f"{k}={val}" for k, val in v.settings.items()),
                "note": v.note,
            }
        )
    default = result.variant("gpukit-train-default")
    return BenchResult(
        experiment="overhead",
        title=f"overhead: {result.steps} steps x {result.rounds} rounds, CPU, "
        f"{result.environment['threads']} thread(s)",
        keys=("variant",),
        columns=(
            Column("variant"),
            Column("version", compare=False),
            Column("us_per_step", "time per step", "µs", 1),
            Column("ratio", "× plain", "", 3),
            Column("low", "lowest", "", 3, compare=False),
            Column("high", "highest", "", 3, compare=False),
            Column("ratio_to_baseline", "× baseline", "", 3),
            Column("note"),
        ),
        rows=rows,
        summary={
            "gpukit train defaults x plain-logged": default.baseline_ratio,
            "gpukit x plain": result.variant("gpukit").ratio,
            "heartbeat x gpukit-train-default": result.variant("gpukit+heartbeat").baseline_ratio,
        },
        notes=[
            "× plain: median of the per-round ratios to plain; lowest/highest: their range",
            "× baseline: the same, to the plain loop doing the same work "
            "(gpukit-train-default and the loggers: plain-logged; gpukit+heartbeat: "
            "gpukit-train-default)",
            "the limit: 1.000, the plain loop itself; a busy machine widens the range first",
        ],
        parameters={
            "steps": result.steps,
            "rounds": result.rounds,
            "quick": quick,
            "workload": dict(WORKLOAD),
        },
        environment=result.environment,
        raw={"variants": [v.to_dict() for v in result.variants]},
    )
