"""What the planner's closed form needs to know of a model, measured once without its memory.

A model's states (parameters, gradients, optimizer state) follow from its parameters' shapes;
its activations do not: they depend on what each operation saves for the backward. So
:func:`model_facts` runs the forward (and the loss, when given) under fake tensors, which have
shapes and dtypes but no data, at micro-batch 1 and 2, and counts the unique storages that
autograd saves. The growth from 1 to 2 is the per-sample part, the rest the fixed part. Nothing
of the user's model changes: the forward runs on fake copies of its parameters. A model of
identical blocks runs through its first few only (:mod:`gpukit.planning.repeats`: its block
list is shortened while measuring and restored), with the same result.

Under ``activation_checkpointing`` the blocks fsdp shards and recomputes (its groups'
modules, ``find_groups``: a ``transformers`` model's ``_no_split_modules``) keep less:
``"full"`` only each block's input, plus one block's own saved tensors while it is recomputed
in the backward; ``"selective"`` also what its policy keeps (every second matrix product's
output and attention's, counted by the same :class:`Selection` that training asks), whether
the backward needs them or not.

>>> import torch
>>> from torch import nn
>>> facts = model_facts(nn.Linear(4, 2), (torch.ones(4), torch.tensor(0)))
>>> facts.trainable_bytes, facts.activation_bytes_per_sample
(40, 32)
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
from gpukit.errors import ConfigError
from gpukit.planning import repeats
from gpukit.strategies._groups import find_groups
from gpukit.strategies._recompute import Selection

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
CHECKPOINTING = ("off", "full", "selective")


@dataclass(frozen=True)
class ModelFacts:
    """A model's memory-relevant facts in bytes (see the module doc). ``parameter_rows`` holds
    each unique parameter's ``(rows, bytes per row, trains)``, what fsdp's sharding along dim
    0 needs; ``backward_bytes_*`` the gradients of activations alive at the backward's peak on
    top of what the forward saved; ``loss_bytes_per_sample`` the part of the activations the
    loss saved (under ``dp`` it sits on the first device for the whole batch)."""

    trainable_bytes: int
    frozen_bytes: int
    buffer_bytes: int
    trainable_numel: int
    largest_group_bytes: int
    activation_bytes_per_sample: int
    activation_bytes_fixed: int
    output_bytes_per_sample: int
    input_bytes_per_sample: int
    flops_per_sample: float = 0.0
    target_bytes_per_sample: int = 0
    loss_bytes_per_sample: int = 0
    backward_bytes_per_sample: int = 0
    backward_bytes_fixed: int = 0
    root_group_bytes: int = 0
    block_groups: int = 0
    activation_tensors: int = 0
    buffer_tensors: int = 0
    parameter_rows: tuple[tuple[int, int, bool], ...] = ()
    largest_block_bytes: int = 0  # the largest group but the root (0: unknown)

    def activations(self, micro_batch: int) -> int:
        """Bytes saved for the backward at ``micro_batch`` samples."""
        return max(0, self.activation_bytes_fixed + self.activation_bytes_per_sample * micro_batch)

    def backward_extra(self, micro_batch: int) -> int:
        """Gradients of activations at the backward's peak, at ``micro_batch`` samples."""
        return max(0, self.backward_bytes_fixed + self.backward_bytes_per_sample * micro_batch)


def model_facts(
    model: nn.Module,
    example: Any,
    *,
    precision: str = "32",
    activation_checkpointing: str = "off",
    flops_per_sample: float = 0.0,
    loss: Callable[..., Any] | None = None,
    param_dtype: torch.dtype | None = None,
) -> ModelFacts:
    """Measure ``model``'s facts from one ``(input, target)`` item ``example`` (see the
    module doc); ``loss(output, target)``, when given, is counted too, else the loss is
    assumed to keep one output-sized tensor (a cross entropy's log-probabilities).
    ``param_dtype``: the floating parameters computed in that dtype (FSDP2's mixed precision
    gathers them so), which the activations then are too. A model on the meta device is
    measured the same way: its parameters only give shapes."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision {precision!r} is not one the planner models: use one of {PRECISIONS}"
        )
    if activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(
            f"activation_checkpointing={activation_checkpointing!r}: use one of {CHECKPOINTING}"
        )
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise ConfigError(
            f"example must be one (input, target) item of the dataset, got {type(example).__name__}"
        )
    params = {id(p): p for p in model.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    groups = find_groups(model)
    in_blocks = {id(p) for g in groups for p in g.parameters}
    group_sizes = [sum(_nbytes(p) for p in g.parameters) for g in groups]
    root = sum(_nbytes(p) for p in params if id(p) not in in_blocks)
    try:
        one, two = (_measure(model, example, b, precision, loss, param_dtype) for b in (1, 2))
    except ConfigError:
        raise
    except Exception as err:
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the planner could not model the activations of {type(model).__name__}: its "
            f"forward failed on fake tensors (tensors without values), most likely because it "
            f"reads tensor values in Python ({type(err).__name__}: {said}). Only the model's "
            "states (parameters, gradients, optimizer state) can be predicted; run the "
            "simulation or measure a real step for the activations"
        ) from None
    act1, act2 = (r.activations(activation_checkpointing) for r in (one, two))
    bwd1, bwd2 = (r.backward_extra(activation_checkpointing) for r in (one, two))
    return ModelFacts(
        trainable_bytes=sum(_nbytes(p) for p in trainable),
        frozen_bytes=sum(_nbytes(p) for p in params if not p.requires_grad),
        buffer_bytes=sum(_nbytes(b) for b in model.buffers()),
        trainable_numel=sum(p.numel() for p in trainable),
        largest_group_bytes=max([*group_sizes, root]),
        activation_bytes_per_sample=act2 - act1,
        activation_bytes_fixed=2 * act1 - act2,
        output_bytes_per_sample=two.output - one.output,
        input_bytes_per_sample=two.inputs - one.inputs,
        flops_per_sample=float(flops_per_sample),
        target_bytes_per_sample=two.targets - one.targets,
        loss_bytes_per_sample=two.loss - one.loss,
        backward_bytes_per_sample=bwd2 - bwd1,
        backward_bytes_fixed=2 * bwd1 - bwd2,
        root_group_bytes=root,
        block_groups=len(groups),
        activation_tensors=len(one.saved),
        buffer_tensors=sum(1 for _ in model.buffers()),
        parameter_rows=tuple(_rows(p) for p in params),
        largest_block_bytes=max(group_sizes, default=0),
    )


def recomputed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks fsdp recomputes under activation checkpointing: its groups' modules."""
    return [b for g in find_groups(model) for b in g.modules]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows(p: torch.Tensor) -> tuple[int, int, bool]:
    rows = p.shape[0] if p.dim() else 1
    return rows, _nbytes(p) // max(rows, 1), p.requires_grad


@dataclass
class _Saved:
    """One storage the forward noted: its bytes, the block noting it (-1: none), its key and
    how many blocks the forward had entered by then; for a note (not saved by autograd),
    whether the policy keeps it and whether it is a block's input."""

    nbytes: int
    block: int
    key: int = 0
    entered: int = 0
    kept: bool = False
    block_input: bool = False


def _measure(
    model: nn.Module,
    example: Any,
    batch: int,
    precision: str,
    loss: Callable[..., Any] | None,
    param_dtype: torch.dtype | None,
) -> _Run:
    """:func:`_forward`, through the first few of ``model``'s blocks when they are identical
    and are the blocks fsdp recomputes (:mod:`gpukit.planning.repeats`: the same saved
    tensors, in far less time), else through the whole model."""
    found = repeats.repeated_blocks(model)
    if found is not None and [id(b) for b in found[1]] == [id(b) for b in recomputed_blocks(model)]:
        container, blocks = found
        try:
            with repeats.truncated(container, repeats.MEASURED):
                run = _forward(
                    model, example, batch, precision, loss, param_dtype, blocks[: repeats.MEASURED]
                )
        except Exception:
            run = None  # measured whole, below
        if run is not None:
            stretched = run.stretched(len(blocks))
            if stretched is not None:
                return stretched
    return _forward(model, example, batch, precision, loss, param_dtype)


@dataclass
class _Run:
    """What one fake forward at one micro-batch saved, in the order it saved it; ``notes``
    the blocks' inputs and the outputs selective checkpointing keeps inside blocks, one per
    storage, in the order noted."""

    saved: list[_Saved]
    output: int
    inputs: int
    targets: int
    loss: int
    notes: list[_Saved] = field(default_factory=list)

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

    def stretched(self, total: int) -> _Run | None:
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


def _forward(
    model: nn.Module,
    example: Any,
    batch: int,
    precision: str,
    loss: Callable[..., Any] | None,
    param_dtype: torch.dtype | None = None,
    blocks: list[nn.Module] | None = None,
) -> _Run:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if blocks is None:
        blocks = recomputed_blocks(model)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    real = map_tensors(example, lambda t: torch.stack([t] * batch))
    with mode:
        fake_state = {k: _fake(mode, v, _input_device(real), param_dtype) for k, v in state.items()}
        own = {t.untyped_storage()._cdata for t in fake_state.values()}
        x, y = map_tensors(real, mode.from_tensor)
        keep: list[Any] = []  # holds counted storages alive, so their ids stay theirs
        saved: dict[int, _Saved] = {}
        notes: dict[int, _Saved] = {}
        current = [-1, 0]  # the block inside (-1: none), the blocks entered

        def note(st: Any, what: str) -> None:
            key = st._cdata
            if key in own:
                return
            if key not in notes:
                keep.append(st)
                notes[key] = _Saved(st.nbytes(), current[0], key, current[1])
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
                saved[key] = _Saved(st.nbytes(), current[0], key, current[1])
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
        output = sum(_nbytes(t) for t in tensors(out))
        if loss is None:  # a cross entropy keeps its log-probabilities: one output's size
            saved[-1] = _Saved(output, -1, -1, current[1])
            loss_bytes = output
        # The batch lives through the step whether saved or not.
        for t in tensors((x, y)):
            key = t.untyped_storage()._cdata
            saved.setdefault(key, _Saved(t.untyped_storage().nbytes(), -1, key, current[1]))
        return _Run(
            list(saved.values()),
            output=output,
            inputs=sum(_nbytes(t) for t in tensors(x)),
            targets=sum(_nbytes(t) for t in tensors(y)),
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
