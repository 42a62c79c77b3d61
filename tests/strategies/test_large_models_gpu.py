"""Large-model paths on a real GPU (one rank of fsdp over NCCL): a meta-device model gets the
same weights on CUDA as on the CPU, a model the user sharded on a CUDA mesh trains and saves,
and a sharded export reads back equal. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import gpukit as gk
from gpukit.workloads.llama import Llama, LlamaShape

pytestmark = [pytest.mark.gpu, pytest.mark.processes]

SHAPE = LlamaShape(dim=64, layers=2, heads=4, kv_heads=2, hidden=128, vocab=256, tied=True)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, SHAPE.vocab, (4, 17), generator=torch.Generator().manual_seed(step))


def _train(rt: gk.Runtime, meta: bool, user_sharded: bool, folder: str | None) -> dict[str, Any]:
    with torch.device("meta" if meta else "cpu"):
        model = Llama(SHAPE, 16)
    if user_sharded:
        from torch.distributed.fsdp import fully_shard

        rt.barrier()  # the process group exists: fully_shard needs it
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = rt.setup(model, optimizer)
    first = rt.full_state_dict()
    losses = []
    for step in range(3):
        tokens = _tokens(step).to(rt.device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(loss.item())
    user = rt.unwrap(model)
    if folder is not None:
        rt.save(folder, export=True)
    return {
        "init": first,
        "trained": rt.full_state_dict(),
        "losses": losses,
        "tied": user.output.weight is user.tok_embeddings.weight,
        "device": str(next(user.parameters()).device),
    }


def _launch(device: str, *args: Any) -> dict[str, Any]:
    rt = gk.Runtime(strategy="fsdp", devices=[device], seed=3)
    try:
        return rt.launch(_train, *args)
    finally:
        rt.teardown()


def test_a_meta_model_gets_the_same_weights_on_cuda_as_on_the_cpu() -> None:
    cuda = _launch("cuda", True, False, None)
    cpu = _launch("cpu", True, False, None)
    assert cuda["device"].startswith("cuda") and cuda["tied"]
    assert cuda["init"].keys() == cpu["init"].keys()
    for key, value in cpu["init"].items():
        assert torch.equal(cuda["init"][key].cpu(), value), key
    assert all(torch.isfinite(torch.tensor(cuda["losses"])))
    assert not all(torch.equal(cuda["trained"][k], cuda["init"][k]) for k in cuda["init"])


def test_a_model_sharded_by_the_user_on_cuda_trains_and_exports(tmp_path: Path) -> None:
    got = _launch("cuda", False, True, str(tmp_path))
    assert got["device"].startswith("cuda")
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert not all(torch.equal(got["trained"][k], got["init"][k]) for k in got["init"])
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files, f"no safetensors under {tmp_path}: {sorted(tmp_path.rglob('*'))}"
    read: dict[str, torch.Tensor] = {}
    for file in files:
        read.update(load_file(str(file)))
    for key, value in got["trained"].items():
        if key in read:
            assert torch.equal(read[key], value.cpu()), key
    # Tied: the shared weight is written once, under one of its names.
    assert len(set(got["trained"]) - set(read)) <= 1
    assert set(got["trained"]) - set(read) <= {"output.weight", "tok_embeddings.weight"}
