"""The computations that ``multidevice`` times: ``C = Aⁿ + Bⁿ`` (each power by n - 1 products
of matrices), and the ways of spreading it over two devices, two streams or two threads.

Apart from the experiment, so that each way can be checked to give the same C as the others,
small and on the CPU, without timing anything. Each function takes its inputs already on
their devices and returns when the host has the result (or, for the products, once queued);
``matches`` tells whether two of them computed the same C.

>>> power(2 * torch.eye(2), 10)[0, 0].item()
1024.0
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gpukit.bench.measure import tf32_matmul

POWER = 10


def power(m: torch.Tensor, n: int = POWER) -> torch.Tensor:
    """``m`` to the ``n``-th power by ``n - 1`` products, on ``m``'s device (on a GPU they are
    queued and the call returns before they run).

    >>> power(torch.tensor([[1.0, 1.0], [0.0, 1.0]]), 3).tolist()
    [[1.0, 3.0], [0.0, 1.0]]
    """
    out = m
    for _ in range(n - 1):
        out = out @ m
    return out


def sum_of_powers(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``Aⁿ + Bⁿ`` on the CPU, each power on its matrix's device. Both are queued before the
    host waits for either: on two GPUs they run at once; with B on the CPU, the CPU computes
    Bⁿ while the GPU computes Aⁿ.

    >>> sum_of_powers((torch.eye(2), 2 * torch.eye(2)))[0, 0].item()
    1025.0
    """
    an, bn = power(pair[0]), power(pair[1])  # A's queued first: its device starts first
    return an.cpu() + bn.cpu()  # the host waits here, for each device in turn


def one_after_the_other(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``Aⁿ + Bⁿ`` on the CPU, Aⁿ finished and copied back before Bⁿ starts.

    >>> one_after_the_other((torch.eye(2), 2 * torch.eye(2)))[0, 0].item()
    1025.0
    """
    an = power(pair[0]).cpu()
    return an + power(pair[1]).cpu()


def on_two_streams(
    pair: tuple[torch.Tensor, torch.Tensor], streams: tuple[torch.cuda.Stream, torch.cuda.Stream]
) -> torch.Tensor:
    """``Aⁿ + Bⁿ`` on the CPU, A's power on the first stream and B's on the second, both of
    A's GPU."""
    a, b = pair
    first, second = streams
    with torch.cuda.device(a.device):
        current = torch.cuda.current_stream()
        # A and B were written on the current stream: the side streams start after that.
        first.wait_stream(current)
        second.wait_stream(current)
        # Read on the side streams: their memory must not be handed out again before those
        # reads are done, even if the caller drops them early.
        a.record_stream(first)
        b.record_stream(second)
        with torch.cuda.stream(first):
            an = power(a)
        with torch.cuda.stream(second):
            bn = power(b)
        # The copies back run on the current stream: after both powers are done...
        current.wait_stream(first)
        current.wait_stream(second)
        # ...and the powers' memory, allocated on the side streams, stays theirs until then.
        an.record_stream(current)
        bn.record_stream(current)
        return an.cpu() + bn.cpu()


def in_two_threads(
    pair: tuple[torch.Tensor, torch.Tensor], pool: ThreadPoolExecutor
) -> torch.Tensor:
    """``Aⁿ + Bⁿ``, the powers computed at once in two threads of ``pool``, one intra-op
    thread each.

    >>> with ThreadPoolExecutor(2) as pool:
    ...     in_two_threads((torch.eye(2), 2 * torch.eye(2)), pool)[0, 0].item()
    1025.0
    """
    an, bn = (f.result() for f in [pool.submit(_power_one_thread, m) for m in pair])
    return an + bn


def _power_one_thread(m: torch.Tensor) -> torch.Tensor:
    # Per thread: intra-op threads are a setting of the thread that runs the op.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return power(m)


def products_in_turn(both: Any) -> tuple[torch.Tensor, torch.Tensor]:
    (x0, y0), (x1, y1) = both
    p0 = x0 @ y0
    torch.cuda.synchronize(x0.device)  # the second GPU starts when the first has finished
    p1 = x1 @ y1
    return p0, p1


def products_at_once(both: Any) -> tuple[torch.Tensor, torch.Tensor]:
    (x0, y0), (x1, y1) = both
    return x0 @ y0, x1 @ y1  # both queued; measure() waits for both devices


def first_power(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return power(pair[0]).cpu()


def tolerance() -> float:
    """How far apart two ways of computing C may round (relative), as matmuls run here."""
    # TF32 (or bfloat16) products keep 10 bits of mantissa (or 7): two GPUs of different
    # models, or the CPU and a GPU, may round apart by more than float32's 23 bits would.
    return 1e-3 if tf32_matmul() is False else 1e-2  # unreadable: assume the looser


def matches(out: Any, reference: Any) -> bool:
    """Whether ``out`` (a tensor, or a tuple of them) equals ``reference`` to within the
    tolerance, relative to the reference's largest entry.

    >>> matches(torch.ones(2), torch.ones(2) + 1e-6), matches((torch.ones(2),), (torch.zeros(2),))
    (True, False)
    """
    if isinstance(out, (tuple, list)):
        return len(out) == len(reference) and all(map(matches, out, reference))
    got, want = out.detach().cpu().float(), reference.detach().cpu().float()
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return False
    scale = float(want.abs().max()) if want.numel() else 0.0
    tol = tolerance()
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * scale))
