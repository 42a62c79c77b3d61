"""One forward of a model over fake tensors, counting the storages autograd saves for the
backward (and those activation checkpointing would keep), block by block; what
:func:`~gpukit.planning.facts.model_facts` measures a model's activations with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpukit._util.tree import map_tensors, tensors
from gpukit.planning import repeats
from gpukit.strategies._recompute import Selection


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


@dataclass
class SavedStorage:
    """One storage the forward noted: its bytes, the block noting it (-1: none), its key and
    how many blocks the forward had entered by then; for a note (not saved by autograd),
    whether the policy keeps it and whether it is a block's input."""

    nbytes: int
    block: int
    key: int = 0
    entered: int = 0
    kept: bool = False
    block_input: bool = False


@dataclass
class ForwardRun:
    """What one fake forward at one micro-batch saved, in the order it saved it; ``notes``
    the blocks' inputs and the outputs selective checkpointing keeps inside blocks, one per
    storage, in the order noted."""

    saved: list[SavedStorage]
    output: int
    inputs: int
    targets: int
    loss: int
    notes: list[SavedStorage] = field(default_factory=list)

    def activations(self, mode: str) -> int:
        if mode == "off":
            return sum(s.nbytes for s in self.saved)
        # A checkpointed block holds its input (the recomputation starts from it) and, when
        # selective, what the policy keeps; one block at a time recomputes the rest.
        held = [n for n in self.notes if n.block_input or (mode == "selective" and n.kept)]
        keys = {n.key for n in held}
        outside = sum(s.nbytes for s in self.saved if s.block < 0 and s.key not in keys)
        per_block: dict[int, int] = {}
        for s in self.saved:
            if s.block >= 0 and s.key not in keys:
                per_block[s.block] = per_block.get(s.block, 0) + s.nbytes
        return outside + sum(n.nbytes for n in held) + max(per_block.values(), default=0)

    def backward_extra(self, mode: str) -> int:
        # The backward of the op that saved tensor k runs while tensors 0..k are still held
        # and holds about two tensors of its size (the gradient coming in, the one going out).
        if not self.saved:
            return 0
        if mode != "off":
            return 2 * max(s.nbytes for s in self.saved)
        total, held, worst = sum(s.nbytes for s in self.saved), 0, 0
        for s in self.saved:
            held += s.nbytes
            worst = max(worst, held + 2 * s.nbytes)
        return worst - total

    def stretched(self, total: int) -> ForwardRun | None:
        """This run through the first ``repeats.MEASURED`` blocks laid out for ``total``
        identical blocks, or None when the measured middle blocks differ."""
        # Whether a saved storage is also kept by the policy is the block's own; whether it is
        # the next block's input is not (the last measured block has none after it).
        kept = {n.key for n in self.notes if n.kept}
        saved = repeats.stretch(
            self.saved,
            block=lambda s: s.block,
            entered=lambda s: s.entered,
            key=lambda s: (s.nbytes, s.key in kept),
            total=total,
        )
        notes = repeats.stretch(
            self.notes,
            block=lambda n: n.block,
            entered=lambda n: n.entered,
            key=lambda n: (n.nbytes, n.kept, n.block_input),
            total=total,
        )
        if saved is None or notes is None:
            return None
        return replace(
            self,
            saved=[replace(s, block=b) for s, b in saved],
            notes=[replace(n, block=b) for n, b in notes],
        )


class _KeptOutputs(TorchDispatchMode):
    """Notes the storages that selective checkpointing keeps inside blocks: the outputs of the
    operations a fresh :class:`Selection` per block forward keeps (``current``: the block
    running, -1 outside, and the blocks entered)."""

    def __init__(self, current: list[int], note: Callable[[Any, str], None]) -> None:
        super().__init__()
        self.current, self.note = current, note
        self.selection = Selection()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.current[0] >= 0 and self.selection.keeps(func):
            for t in tensors(out):
                self.note(t.untyped_storage(), "kept")
        return out


def fake_forward(
    model: nn.Module,
    example: Any,
    batch: int,
    precision: str,
    loss: Callable[..., Any] | None,
    param_dtype: torch.dtype | None,
    blocks: list[nn.Module],
) -> ForwardRun:
    """What one forward of ``model`` (and ``loss``) saves at micro-batch ``batch``, run on
    fake copies of its parameters; ``blocks`` are those checkpointing would recompute."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    real = map_tensors(example, lambda t: torch.stack([t] * batch))
    with mode:
        fake_state = {k: _fake(mode, v, _input_device(real), param_dtype) for k, v in state.items()}
        own = {t.untyped_storage()._cdata for t in fake_state.values()}
        x, y = map_tensors(real, mode.from_tensor)
        keep: list[Any] = []  # holds counted storages alive, so their ids stay theirs
        saved: dict[int, SavedStorage] = {}
        notes: dict[int, SavedStorage] = {}
        current = [-1, 0]  # the block inside (-1: none), the blocks entered

        def note(st: Any, what: str) -> None:
            key = st._cdata
            if key in own:
                return
            if key not in notes:
                keep.append(st)
                notes[key] = SavedStorage(st.nbytes(), current[0], key, current[1])
            if what == "kept":
                notes[key].kept = True
            else:
                notes[key].block_input = True

        kept_outputs = _KeptOutputs(current, note)

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            key = st._cdata
            if key not in own and key not in saved:
                keep.append(st)
                saved[key] = SavedStorage(st.nbytes(), current[0], key, current[1])
            return t

        def enter(index: int) -> Callable[..., None]:
            def hook(_module: nn.Module, args: Any) -> None:
                current[0] = index
                current[1] += 1
                kept_outputs.selection = Selection()
                for t in tensors(args):
                    note(t.untyped_storage(), "input")

            return hook

        def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
            current[0] = -1

        hooks = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
        hooks += [b.register_forward_hook(leave) for b in blocks]
        cast = (
            torch.autocast(_device_type(x), dtype=_autocast_dtype(precision, x))
            if precision != "32"
            else contextlib.nullcontext()
        )
        try:
            with kept_outputs, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with cast:
                    out = torch.func.functional_call(model, dict(fake_state), (x,))
                before = sum(s.nbytes for s in saved.values())
                if loss is not None:
                    with cast:
                        loss(out, y)
                loss_bytes = sum(s.nbytes for s in saved.values()) - before
        finally:
            for h in hooks:
                h.remove()
        output = sum(nbytes(t) for t in tensors(out))
        if loss is None:  # a cross entropy keeps its log-probabilities: one output's size
            saved[-1] = SavedStorage(output, -1, -1, current[1])
            loss_bytes = output
        # The batch lives through the step whether saved or not.
        for t in tensors((x, y)):
            key = t.untyped_storage()._cdata
            saved.setdefault(key, SavedStorage(t.untyped_storage().nbytes(), -1, key, current[1]))
        return ForwardRun(
            list(saved.values()),
            output=output,
            inputs=sum(nbytes(t) for t in tensors(x)),
            targets=sum(nbytes(t) for t in tensors(y)),
            loss=loss_bytes,
            notes=list(notes.values()),
        )


def _fake(
    mode: Any, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None
) -> torch.Tensor:
    """A fake of ``t`` (a leaf, as a parameter is): a meta tensor's on the input's device,
    a floating one in ``dtype`` when given."""
    if not t.is_meta and (dtype is None or not t.is_floating_point()):
        return mode.from_tensor(t)
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    out = torch.empty_strided(t.shape, t.stride(), dtype=cast, device=device)
    return out.requires_grad_(t.requires_grad)


def _input_device(x: Any) -> torch.device:
    first = next(iter(tensors(x)), None)
    return first.device if first is not None else torch.device("cpu")


def _device_type(x: Any) -> str:
    first = next(iter(tensors(x)), None)
    return first.device.type if first is not None else "cpu"


def _autocast_dtype(precision: str, x: Any) -> torch.dtype:
    if precision == "16-mixed" and _device_type(x) != "cpu":
        return torch.float16
    return torch.bfloat16  # a CPU's autocast computes in bfloat16
