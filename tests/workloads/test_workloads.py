"""The built-in workloads train on CPU, are reproducible, and bad specs fail clearly.

The ``module:function`` tests load the helpers below through this module's own import path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit.errors import ConfigError
from gpukit.workloads import WORKLOADS, Workload, forward_flops, load_workload
from gpukit.workloads.gpt import GPT

HERE = "tests.workloads.test_workloads"
# The built-ins small enough to train here at their own size; gpt2 (124M parameters) is tested
# at a few narrow layers in test_gpt2.py.
SMALL_WORKLOADS = tuple(name for name in WORKLOADS if name != "gpt2")


# Helpers loaded as "tests.workloads.test_workloads:NAME" (not collected: no test_ prefix).


def tuple_workload() -> tuple[nn.Module, TensorDataset, nn.Module]:
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return nn.Linear(4, 2), data, nn.CrossEntropyLoss()


def seeded_workload(seed: int) -> Workload:
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    return Workload(f"line{seed}", model, data, nn.MSELoss(), 4, 0.1, 2, 18.0)


def returns_number() -> int:
    return 42


def returns_bad_tuple() -> tuple[nn.Module, int, nn.Module]:
    return nn.Linear(2, 2), 5, nn.MSELoss()


def needs_argument(size: int) -> Workload:
    raise AssertionError("never called: it needs an argument")


NOT_A_FUNCTION = 3


def first_batch(workload: Workload, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    loader = DataLoader(workload.dataset, batch_size=size, shuffle=False)
    inputs, targets = next(iter(loader))
    return inputs, targets


def params(workload: Workload) -> list[torch.Tensor]:
    return [p.detach().clone() for p in workload.model.parameters()]


@pytest.mark.parametrize("name", SMALL_WORKLOADS)
def test_builtin_takes_a_training_step_on_cpu(name: str) -> None:
    workload = load_workload(name)
    assert workload.name == name and len(workload.dataset) > 0
    inputs, targets = first_batch(workload)
    loss = workload.loss(workload.model(inputs), targets)
    loss.backward()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    grads = [p.grad for p in workload.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads if g is not None)
    assert workload.batch_size >= 1 and workload.lr > 0 and workload.epochs >= 1
    assert workload.flops_per_sample > 0


@pytest.mark.parametrize("name", SMALL_WORKLOADS)
def test_seed_fixes_initial_parameters_and_leaves_global_rng_alone(name: str) -> None:
    before = torch.get_rng_state()
    first, again, other = (load_workload(name, seed=s) for s in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(params(first), params(again), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(params(first), params(other), strict=True))
    x1, y1 = first.dataset[3]
    x2, y2 = other.dataset[3]
    assert torch.equal(x1, x2) and torch.equal(y1, y2)  # the data does not depend on the seed


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_thirty_adam_steps_lower_the_loss(name: str) -> None:
    workload = load_workload(name)
    loader = DataLoader(
        workload.dataset,
        batch_size=workload.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    held_x, held_y = first_batch(workload, 64)

    def held_loss() -> float:
        with torch.no_grad():
            return float(workload.loss(workload.model(held_x), held_y))

    start = held_loss()
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=workload.lr)
    batches = iter(loader)
    for _ in range(30):
        inputs, targets = next(batches)
        loss = workload.loss(workload.model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_loss() < 0.85 * start


def test_gpt_sample_has_the_length_and_vocabulary_and_restores_the_mode() -> None:
    workload = load_workload("gpt")
    sample = workload.sample
    assert sample is not None
    vocab = set(workload.dataset.vocab)  # type: ignore[attr-defined]
    model, cpu = workload.model, torch.device("cpu")
    model.train()
    rng = torch.get_rng_state()
    text = sample(model, cpu)
    assert len(text) == 200 and set(text) <= vocab
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert sample(model, cpu) == text  # a fixed generator: the same model, the same text
    short = sample(model, cpu, length=80)  # type: ignore[call-arg]
    assert len(short) == 80 and short == text[:80]
    model.eval()
    compiled = torch.compile(model, backend="eager")  # sampled through the module it wraps
    assert sample(compiled, cpu) == text and not model.training


def test_gpt_flops_match_the_documented_formula() -> None:
    workload = load_workload("gpt")
    model = workload.model
    assert isinstance(model, GPT)
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - c.context * c.d_model
    assert workload.flops_per_sample == c.context * (6 * n + 12 * c.n_layer * c.context * c.d_model)
    # Cross-check: 3 x (the Linear layers' forward FLOPs + the attention matmuls, 4*L*T^2*d)
    # agrees within a few percent (the formula also counts biases and LayerNorm weights).
    x, _ = workload.dataset[0]
    counted = 3 * (forward_flops(model, x[None]) + 4 * c.n_layer * c.context**2 * c.d_model)
    assert counted == pytest.approx(workload.flops_per_sample, rel=0.03)


def test_module_function_returning_a_tuple_gets_the_defaults() -> None:
    workload = load_workload(f"{HERE}:tuple_workload", seed=5)
    assert workload.name == f"{HERE}:tuple_workload"
    assert (workload.batch_size, workload.lr, workload.epochs) == (32, 1e-3, 1)
    assert workload.flops_per_sample == 0.0 and workload.sample is None
    again = load_workload(f"{HERE}:tuple_workload", seed=5)  # seeded: same init, same data
    assert all(torch.equal(a, b) for a, b in zip(params(workload), params(again), strict=True))


def test_module_function_returning_a_workload_gets_the_seed() -> None:
    workload = load_workload(f"  {HERE}:seeded_workload ", seed=7)
    assert workload.name == "line7" and workload.batch_size == 4 and workload.epochs == 2


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("resnet", r"unknown workload 'resnet': use one of mlp, cnn, gpt, gpt2, or 'package"),
        ("", r"workload '' is not a name"),
        (":build", r"is not 'module:function'"),
        ("a:b:c", r"is not 'module:function'"),
        ("no_such_pkg_xyz:build", r"cannot import module 'no_such_pkg_xyz' \(No module named"),
        (f"{HERE}:missing", r"has no 'missing'; its public functions are .*tuple_workload"),
        (f"{HERE}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is of type int, not a function"),
        (f"{HERE}:needs_argument", r"needs_argument\(\) requires size"),
        (f"{HERE}:returns_number", r"must return .* but it returned 42 \(int\)"),
        (f"{HERE}:returns_bad_tuple", r"dataset is int, expected a torch.utils.data.Dataset"),
    ],
)
def test_bad_spec_raises_config_error_saying_what_and_how(spec: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_workload(spec)


def test_bad_seed_and_bad_fields_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"seed='1' must be an int"):
        load_workload("mlp", seed="1")  # type: ignore[arg-type]
    data = TensorDataset(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ConfigError, match=r"batch_size=0 \(must be an int >= 1\); lr=-1"):
        Workload("bad", nn.Linear(1, 1), data, nn.MSELoss(), 0, -1.0, 1, 0.0)
