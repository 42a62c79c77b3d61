"""The package's shape: rooms by concept, few modules at the root, small modules, imports that
flow one way, and no module borrowing another's private names."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import gpukit

PACKAGE = Path(gpukit.__file__).resolve().parent
SRC = PACKAGE.parent
MODULES = sorted(PACKAGE.rglob("*.py"))
# Packages by concept, as the README's "Architecture" section describes them.
ROOMS = {
    "_util",
    "bench",
    "checkpoint",
    "cli",
    "devices",
    "diagnostics",
    "doctor",
    "launch",
    "lifecycle",
    "loggers",
    "migration",
    "planning",
    "runtime",
    "strategies",
    "train",
    "watch",
    "workloads",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every import in the file: at the top, inside functions and
    under TYPE_CHECKING alike, since each of them can close a cycle."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names], node.lineno))
    return found


def edges() -> dict[str, set[str]]:
    """gpukit module -> the gpukit modules it imports (``from pkg import mod`` counts as
    importing ``pkg.mod``; ``from pkg import name`` as importing ``pkg``). Importing a module
    of another package first runs that package's ``__init__`` (and its imports): that counts
    too, since it closes cycles that the names alone do not show."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        me = module_name(path)
        targets = graph.setdefault(me, set())
        for module, names, _ in imports(path):
            if not module.startswith("gpukit"):
                continue
            subs = [f"{module}.{n}" for n in names if is_module(f"{module}.{n}")]
            targets.update(subs or [module])
            if len(subs) < len(names):
                targets.add(module)
        for target in list(targets):
            targets.update(enclosing_packages(target, me))
        targets.discard(me)
    return graph


def enclosing_packages(target: str, importer: str) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs, less the gpukit root and
    the packages ``importer`` is in (their ``__init__`` is already running)."""
    parts = target.split(".")
    found = []
    for i in range(2, len(parts)):
        package = ".".join(parts[:i])
        inside = importer == package or importer.startswith(package + ".")
        if not inside and (SRC.joinpath(*parts[:i]) / "__init__.py").is_file():
            found.append(package)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_root_holds_few_modules_and_the_rest_is_in_rooms() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == ROOMS


# Well before the 500 lines where a module is past due: a module near the cap is split by the
# concepts it holds, not cut at a line count when it overflows.
MAX_LINES = 450


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines, split by concept: {long}"


def test_no_code_is_folded_against_the_formatter() -> None:
    """The formatter lays out all code: a layout it would not choose is written so that its
    own reads well, never pinned with a skip mark."""
    marks = ("fmt: " + "skip", "fmt: " + "off")
    folded = [
        f"{path.relative_to(SRC.parent)}:{n}"
        for path in [*MODULES, *sorted((SRC.parent / "tests").rglob("*.py"))]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(mark in line for mark in marks)
    ]
    assert not folded, folded


def test_no_import_cycle() -> None:
    found = cycles(edges())
    assert not found, f"import cycles (counting imports in functions and TYPE_CHECKING): {found}"


def package_of(module: str) -> str:
    """The package a module is in (``gpukit.runtime.step.stepper`` -> ``gpukit.runtime.step``);
    a package's ``__init__`` belongs to the package itself; a module at the root (errors, _env)
    stands alone, as the layers place it apart from the public API."""
    path = SRC.joinpath(*module.split("."))
    if (path / "__init__.py").is_file() or module.count(".") == 1:
        return module
    return module.rsplit(".", 1)[0]


def package_edges() -> dict[str, set[str]]:
    """The module graph collapsed to packages, sub-packages counted apart."""
    graph: dict[str, set[str]] = {}
    for me, targets in edges().items():
        mine = package_of(me)
        graph.setdefault(mine, set()).update(package_of(t) for t in targets)
        graph[mine].discard(mine)
    return graph


def test_no_import_cycle_among_packages() -> None:
    found = cycles(package_edges())
    assert not found, f"import cycles among packages: {found}"


def test_no_module_imports_another_modules_private_names() -> None:
    borrowed = []
    for path in MODULES:
        me = module_name(path)
        for module, names, line in imports(path):
            if not module.startswith("gpukit") or module == me:
                continue
            private = [
                n
                for n in names
                if n.startswith("_")
                and not n.startswith("__")
                and not is_module(f"{module}.{n}")  # a private module of the package is fine
            ]
            if private:
                borrowed.append(f"{path.relative_to(PACKAGE)}:{line} {module}: {private}")
    assert not borrowed, borrowed


STRATEGY_NAMES = {"single", "dp", "dp-balanced", "ddp", "fsdp"}
STRATEGY_CLASSES = {"SingleDevice", "DP", "DPBalanced", "DDP", "FSDP"}


def test_the_runtime_never_asks_which_strategy_it_holds() -> None:
    """What differs between strategies is a method of the strategy: no isinstance checks on
    strategy classes and no comparisons of strategy names outside strategies/."""
    found = []
    for path in MODULES:
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("strategies", "cli", "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in STRATEGY_NAMES for c in node.comparators
            ):
                found.append(f"{rel}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and any(
                    isinstance(n, ast.Name) and n.id in STRATEGY_CLASSES for n in ast.walk(node)
                )
            ):
                found.append(f"{rel}:{node.lineno}")
    assert not found, found


# The rooms in layers: a module imports from its own layer and those below, never above, so
# data flows one way (cli -> bench/doctor -> the public API -> train -> planning -> workloads ->
# the training core -> diagnostics -> strategies -> devices -> the shared helpers).
LAYERS = [
    {"errors", "_env", "_util"},
    {"devices"},
    {"strategies"},
    {"diagnostics"},
    {"launch", "loggers"},  # the processes that run a job, where its metrics go
    # The training core: its saves, the run's boundaries that make them, then the step.
    {"checkpoint"},
    {"lifecycle"},
    {"runtime"},
    {"workloads"},
    {"planning"},
    {"watch"},  # reads what launchers and runs write; a run may write its report at the end
    {"train"},
    {"(root)"},  # gpukit/__init__.py: the public API
    {"bench", "doctor", "migration"},
    {"cli", "__main__"},
]


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def test_rooms_import_only_their_layer_and_the_layers_below() -> None:
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    found = []
    for me, targets in edges().items():
        for target in targets:
            a, b = room_of(me), room_of(target)
            assert a in layer and b in layer, f"place {a if a not in layer else b} in LAYERS"
            if layer[b] > layer[a]:
                found.append(f"{me} imports {target} (a layer above)")
    assert not found, found


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes, functions)."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in_planning(source: str) -> list[str]:
    """Where ``source`` names a strategy outside its docstrings: a name string anywhere (a
    comparison, a dict key, a set, tuple or list of names, an argument) or a strategy class.
    """
    tree = ast.parse(source)
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in STRATEGY_NAMES and id(node) not in skip:
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Name) and node.id in STRATEGY_CLASSES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in STRATEGY_CLASSES:
            found.append(f"{node.lineno}: import {node.name}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_planner_reads_traits_and_never_names_a_strategy() -> None:
    """The planner models every strategy from its traits (strategies/traits.py), read through
    the registry: no strategy name in comparisons, dict keys, collections or calls, and no
    strategy class, anywhere in planning/ outside docstrings."""
    found = []
    for path in sorted((PACKAGE / "planning").rglob("*.py")):
        found += [f"{path.relative_to(PACKAGE)}:{f}" for f in names_in_planning(path.read_text())]
    assert not found, found


def test_the_planning_check_catches_each_way_of_naming_a_strategy() -> None:
    source = """\
'''The planner (fsdp, ddp in words).'''
from gpukit.strategies.fsdp import FSDP
TRAITS = {"single": 1}
ORDER = ("dp", "dp-balanced")
def f(strategy: str) -> bool:
    '''Whether it is fsdp.'''
    return strategy in ["ddp"] or strategy != "fsdp" or isinstance(strategy, FSDP)
"""
    found = names_in_planning(source)
    assert [f.split(":")[0] for f in found] == ["2", "3", "4", "4", "7", "7", "7"], found
