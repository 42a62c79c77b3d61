"""A model wrapped for mixed precision and then compiled by the program compiles once: the
wrapper's cast of the outputs to float32 leaves dynamo no reason to recompile each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.runtime.step.precision import MixedPrecision

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.processes,  # inductor starts its pool of compile workers
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none"
            ),
        ],
    ),
]


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None


class Net(nn.Module):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.shape = shape

    def forward(self, x: torch.Tensor) -> Any:
        y = self.linear(x)
        if self.shape == "tensor":
            return y
        if self.shape == "tuple":  # nanoGPT's (logits, loss)
            return y, y.sum()
        if self.shape == "dict":
            return {"logits": y, "aux": [y.mean(), None]}
        return Output(y, y.sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["tensor", "tuple", "dict", "dataclass"])
def test_a_compiled_mixed_precision_model_compiles_once(device: str, shape: str) -> None:
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = MixedPrecision(Net(shape).to(device), device, torch.bfloat16)
    compiled = torch.compile(model, backend=backend)
    eager: Any = None
    for step in range(12):
        x = torch.randn(4, 8, device=device)  # a new input each step, as training has
        out = compiled(x)
        if step == 0:
            after_first = len(graphs)
            eager = model(x)
    # One graph (a class pytree does not know has its cast run after it, outside), and
    # nothing compiles again on later steps.
    assert after_first == 1
    assert len(graphs) == after_first
    logits = out.logits if shape == "dataclass" else out
    if shape == "tuple":
        logits = out[0]
    elif shape == "dict":
        logits = out["logits"]
        assert out["aux"][0].dtype == torch.float32 and out["aux"][1] is None
    assert logits.dtype == torch.float32
    assert type(out) is type(eager)
