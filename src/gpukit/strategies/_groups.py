"""Which parts of a model fsdp shards as one group, found without a wrapping policy.

A sharded model is all-gathered group by group, so the peak holds one group's full weights
at a time; each group is also one all-gather and one reduce-scatter. The natural groups are
a model's repeated blocks: the largest list of modules of one class (a transformer's layers),
each block a group, and the rest of the model (embeddings, final norm, head) the root's
group. A model that names its own blocks, as Hugging Face ``transformers`` models do with
``_no_split_modules`` (class names, e.g. ``["LlamaDecoderLayer"]``, the modules Accelerate keeps
whole), has those named blocks used instead: every outermost module of a named class, wherever
it is (an encoder's and a decoder's layers alike). Parameters shared by two modules (a head
tied to its embedding) must sit in one group: a block that shares a parameter with another
block is merged with it, and one that shares a parameter with something outside the blocks
stays in the root's group.

>>> from torch import nn
>>> model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]))
>>> [g.names for g in find_groups(model)]
[['1.0'], ['1.1'], ['1.2']]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class Group:
    """Modules sharded together (``names`` as in ``named_modules``)."""

    names: list[str]
    modules: list[nn.Module] = field(repr=False)
    # The classes the model named in ``_no_split_modules`` that made it a group ("" if none).
    declared: str = field(default="", repr=False)

    @property
    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The repeated blocks: the ``ModuleList``/``Sequential`` (or the model itself) whose
    children are at least two modules of one class holding parameters, the one holding the
    most parameters (the longest on a tie); None when there is none."""
    best: tuple[int, int, str, list[nn.Module]] | None = None
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        # Every entry, a module listed twice included (children() lists it once), so that
        # an entry's position is its name.
        children = [c for c in container._modules.values() if c is not None]
        kinds = {type(c) for c in children}
        if len(children) < 2 or len(kinds) != 1:
            continue
        if issubclass(next(iter(kinds)), (nn.ModuleList, nn.ModuleDict)):
            continue  # never called, so never gathered: a list of lists is no list of blocks
        if not all(any(True for _ in c.parameters()) for c in children):
            continue
        size = sum(p.numel() for p in container.parameters())
        # The list holding the most parameters, then the longest: a model's layers, not the
        # attention heads listed inside one layer.
        if best is None or (size, len(children)) > (best[0], best[1]):
            best = (size, len(children), name, children)
    if best is None:
        return None
    return best[2], best[3]


def declared_blocks(model: nn.Module) -> tuple[list[str], list[nn.Module]] | None:
    """The blocks the model names itself: the outermost modules (other than the model) whose
    class name is listed in a ``_no_split_modules`` of the model or of a module inside it,
    holding parameters, in ``named_modules`` order; None when it names none."""
    classes: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if isinstance(listed, (list, tuple, set, frozenset)):
            classes.update(c for c in listed if isinstance(c, str))
    if not classes:
        return None
    names: list[str] = []
    blocks: list[nn.Module] = []
    for name, module in model.named_modules():
        if not name or type(module).__name__ not in classes or _within(name, names):
            continue
        if any(True for _ in module.parameters()):
            names.append(name)
            blocks.append(module)
    return (names, blocks) if blocks else None


def find_groups(model: nn.Module) -> list[Group]:
    """The groups sharded before the root (the root's group holds everything else), in
    forward order; tied parameters never span two groups."""
    declared = declared_blocks(model)
    kinds = ""
    if declared is not None:
        names, blocks = declared
        kinds = ", ".join(sorted({type(b).__name__ for b in blocks}))
    else:
        found = find_blocks(model)
        if found is None:
            return []
        prefix, blocks = found
        container = model.get_submodule(prefix) if prefix else model
        keys = [k for k, c in container._modules.items() if c is not None]
        names = [f"{prefix}.{k}" if prefix else k for k in keys]
    # A block listed twice (one layer applied several times) is one module: one group.
    unique: dict[int, int] = {}
    for i, block in enumerate(blocks):
        unique.setdefault(id(block), i)
    index = sorted(unique.values())
    owner: dict[int, int] = {}  # parameter id -> the first block (by index) holding it
    parent = {i: i for i in index}

    def root_of(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in index:
        for _, p in blocks[i].named_parameters(remove_duplicate=False):
            j = owner.setdefault(id(p), i)
            if j != i:  # shared by two blocks: merge them into one group
                parent[root_of(i)] = root_of(j)
    in_blocks = set(owner)
    outside = {
        id(p)
        for name, module in model.named_modules()
        if not _within(name, names)
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False)
    }
    tied_to_root = {root_of(owner[pid]) for pid in in_blocks & outside}
    merged: dict[int, list[int]] = {}
    for i in index:
        merged.setdefault(root_of(i), []).append(i)
    return [
        Group([names[i] for i in members], [blocks[i] for i in members], kinds)
        for leader, members in merged.items()
        if leader not in tied_to_root
    ]


def _within(name: str, blocks: list[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in blocks)


def tied_names(model: nn.Module) -> list[list[str]]:
    """Names under which one parameter appears more than once (a tied head and embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
