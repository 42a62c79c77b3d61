"""Profiles of a window of training steps: ``torch.profiler``'s trace, written as Chrome/Perfetto
JSON, and its top ops by self time as a table.

A :class:`StepProfile` profiles the steps a schedule picks (``wait`` steps untouched, ``warmup``
steps profiled and thrown away, ``active`` steps kept; ``repeat`` such windows) and counts the
steps itself, so the loop adds nothing. What a step is, ``steps=``:

- ``"runtime"``: the optimizer steps of one ``gk.Runtime`` (``owner``, its stepper), which tells
  :func:`step_ended` after each one (what ``rt.profile`` uses);
- ``"optimizer"``: the ``step()`` calls of the first optimizer that steps (a GAN's second
  optimizer does not count twice), seen by ``torch.optim``'s global step hook;
- ``"auto"``: optimizer steps until a Runtime reports one of its steps, then the Runtime's
  (what ``gpukit trace --profile`` uses on any script).

Each window becomes ``FOLDER/gpukit_rank{R}.{LAST_STEP}.pt.trace.json``, the name TensorBoard's
profiler plugin reads (worker ``gpukit_rank{R}``, one span per window): ``chrome://tracing``
and https://ui.perfetto.dev open it too. Beside it, ``...summary.txt`` holds the table of
``key_averages()`` ranked by self time (on the GPU when CUDA was profiled, else on the CPU).
A window the program ends inside is written with the steps it reached.

>>> import tempfile, torch
>>> folder = tempfile.mkdtemp()
>>> with StepProfile(folder, wait=0, warmup=1, active=1, steps="optimizer") as prof:
...     p = torch.nn.Parameter(torch.ones(2))
...     opt = torch.optim.SGD([p], lr=0.1)
...     for _ in range(3):
...         p.sum().backward()
...         opt.step()
>>> [(w.first, w.last) for w in prof.windows], prof.windows[0].path.name
([(2, 2)], 'gpukit_rank0.2.pt.trace.json')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from gpukit._util import placement
from gpukit._util.files import make_folder, replaced, write_atomic
from gpukit.diagnostics import one_profiler
from gpukit.errors import ConfigError

StepSource = Literal["auto", "runtime", "optimizer"]
SOURCES: tuple[StepSource, ...] = ("auto", "runtime", "optimizer")
ROWS = 15  # rows of the summary table
_active: list[StepProfile] = []  # the profiles counting steps now, in this process


@dataclass(frozen=True)
class Window:
    """One profiled window: its steps (counted from 1 at the profile's start, or the Runtime's
    global steps for ``steps="runtime"``), the trace file, the table and its file."""

    first: int
    last: int
    rank: int
    path: Path
    table_path: Path
    table: str


class StepProfile:
    """``torch.profiler.profile`` over a step schedule; see the module's text."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        steps: StepSource = "auto",
        owner: object = None,
        rank: int | None = None,
        offset: int = 0,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        for name, value, least in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"profile({name}={value!r}): give a whole number of at least {least} "
                    "(wait: steps skipped, warmup: steps profiled and dropped, active: steps "
                    "kept, repeat: how many such windows)"
                )
        if steps not in SOURCES:
            raise ConfigError(f"profile(steps={steps!r}): use one of {', '.join(SOURCES)}")
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"profile folder {self.folder} is a file: give a folder")
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.source: StepSource = steps
        self.owner = owner
        self.rank = rank  # None: found when a window is written (the group is up by then)
        self.offset = offset
        self.steps = 0  # steps counted since the profile began
        self.windows: list[Window] = []
        self._record_shapes, self._with_stack = record_shapes, with_stack
        self._profiler: Any = None
        self._hook: Any = None
        self._optimizer: int | None = None  # id of the optimizer whose steps count
        self._runtime_seen = False
        self._counted_by_optimizer = False

    @property
    def cuda(self) -> bool:
        return torch.cuda.is_available()

    def __enter__(self) -> StepProfile:
        if self._profiler is not None:
            raise ConfigError("this profile is already active: start a new one")
        if _active:
            raise ConfigError(
                f"a profile of {self.folder} started inside the profile of {_active[0].folder} "
                "(rt.profile inside rt.profile, or under gpukit trace --profile): two "
                "profilers at once crash the process (a segmentation fault inside torch's "
                "profiler). End the first block before the second begins, or drop one"
            )
        one_profiler.refuse_if_recording(f"profile of {self.folder}")
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.profiler import ProfilerActivity, profile, schedule

        make_folder(self.folder, option="the profile's folder")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        every = schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat)
        self._profiler = profile(
            activities=activities,
            schedule=every,
            on_trace_ready=self._ready,
            record_shapes=self._record_shapes,
            with_stack=self._with_stack,
        )
        self._profiler.__enter__()
        one_profiler.guard()  # after ours started: from here another one is refused
        if self.source != "runtime":
            self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _active:
            _active.remove(self)
        if not _active:
            one_profiler.unguard()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)  # a window left open is written as it is

    def step(self) -> None:
        """One step ended: the schedule moves on."""
        self.steps += 1
        if self._profiler is not None:
            self._profiler.step()

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._runtime_seen:
            return  # a Runtime's steps count instead
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        if id(optimizer) == self._optimizer:
            self._counted_by_optimizer = True
            self.step()

    def runtime_step_ended(self, owner: object) -> None:
        if self.source == "optimizer" or (self.source == "runtime" and owner is not self.owner):
            return
        if self.source == "auto" and not self._runtime_seen:
            self._runtime_seen = True
            if self._counted_by_optimizer:
                # The Runtime's first step reached here after its optimizer's step counted.
                # From now on the Runtime's steps count.
                self._counted_by_optimizer = False
                return
        self.step()

    @property
    def files(self) -> list[Path]:
        return [w.path for w in self.windows]

    @property
    def window(self) -> tuple[int, int]:
        """The first window's steps (as :class:`Window` counts them)."""
        first = self.offset + self.wait + self.warmup + 1
        return first, first + self.active - 1

    def report(self) -> str:
        """Where each window went and its table; or why nothing was written."""
        if not self.windows:
            first, last = self.window
            return (
                f"Profile: nothing written: {self.steps} steps ran, the window was steps "
                f"{first}-{last} (wait {self.wait}, warmup {self.warmup}, active {self.active}); "
                "run more steps or a shorter wait and warmup"
            )
        parts = []
        for w in self.windows:
            span = f"step {w.first}" if w.first == w.last else f"steps {w.first}-{w.last}"
            parts.append(f"Profile of {span} (rank {w.rank}): {w.path}\n{w.table}")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"steps_counted", "source", "windows": [{first, last, path, table}]}``."""
        return {
            "steps_counted": self.steps,
            "source": self.source,
            "windows": [
                {
                    "first": w.first,
                    "last": w.last,
                    "rank": w.rank,
                    "path": str(w.path),
                    "table": str(w.table_path),
                }
                for w in self.windows
            ],
        }

    def _ready(self, prof: Any) -> None:
        cycle = self.wait + self.warmup + self.active
        first = len(self.windows) * cycle + self.wait + self.warmup + 1
        last = max(first, min(prof.step_num, first + self.active - 1))
        first, last = first + self.offset, last + self.offset
        rank = _rank() if self.rank is None else self.rank
        name = f"gpukit_rank{rank}.{last}"
        path = self.folder / f"{name}.pt.trace.json"
        with replaced(path, option="the profile's folder") as temporary:
            prof.export_chrome_trace(str(temporary))
        table = prof.key_averages().table(sort_by=_sort_key(prof, self.cuda), row_limit=ROWS)
        table_path = self.folder / f"{name}.summary.txt"
        write_atomic(table_path, table + "\n", option="the profile's folder")
        self.windows.append(Window(first, last, rank, path, table_path, table))


def step_ended(owner: object) -> None:
    """A Runtime's optimizer step ended (``owner``: its stepper): the profiles counting steps
    move on. One empty-list check when none is active."""
    for profile in _active:
        profile.runtime_step_ended(owner)


def _sort_key(prof: Any, cuda: bool) -> str:
    if not cuda:
        return "self_cpu_time_total"
    averages = prof.key_averages()
    if averages and hasattr(averages[0], "self_device_time_total"):
        return "self_device_time_total"
    return "self_cuda_time_total"  # torch before 2.4's device-neutral names


def _rank() -> int:
    """This process's rank: torch.distributed's when it is running, else its launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    launched = placement.launched()
    return launched.rank if launched is not None else 0
