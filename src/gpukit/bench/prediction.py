"""The planner's prediction for a configuration a benchmark trained, beside what it measured.

``gpukit train``'s loop records each device's peak of live tensors over the first optimizer
steps (``peak_tensors`` of its memory rows: counted op by op on a CPU, the caching allocator's
max allocated on CUDA). The planner predicts that same quantity. :func:`predict` asks it for
the configuration as it ran (its micro-batch per device and its precision):

- the simulation (:func:`gpukit.planning.simulate.simulate`: gpukit's training code over fake
  tensors and a fake process group, counted as a CPU run counts), for single, ddp and fsdp;
- the closed form (:func:`gpukit.planning.closed_form.closed_form`) where the simulation cannot
  run (dp and dp-balanced drive every GPU from one process; a process already in a process
  group), with the simulation's reason kept.

On CUDA each tensor is rounded up to the allocator's 512-byte blocks, as it counts them. The
simulation runs on this CPU, so a ``16-mixed`` run is predicted with bf16 autocast (the same
two-byte activations); the batch a CUDA loader prefetches during a step is not in it. Then
:func:`tensor_columns` sets measured and predicted side by side.

>>> cells = tensor_columns([{"peak_tensors": 1000}, {"peak_tensors": 800}], [1010, 796])
>>> round(cells["tensors_error"], 2), cells["predicted_others"] * MiB
(1.0, 796.0)
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Sequence
from typing import Any

from gpukit.planning.closed_form import closed_form, model_facts
from gpukit.planning.simulate import SimulationUnsupported, simulate
from gpukit.workloads import load_workload

MiB = 2**20
CUDA_GRANULE = 512  # bytes: the caching allocator's smallest block


def predict(
    workload: str, strategy: str, devices: Sequence[str], *, micro_batch: int, precision: str
) -> dict[str, Any]:
    """The planner's peak of tensors per device (``peaks``, bytes) for ``workload`` trained
    with ``strategy`` on ``devices`` at ``micro_batch`` samples per device and ``precision``,
    how it was found (``method``) and why not by simulation (``note``). A prediction that
    fails does not raise: ``peaks`` is None and ``error`` says why.

    >>> found = predict("mlp", "single", ["cpu"], micro_batch=8, precision="32")
    >>> found["method"], len(found["peaks"])
    ('simulation', 1)
    """
    found: dict[str, Any] = {"micro_batch": micro_batch, "precision": precision, "note": None}
    granularity = CUDA_GRANULE if any(str(d).startswith("cuda") for d in devices) else 1
    local = "bf16-mixed" if precision == "16-mixed" else precision
    shape: dict[str, Any] = {
        "strategy": strategy,
        "devices": len(devices),
        "micro_batch": micro_batch,
        "precision": local,
        "granularity": granularity,
    }
    start = time.perf_counter()
    try:
        try:
            peaks = simulate(workload, **shape)
            found["method"] = "simulation"
        except SimulationUnsupported as why:
            found.update(method="closed-form", note=str(why))
            built = load_workload(workload)
            with contextlib.redirect_stdout(io.StringIO()):  # a prediction prints nothing
                facts = model_facts(built.model, built.dataset[0], precision=local, loss=built.loss)
            peaks = closed_form(facts, **shape)
    except Exception as err:  # the prediction must not cost the measurement its row
        return {**found, "method": None, "peaks": None, "error": f"{type(err).__name__}: {err}"}
    return {
        **found,
        "peaks": [p.tensor_bytes for p in peaks],
        "seconds": time.perf_counter() - start,
    }


def tensor_columns(
    memory: Sequence[dict[str, Any]], predicted: Sequence[int] | None
) -> dict[str, Any]:
    """Table cells from a run's memory rows (their ``peak_tensors``) and :func:`predict`'s
    ``peaks``: measured and predicted MiB of the first device (``tensors_first``,
    ``predicted_first``) and of the fullest other (``tensors_others``, ``predicted_others``),
    and ``tensors_error``, the larger of their two errors in % ((predicted - measured) /
    measured). A figure missing on either side leaves its cells None.

    >>> cells = tensor_columns([{"peak_tensors": None}], [2 * MiB])
    >>> cells["tensors_first"], cells["predicted_first"], cells["tensors_error"]
    (None, 2.0, None)
    """
    measured = [m.get("peak_tensors") for m in memory]
    cells: dict[str, Any] = {}
    errors = []
    for name, part in (("first", slice(0, 1)), ("others", slice(1, None))):
        got, want = measured[part], list(predicted or [])[part]
        known = [v for v in got if v is not None]
        cells[f"tensors_{name}"] = max(known) / MiB if known and len(known) == len(got) else None
        cells[f"predicted_{name}"] = max(want) / MiB if want else None
        if cells[f"tensors_{name}"] and cells[f"predicted_{name}"] is not None:
            errors.append(100.0 * (max(want) - max(known)) / max(known))
    cells["tensors_error"] = max(errors, key=abs, default=None)
    return cells
