"""What a program written for Accelerate, Fabric, plain DDP or ``mp.spawn`` calls, read from
its source with ``ast``: nothing of it is run or imported.

The object the program makes with ``Accelerator(...)`` or ``Fabric(...)`` is found where it
is assigned (a name, or an attribute such as ``self.accelerator``) or where a parameter is
annotated with its class; its methods and attributes anywhere in the file are then its calls.
Functions are matched by their full import name, whatever the program calls the module
(``import torch.distributed as dist``).

>>> from gpukit.migration.scan import scan_source
>>> found = scan_source("from accelerate import Accelerator\\na = Accelerator()\\na.backward(x)\\n")
>>> [(f.line, f.written, f.gpukit) for f in found.findings]
[(2, 'Accelerator()', '`rt = gk.Runtime(...)`'), (3, 'a.backward(x)', '`rt.backward(loss)`')]
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpukit.errors import ConfigError
from gpukit.migration.behaviours import BEHAVIOURS
from gpukit.migration.table import (
    CONSTRUCTORS,
    SAME_FUNCTION,
    TABLE,
    Kind,
    Library,
    Translation,
)

ENV_READERS = {"os.getenv", "os.environ.get"}
RANK_WORDS = ("rank", "is_main_process", "is_global_zero", "is_local_main_process")


@dataclass(frozen=True)
class Finding:
    """One call of the program: its line, as written, gpukit's spelling and how they differ."""

    line: int
    library: Library
    written: str
    call: str
    gpukit: str
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "library": self.library,
            "written": self.written,
            "call": self.call,
            "gpukit": self.gpukit,
            "note": self.note,
        }


@dataclass(frozen=True)
class Scan:
    """Every call found, in line order, and the behaviours that will differ for this program."""

    findings: tuple[Finding, ...]
    behaviours: tuple[str, ...]

    @property
    def libraries(self) -> list[Library]:
        return sorted({f.library for f in self.findings})


def scan_file(path: str | Path) -> Scan:
    """Scan the Python script at ``path``; a file that is missing or is not Python source is a
    ``ConfigError`` naming the line where it stops being Python."""
    path = Path(path)
    if not path.is_file():
        what = "a folder" if path.is_dir() else "no such file"
        raise ConfigError(
            f"{str(path)!r} is {what}: gpukit check reads a Python script "
            "(give the path of a .py file, e.g. gpukit check train.py)"
        )
    try:
        source = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not Python source: byte {err.start} is not UTF-8 text "
            "(gpukit check reads a .py script, not a binary file)"
        ) from None
    return scan_source(source, str(path))


def scan_source(source: str, filename: str = "<script>") -> Scan:
    """Scan Python ``source`` (``filename`` names it in errors)."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as err:
        raise ConfigError(
            f"{filename}:{err.lineno}: not valid Python ({err.msg}): gpukit check reads a "
            "Python script without running it; fix that line, or give the .py file"
        ) from None
    except ValueError as err:  # NUL bytes: not a script at all
        raise ConfigError(f"{filename} is not Python source ({err})") from None
    return _Scanner(source, tree).run()


@dataclass
class _Scanner:
    source: str
    tree: ast.Module
    names: dict[str, str] = field(default_factory=dict)  # local name -> full import name
    objects: dict[str, Library] = field(default_factory=dict)  # "accelerator", "self.fabric"
    optimizers: set[str] = field(default_factory=set)
    schedulers: set[str] = field(default_factory=set)
    found: list[tuple[int, int, Finding]] = field(default_factory=list)
    applies: set[tuple[Library, str]] = field(default_factory=set)
    scheduler_steps: list[bool] = field(default_factory=list)  # stepped in a training loop?

    def run(self) -> Scan:
        self._read_imports()
        self._read_objects()
        self._visit(self.tree, loops=(), tests=())
        self._read_behaviours()
        findings = tuple(f for _, _, f in sorted(self.found, key=lambda x: (x[0], x[1])))
        behaviours = tuple(b.text for b in BEHAVIOURS if (b.library, b.key) in self.applies)
        return Scan(findings, behaviours)

    # -- what the names mean ----------------------------------------------------------------
    def _read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.names[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        self.names[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def full_name(self, node: ast.expr) -> str | None:
        """The full import name of ``node`` (``dist.barrier`` -> torch.distributed.barrier),
        or None where it does not start at an import."""
        if isinstance(node, ast.Name):
            name = self.names.get(node.id)
        elif isinstance(node, ast.Attribute):
            base = self.full_name(node.value)
            name = f"{base}.{node.attr}" if base else None
        else:
            return None
        if name and name.startswith("lightning_fabric."):
            name = "lightning.fabric." + name.removeprefix("lightning_fabric.")
        return SAME_FUNCTION.get(name, name) if name else None

    def _read_objects(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
                made = self.full_name(node.value.func) or ""
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in map(_dotted, targets):
                    if target and made in CONSTRUCTORS:
                        self.objects[target] = CONSTRUCTORS[made]
                    elif target and _is_scheduler(made):
                        self.schedulers.add(target)
                    elif target and made.startswith("torch.optim."):
                        self.optimizers.add(target)
            elif isinstance(node, ast.arg):
                typed = self.full_name(node.annotation) if node.annotation else None
                if typed in CONSTRUCTORS:
                    self.objects[node.arg] = CONSTRUCTORS[typed]
                elif node.annotation is None and node.arg in self._customary_names():
                    self.objects[node.arg] = self._customary_names()[node.arg]

    def _customary_names(self) -> dict[str, Library]:
        """``accelerator`` and ``fabric`` as the parameters of a script that imports the
        library: a function handed the object (``def train(accelerator, model)``) calls it."""
        imported = {full.split(".")[0] for full in self.names.values()}
        names: dict[str, Library] = {}
        if "accelerate" in imported:
            names["accelerator"] = "accelerate"
        if imported & {"lightning", "lightning_fabric"}:
            names["fabric"] = "fabric"
        return names

    # -- the walk ---------------------------------------------------------------------------
    def _visit(
        self, node: ast.AST, loops: tuple[ast.AST, ...], tests: tuple[ast.expr, ...]
    ) -> None:
        if isinstance(node, ast.Call):
            self._call(node, loops, tests)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self._attribute(node)
        elif isinstance(node, ast.Subscript):
            self._environment_read(node, node.slice)
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            loops = (*loops, node)
        if isinstance(node, ast.If):
            tests = (*tests, node.test)
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(node, ast.Call)
                and child is node.func
                and isinstance(child, ast.Attribute)
            ):
                self._visit(child.value, loops, tests)  # the method itself is the call
                continue
            self._visit(child, loops, tests)

    def _call(
        self, node: ast.Call, loops: tuple[ast.AST, ...], tests: tuple[ast.expr, ...]
    ) -> None:
        full = self.full_name(node.func)
        if full in CONSTRUCTORS:
            library = CONSTRUCTORS[full]
            self._add(node, _row(library, "function", full))
            for keyword in node.keywords:
                if keyword.arg:
                    row = _row(library, "keyword", keyword.arg)
                    self._add(keyword, row or _unknown(library, "keyword", keyword.arg), keyword)
            return
        if full in ENV_READERS and node.args:
            self._environment_read(node, node.args[0])
            return
        if full:
            row = _row_by_name("function", full)
            if row:
                self._add(node, row)
                self._function_behaviours(row, node, tests)
            return
        if not isinstance(node.func, ast.Attribute):
            return
        receiver, method = _dotted(node.func.value), node.func.attr
        if receiver in self.objects:
            library = self.objects[receiver]
            row = _row(library, "method", method) or _unknown(library, "method", method)
            self._add(node, row)
            self._method_behaviours(library, method, node)
            for keyword in node.keywords:
                # The keywords held switch off what the method does by default: on, they
                # change nothing.
                on = isinstance(keyword.value, ast.Constant) and keyword.value.value is True
                if keyword.arg and not on:
                    found = _row(library, "method-keyword", f"{method}.{keyword.arg}")
                    self._add(keyword, found, keyword)
        elif receiver in self.optimizers:
            self._add(node, _row_by_name("optimizer", method))
        elif receiver in self.schedulers and method == "step":
            self.scheduler_steps.append(bool(loops) and _holds_backward(loops[-1]))
        else:
            row = _row_by_name("any-method", method)
            if row and (method != "backward" or not node.args):
                self._add(node, row)
                if method == "no_sync":
                    self.applies.add(("ddp", "accumulate"))

    def _attribute(self, node: ast.Attribute) -> None:
        receiver = _dotted(node.value)
        if receiver in self.objects:
            self._add(node, _row(self.objects[receiver], "attribute", node.attr))

    def _environment_read(self, node: ast.expr, key: ast.expr) -> None:
        reader = node.value if isinstance(node, ast.Subscript) else None
        if reader is not None and self.full_name(reader) != "os.environ":
            return
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            self._add(node, _row_by_name("env", key.value))

    def _add(self, node: ast.AST, row: Translation | None, written: ast.AST | None = None) -> None:
        if row is None:
            return
        text = ast.get_source_segment(self.source, written or node) or row.call
        text = " ".join(text.split())
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        finding = Finding(line, row.library, text, row.call, row.gpukit, row.note)
        self.found.append((line, col, finding))

    # -- the behaviours that apply ----------------------------------------------------------
    def _libraries(self) -> set[Library]:
        return {f.library for _, _, f in self.found if f.library != "torch"}

    def _method_behaviours(self, library: Library, method: str, node: ast.Call) -> None:
        keys = {
            "log": "log",
            "gather": "gather",
            "save_state": "checkpoint",
            "load_state": "checkpoint",
            "no_backward_sync": "accumulate",
            "save": "save",
        }
        if method in keys:
            self.applies.add((library, keys[method]))
        if library == "fabric" and method == "launch" and not node.args:
            self.applies.add((library, "launch"))

    def _function_behaviours(
        self, row: Translation, node: ast.Call, tests: tuple[ast.expr, ...]
    ) -> None:
        if row.name == "torch.utils.data.DistributedSampler":
            self.applies.add(("ddp", "sampler"))
        elif row.name == "torch.distributed.all_reduce":
            self.applies.add(("ddp", "all_reduce"))
        elif row.name == "torch.multiprocessing.spawn":
            self.applies.add(("ddp", "spawn"))
        elif row.name == "torch.save" and any(_names_rank(t) for t in tests):
            self.applies.add(("ddp", "rank0-save"))

    def _read_behaviours(self) -> None:
        libraries = self._libraries()
        shuffled = any(_shuffles(self, node) for node in ast.walk(self.tree))
        for library in libraries:
            if shuffled:
                self.applies.add((library, "shuffle"))
            for per_batch in self.scheduler_steps:
                self.applies.add((library, f"scheduler-per-{'batch' if per_batch else 'epoch'}"))
        # A behaviour of a library whose calls this program does not make is not its own.
        self.applies = {(lib, key) for lib, key in self.applies if lib in libraries}


def _row(library: Library, kind: str, name: str) -> Translation | None:
    return next(
        (r for r in TABLE if r.library == library and r.kind == kind and r.name == name), None
    )


def _row_by_name(kind: str, name: str) -> Translation | None:
    return next((r for r in TABLE if r.kind == kind and r.name == name), None)


def _unknown(library: Library, kind: Kind, name: str) -> Translation:
    """The row of a method or a constructor's keyword that the table does not hold."""
    made = "Accelerator" if library == "accelerate" else "Fabric"
    call = f"{made}({name}=...)" if kind == "keyword" else f"{made.lower()}.{name}(...)"
    where = "docs/migrating.md, or `help(gk.Runtime)`"
    return Translation(library, kind, name, call, "not in gpukit's table", f"see {where}")


def _dotted(node: ast.expr) -> str | None:
    """``accelerator`` or ``self.accelerator``: a name or a chain of attributes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_scheduler(full: str) -> bool:
    return full.startswith("torch.optim.lr_scheduler.") or full.endswith(
        ("get_scheduler", "_schedule_with_warmup")
    )


def _holds_backward(loop: ast.AST) -> bool:
    """Whether ``loop`` itself (not a loop inside it) calls a ``backward``: a scheduler
    stepped there is stepped every batch."""
    todo = list(ast.iter_child_nodes(loop))
    while todo:
        node = todo.pop()
        called = node.func if isinstance(node, ast.Call) else None
        if isinstance(called, ast.Attribute) and called.attr == "backward":
            return True
        if not isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _names_rank(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return any(word in text for word in RANK_WORDS)


def _shuffles(scanner: _Scanner, node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and scanner.full_name(node.func) == "torch.utils.data.DataLoader"
        and any(
            k.arg == "shuffle" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in node.keywords
        )
    )
