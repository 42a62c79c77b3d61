"""Every code block of README.md and docs/*.md runs, or says why it cannot run here.

How a block is read, by its fence's info string:

- ```python runs as written, in a fresh folder (in this process; one that starts processes
  runs in its own); a block of ``>>>`` lines runs as a doctest, its output compared.
- ```console (or ```sh) runs every ``$ command`` line with bash in a fresh folder, ``gpukit``
  being this tree's; a command must exit 0, unless the lines it printed in the text say
  ``error`` or ``exit code N`` (then non-zero, or N).
- ```json and ```yaml must parse; ```text is printed output, shown rather than run.

An HTML comment on the line before the fence changes that: ``<!-- needs: REASON -->`` skips the
block with that reason (one of NEEDS), and ``<!-- setup: CODE -->`` runs CODE first (Python
for a python block, bash for a console block; ``$DOCS_REPO`` is this repository), and
``<!-- files: NAME -->`` writes the page's previous python block into NAME first (the script a
console block runs).

The same module checks that every relative link of these pages leads to a file, and to a
heading there, and that README.md stays a first screen (at most 300 lines).
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import warm_gpukit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {
    "gpu": "needs a CUDA GPU",
    "several gpus": "needs two or more CUDA GPUs",
    "several machines": "needs several machines",
    "a Slurm cluster": "needs a Slurm cluster",
    "a Kubernetes cluster": "needs a Kubernetes cluster",
    "long run": "a long run (minutes): `make demo`, `make test`, a full benchmark",
    "script": "runs a script of the reader's that the page does not show",
    "launcher": "a script for a launcher alone (torchrun): the console block after it runs it",
    "a running job": "watches a job that another command runs at the same time",
}
LANGUAGES = {"python", "console", "sh", "json", "yaml", "text"}
# Generated pages that a link may name before the generator has written them.
GENERATED = {ROOT / "docs" / "settings.md"}
STARTS_PROCESSES = re.compile(
    r"rt\.launch\(|run_job\(|Runtime\(.*devices=2|gpukit launch|mp\.spawn\("
)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    needs: str | None
    setup: str
    files: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text().split("\n")
    previous_python = ""
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.group(1), fence.group(2)
        start = i
        body = []
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        needs, setup, files = None, "", []
        j = start - 1
        while j >= 0 and lines[j].startswith("<!--"):
            comment = re.match(r"<!--\s*(needs|setup|files):\s*(.*?)\s*-->", lines[j])
            assert comment, f"{page.name}:{j + 1}: unknown comment {lines[j]!r}"
            kind, value = comment.groups()
            if kind == "needs":
                needs = value
            elif kind == "setup":
                setup = value + "\n" + setup
            else:
                assert previous_python, f"{page.name}:{j + 1}: no python block above to write"
                files.append((value, previous_python))
            j -= 1
        text = "\n".join(body) + "\n"
        yield Block(page, start + 1, language, text, needs, setup, tuple(files))
        if language == "python":
            previous_python = text
        i += 1


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def _param(block: Block) -> object:
    marks = []
    if block.needs is None and (
        block.language in ("console", "sh") or STARTS_PROCESSES.search(block.text)
    ):
        marks.append(pytest.mark.processes)
    return pytest.param(block, id=block.id, marks=marks)


def _env(folder: Path) -> dict[str, str]:
    shims = folder / ".bin"
    shims.mkdir(exist_ok=True)
    shim = shims / "gpukit"
    # With the warm start on (tests/conftest.py), the command is forked warm, as the
    # `python -m gpukit` lines of other tests are (tests/warm_gpukit.py).
    python = shlex.quote(sys.executable)
    shim.write_text(
        "#!/bin/sh\n"
        'if [ -n "$GPUKIT_WARM_START" ]; then\n'
        f'  exec {python} {shlex.quote(warm_gpukit.__file__)} "$GPUKIT_WARM_START" "$@"\n'
        "fi\n"
        f'exec {python} -m gpukit "$@"\n'
    )
    shim.chmod(0o755)
    (shims / "python").symlink_to(sys.executable)
    path = f"{shims}{os.pathsep}{os.environ.get('PATH', '')}"
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PATH": path,
        "COLUMNS": "120",
        "DOCS_REPO": str(ROOT),
    }


def _commands(text: str) -> Iterator[tuple[str, str]]:
    """Each ``$ command`` (continuation lines joined) with the text printed after it."""
    lines = text.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        i += 1
        printed = []
        while i < len(lines) and not lines[i].startswith("$ "):
            printed.append(lines[i])
            i += 1
        yield command, "\n".join(printed)


def _expected_exit(command: str, printed: str) -> int | None:
    """0, a given code, or None for 'not 0'."""
    said = re.search(r"exit(?: code)? (\d+)", command + "\n" + printed)
    if said:
        return int(said.group(1))
    return None if "error" in printed.lower() else 0


def _run_console(block: Block, folder: Path) -> None:
    env = _env(folder)
    for name, text in block.files:
        (folder / name).write_text(text)
    if block.setup:
        done = subprocess.run(
            ["bash", "-c", block.setup], cwd=folder, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"setup failed: {done.stderr[-2000:]}"
    commands = list(_commands(block.text))
    assert commands, f"{block.id}: a console block without a `$ ` command"
    for command, printed in commands:
        if command.startswith("echo $?"):
            continue
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        expected = _expected_exit(command, printed)
        got = f"$ {command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if expected is None:
            assert done.returncode != 0, got
        else:
            assert done.returncode == expected, got


def _run_python(block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = block.setup + block.text
    if STARTS_PROCESSES.search(source):  # spawned ranks import the file: it must be one
        (folder / "example.py").write_text(source)
        done = subprocess.run(
            [sys.executable, "example.py"],
            cwd=folder,
            env=_env(folder),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    if ">>>" in block.text:
        parser = doctest.DocTestParser()
        namespace: dict[str, object] = {}
        exec(compile(block.setup, block.id, "exec"), namespace)
        test = parser.get_doctest(block.text, namespace, block.id, str(block.page), block.line)
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        runner = doctest.DocTestRunner(optionflags=flags)
        runner.run(test, out=print)
        assert runner.tries > 0 and runner.failures == 0, f"{block.id}: {runner.failures} failed"
        return
    exec(compile(source, block.id, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_every_code_block_runs_or_says_why_not(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert block.language in LANGUAGES, (
        f"{block.id}: a block's language is one of {sorted(LANGUAGES)}, not {block.language!r}"
    )
    if block.needs is not None:
        assert block.needs in NEEDS, f"{block.id}: needs one of {sorted(NEEDS)}"
        pytest.skip(f"{NEEDS[block.needs]} ({block.id})")
    if block.language == "text":
        assert "\n$ " not in "\n" + block.text, f"{block.id}: commands belong in a console block"
        assert ">>> " not in block.text, f"{block.id}: examples belong in a python block"
        return
    if block.language == "json":
        json.loads(block.text)
        return
    if block.language == "yaml":
        list(pytest.importorskip("yaml").safe_load_all(block.text))
        return
    if block.language in ("console", "sh"):
        _run_console(block, tmp_path)
        return
    _run_python(block, tmp_path, monkeypatch)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    fence = False
    for line in page.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (heading := re.match(r"^#{1,6} (.*)", line)):
            anchors.add(_slug(heading.group(1)))
    return anchors


def _links(page: Path) -> Iterator[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    yield from re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() and target not in GENERATED:
            broken.append(f"{link}: no file {target.relative_to(ROOT)}")
            continue
        headings = _anchors(target) if target.suffix == ".md" and target.exists() else None
        if anchor and headings is not None and anchor not in headings:
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_first_screen() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md links none of {missing}"
