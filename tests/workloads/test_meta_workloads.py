"""A workload whose model is on the meta device trains under `gpukit train`: the strategy
materialises it and the modules' own reset_parameters() initialise it, from the run's seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpukit.cli.__main__ import main
from gpukit.workloads import Workload
from gpukit.workloads.llama import Llama, LlamaShape, llama

SHAPE = LlamaShape(dim=32, layers=2, heads=4, kv_heads=2, hidden=64, vocab=128, tied=True)


def tiny() -> Workload:
    """A Llama of 2 small blocks on the meta device."""
    return llama(SHAPE, seq_len=16, batch_size=4, name="tiny-llama")


def _train(out: Path, seed: int) -> dict[str, object]:
    argv = ["train", "--workload", f"{__name__}:tiny", "--devices", "cpu", "--max-steps", "2"]
    assert main([*argv, "--seed", str(seed), "--out", str(out)]) == 0
    return dict(json.loads((out / "metrics.json").read_text()))


def test_gpukit_train_materialises_a_meta_workload_from_the_seed(tmp_path: Path) -> None:
    assert tiny().model.tok_embeddings.weight.is_meta
    a, b = _train(tmp_path / "a", 1), _train(tmp_path / "b", 1)
    other = _train(tmp_path / "c", 2)
    assert a["steps"] == 2 and a["final_loss"] == b["final_loss"]  # the seed decides
    assert other["final_loss"] != a["final_loss"]


def test_the_rotary_tables_are_computed_when_the_model_gets_memory() -> None:
    with torch.device("meta"):
        meta = Llama(SHAPE, 16)
    real = Llama(SHAPE, 16)
    meta.to_empty(device="cpu")
    meta.rope.reset_parameters()
    assert torch.equal(meta.rope.cos, real.rope.cos) and torch.equal(meta.rope.sin, real.rope.sin)
    assert real.output.weight is real.tok_embeddings.weight
