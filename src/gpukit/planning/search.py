"""The largest micro-batch that fits, searched with as few predictions as possible.

Each prediction is a simulation (about a second) or the closed form; the search asks for a
handful of them. It knows nothing of strategies or workloads: only a function from a
micro-batch to a predicted peak, and the capacity it must fit in.
"""

from __future__ import annotations

from collections.abc import Callable

from gpukit.errors import GpukitError

# Predictions the search for the largest micro-batch may make beyond the plan's own.
SEARCH_STEPS = 8


def largest_micro_batch(
    peak: Callable[[int], int],
    capacity: int | None,
    micro: int,
    micro_peak: int,
    notes: list[str],
    hint: int | None = None,
) -> int | None:
    """The largest micro-batch whose predicted peak fits, searched with predictions: the
    peak grows with the micro-batch along a few straight pieces (which moment of the step
    peaks can change), so each guess follows the line through the last two predictions and
    stays between the largest micro-batch known to fit and the smallest known not to; 0 when
    not even one sample fits, None when unknown (no capacity, or a prediction failed).
    ``hint`` (the answer for the same case at another accumulation, most often the answer
    here too or close to it) is tried first: when it fits and one more sample does not, that
    settles it; otherwise the search starts from it instead of twice the micro-batch.

    ``peak(m)``: the predicted peak at micro-batch ``m`` (``micro_peak`` at ``micro``, known
    already); what it cannot predict raises a :class:`~gpukit.errors.GpukitError`, and each
    way the search ends short of an answer is a line added to ``notes``.

    >>> largest_micro_batch(lambda m: 100 * m, 1000, 4, 400, [])
    10
    """
    if capacity is None:
        return None
    seen = {micro: micro_peak}

    def predict(m: int) -> int:
        if m not in seen:
            seen[m] = peak(m)
        return seen[m]

    try:
        if hint and predict(hint) <= capacity < predict(hint + 1):
            return hint
        # A peak that does not grow between the two (the optimizer step's moment can peak
        # over a small micro-batch's backward) sends the search doubling, not giving up.
        last = sorted((micro, hint if hint and hint != micro else 2 * micro))
        predict(last[1])
        nudged = False
        for _ in range(SEARCH_STEPS):
            lo = max((m for m, p in seen.items() if p <= capacity), default=0)
            hi = min((m for m, p in seen.items() if p > capacity), default=None)
            if hi is not None and hi - lo <= 1:
                return lo
            (x1, y1), (x2, y2) = ((m, seen[m]) for m in last)
            slope = (y2 - y1) / (x2 - x1) if x2 != x1 else 0.0
            guess = int(x2 + (capacity - y2) // slope) if slope > 0 else 2 * max(lo, 1)
            # A line that lands on or past a bound says the answer is next to it: one step
            # inside settles it, and bisecting (after one such step) keeps a bad line from
            # crawling.
            bound = hi if hi is not None else guess + 1
            if not nudged and (guess <= lo or guess >= bound):
                guess, nudged = (lo + 1 if guess <= lo else bound - 1), True
            elif not lo < guess < bound or guess in seen:
                guess, nudged = ((lo + hi) // 2 if hi is not None else 2 * max(lo, 1)), False
            else:
                nudged = False
            if guess < 1 or guess in seen:
                return lo
            seen[guess] = peak(guess)
            last = [last[-1], guess]
    except GpukitError as err:
        notes.append(f"largest micro-batch unknown: {err}")
        return None
    lo = max((m for m, p in seen.items() if p <= capacity), default=0)
    notes.append(f"largest micro-batch: at least {lo} (the search stopped)")
    return lo
