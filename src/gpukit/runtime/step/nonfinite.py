"""The non-finite guard: a step whose gradients hold NaN or Inf is skipped on the device, or
stops the run, without reading anything back per step.

Each optimizer step computes the total gradient norm on the device (the one clipping computes,
when it clips) and from it a 0/1 flag, non-finite. With ``"skip"``, the flag is handed to the
optimizer as the ``found_inf`` that fused optimizers (``AdamW(..., fused=True)``, ``Adam``,
``SGD``) take from a gradient scaler: the kernel leaves the parameters, the optimizer state and
its step count as they were. The flags are summed on the device, with the first bad step and
the longest run of bad steps in a row, and read back once every ``log_every`` steps (one small
read per logging window, never per step). A run of ``MAX_SKIPS_IN_A_ROW`` skipped steps raises:
the run is not recovering. With ``"raise"`` the first read that finds a bad step raises
:class:`~gpukit.errors.NonFiniteError` naming the step and whether this rank's own loss was
the bad one (under DDP the gradient all-reduce spreads one rank's NaN to every rank, so all
ranks see the same flag without a collective of their own).

>>> import torch
>>> guard = NonFiniteGuard("skip", log_every=1)
>>> guard.found([torch.tensor([1.0, float("nan")])])
tensor(1.)
"""

from __future__ import annotations

from typing import Literal

import torch

from gpukit.errors import ConfigError, NonFiniteError
from gpukit.strategies._fsdp_api import is_dtensor

NonFinitePolicy = Literal["skip", "raise"]
MAX_SKIPS_IN_A_ROW = 10


def check_policy(policy: object) -> None:
    """ConfigError unless ``policy`` is "skip" or "raise"."""
    if policy not in ("skip", "raise"):
        raise ConfigError(
            f"nonfinite={policy!r}: use 'skip' (a step with NaN/Inf gradients is skipped "
            "on the device), 'raise' (stop at the next read-back naming the step), or None"
        )


class NonFiniteGuard:
    """See the module docstring. Per step: ``loss`` notes the rank's loss, ``found`` makes the
    step's flag, ``skip_step`` hands it to the optimizer, ``update`` counts it; at the end of a
    logging window ``read`` reads the counters back."""

    def __init__(self, policy: NonFinitePolicy, log_every: int, precision: str = "32") -> None:
        check_policy(policy)
        if precision == "16-mixed":
            raise ConfigError(
                f"nonfinite={policy!r} with precision='16-mixed': its gradient scaler already "
                "skips every step whose gradients overflow (and lowers the scale), which the "
                "guard would count as failures; leave nonfinite=None under 16-mixed"
            )
        self.policy = policy
        self.log_every = log_every
        self.skipped = 0  # steps skipped so far, as last read back
        # On the device: bad steps, the first bad step (-1: none), the current run of bad
        # steps, the longest run, whether this rank's own loss was bad at the first one.
        self._counters: torch.Tensor | None = None
        self._flag: torch.Tensor | None = None  # this step's: 1.0 when non-finite
        self._loss_bad: torch.Tensor | None = None
        self._checked: set[int] = set()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``"skip"`` needs an optimizer that can skip a step on the device."""
        if self.policy != "skip" or id(optimizer) in self._checked:
            return
        if not optimizer.defaults.get("fused"):
            raise ConfigError(
                f"nonfinite='skip' needs an optimizer that skips a step on the device: "
                f"{type(optimizer).__name__} was built without fused=True. Build it with "
                f"fused=True (e.g. torch.optim.AdamW(params, lr=..., fused=True); torch 2.4+ "
                "has fused Adam, AdamW and SGD on CPUs and GPUs), or use nonfinite='raise'"
            )
        self._checked.add(id(optimizer))

    def loss(self, loss: torch.Tensor) -> None:
        """Note whether this rank's loss is finite (a device op, no read)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def found(self, grads: list[torch.Tensor], norm: torch.Tensor | None = None) -> torch.Tensor:
        """The step's flag (1.0: NaN or Inf somewhere) from the total norm of ``grads``, or
        from ``norm`` when clipping already made it; on the device."""
        if norm is None:
            if grads:
                norms = torch._foreach_norm(grads)
                device = norms[0].device
                norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
            else:
                norm = torch.zeros(())
        if is_dtensor(norm):
            # Sharded gradients (fsdp): each rank's norm covers its shards only. The full norm
            # (one small all-reduce, no read) makes every rank skip the same steps, and gives
            # fused optimizers the plain tensor they take as ``found_inf``.
            norm = norm.full_tensor()  # type: ignore[union-attr]  # a DTensor here
        self._flag = (~torch.isfinite(norm)).to(torch.float32)
        return self._flag

    def skip_step(self, optimizer: torch.optim.Optimizer) -> dict[str, object]:
        """Hand the flag to a fused optimizer for its coming step; returns what to restore."""
        if self.policy != "skip" or self._flag is None:
            return {}
        saved = {k: getattr(optimizer, k, None) for k in ("found_inf", "grad_scale")}
        # The ignores: fused optimizers read these attributes, which Optimizer does not declare.
        optimizer.found_inf = self._flag  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        return saved

    @staticmethod
    def restore(optimizer: torch.optim.Optimizer, saved: dict[str, object]) -> None:
        """Put back the optimizer's attributes :meth:`skip_step` replaced."""
        for name, value in saved.items():
            if value is not None:
                setattr(optimizer, name, value)
            elif hasattr(optimizer, name):
                delattr(optimizer, name)

    def update(self, step: int) -> None:
        """After optimizer step number ``step``: add its flag to the counters (device ops)."""
        flag, self._flag = self._flag, None
        if flag is None:
            return
        if self._counters is None:
            self._counters = torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0], device=flag.device)
        counters = self._counters
        loss_bad = (
            self._loss_bad.to(flag.device, torch.float32)
            if self._loss_bad is not None
            else torch.zeros((), device=flag.device)
        )
        self._loss_bad = None
        run = (counters[2] + 1) * flag
        first_now = (counters[1] < 0).to(torch.float32) * flag  # 1.0 at the first bad step
        self._counters = torch.stack(
            [
                counters[0] + flag,
                counters[1] + first_now * (step + 1),  # -1 + step + 1: the step's number
                run,
                torch.maximum(counters[3], run),
                torch.maximum(counters[4], first_now * loss_bad),
            ]
        )

    def due(self, step: int) -> bool:
        """Whether the end of step ``step`` closes a logging window: time to read back."""
        return self._counters is not None and step % self.log_every == 0

    def read(self, rank: int) -> int:
        """Read the counters back (one small read) and raise when the policy says so; the
        steps skipped so far."""
        if self._counters is None:
            return self.skipped
        bad, first, _run, longest, mine = (int(v) for v in self._counters.tolist())
        self.skipped = bad
        if not bad:
            return bad
        whose = (
            f"rank {rank}'s own loss was not finite"
            if mine
            else f"rank {rank}'s loss was finite: the NaN/Inf came from another rank through "
            "the gradient all-reduce, or from the backward itself"
        )
        if self.policy == "raise":
            raise NonFiniteError(
                f"the gradients of step {first} hold NaN or Inf on rank {rank} ({whose}). Look "
                "for a learning rate too high, a log or division of zero, or bad input at that "
                "step; nonfinite='skip' skips such steps instead"
            )
        if longest >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(
                f"{longest} steps in a row had NaN or Inf gradients on rank {rank} (the first "
                f"at step {first}; {whose}): skipping is not helping, the run diverges. Lower "
                "the learning rate, clip gradients, or resume from an earlier checkpoint"
            )
        return bad
