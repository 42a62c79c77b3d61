"""The guide's programs moved to gpukit (docs/migrating.md) end with the same weights as the
programs they replace, bit for bit: from plain DDP on two ranks (the samplers draw the same
order from the same seed, and gpukit's DDP averages the gradients as the program's did), from
Accelerate and Fabric on one process (where those libraries are installed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


def program(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return next(block for block in blocks if marker in block)


@pytest.mark.processes
def test_the_ddp_program_and_its_move_end_with_the_same_weights(tmp_path: Path) -> None:
    before = program('dist.init_process_group("gloo")')
    after = program("rt = gk.Runtime(seed=0)\ndata")
    saves = {
        "before": (before, "del model", "dist.get_rank()", "model.module"),
        "after": (after, "rt.teardown()", "rt.rank", "rt.unwrap(model)"),
    }
    for name, (source, last, rank, model) in saves.items():
        save = f"if {rank} == 0:\n    torch.save({model}.state_dict(), '{name}.pt')\n"
        (tmp_path / f"{name}.py").write_text(source.replace(last, save + last))
        done = subprocess.run(
            [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", f"{name}.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    weights = [torch.load(tmp_path / f"{name}.pt") for name in saves]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize(
    ("library", "before_marker", "after_marker"),
    [
        ("accelerate", "accelerator = Accelerator()", "data_order="),
        ("lightning", "fabric = Fabric(", 'devices="cpu", seed=0, clip=1.0'),
    ],
    ids=["accelerate", "fabric"],
)
def test_the_accelerate_and_fabric_programs_and_their_moves_on_one_process(
    library: str,
    before_marker: str,
    after_marker: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip(library)
    monkeypatch.chdir(tmp_path)
    weights = []
    for marker in (before_marker, after_marker):
        namespace: dict[str, object] = {"__name__": "__main__"}
        exec(compile(program(marker), f"migrating.md ({marker})", "exec"), namespace)
        model = namespace["model"]
        while isinstance(getattr(model, "module", None), torch.nn.Module):  # Fabric's wrapper
            model = model.module  # type: ignore[attr-defined]
        assert isinstance(model, torch.nn.Module)
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
