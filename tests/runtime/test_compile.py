"""gk.Runtime(compile=...): the model under torch.compile for single, ddp and fsdp; refused by
dp; the same results, names and checkpoints as an uncompiled run, and no recompile per step.

Compiling is slow on a CPU: tiny models, few steps; the fast "aot_eager" backend where the
point is dynamo's behaviour (graphs, recompiles), inductor (the default, which starts the C++
compiler: tests marked processes) where it is the result.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch._dynamo.utils import counters

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.runtime import compiling

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def _train(rt: gk.Runtime, model: Any = None, graphs: list[int] | None = None) -> tuple[Any, Any]:
    model = rt.setup(model if model is not None else _model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    for batch in _batches():
        batch = gk.to(batch, rt.device)
        loss = rt.train_step(
            optimizer, batch, lambda b: nn.functional.cross_entropy(model(b[0]), b[1])
        )
        rt.log(loss=loss)
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])
    return model, optimizer


def _weights(rt: gk.Runtime, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rt.unwrap(model).state_dict().items()}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.processes  # inductor runs the C++ compiler
def test_a_compiled_single_run_computes_what_the_plain_one_does() -> None:
    user = _model()
    rt = gk.Runtime(devices="cpu", compile=True, log_every=1)  # inductor
    model, _ = _train(rt, user)
    plain = gk.Runtime(devices="cpu", log_every=1)
    want, _ = _train(plain)
    got, expected = _weights(rt, model), _weights(plain, want)
    assert list(got) == list(expected) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    losses = [r["loss"] for r in rt.history]
    assert losses == pytest.approx([r["loss"] for r in plain.history], rel=1e-5)
    # The user's module is the one trained, and it is not compiled itself.
    assert rt.unwrap(model) is user and user._compiled_call_impl is None
    assert list(model.state_dict()) == list(user.state_dict())
    assert counters["stats"]["unique_graphs"] == 1
    rt.teardown()
    assert user._compiled_call_impl is None


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_no_recompile_after_the_first_step(precision: str, accumulate: int) -> None:
    rt = gk.Runtime(devices="cpu", compile="aot_eager", precision=precision, accumulate=accumulate)
    graphs: list[int] = []
    _train(rt, graphs=graphs)  # a new batch each step, as training has
    assert graphs == [1] * STEPS, graphs


def test_checkpoints_keep_the_names_and_load_either_way(tmp_path: Path) -> None:
    compiled = gk.Runtime(devices="cpu", compile="aot_eager", seed=0)
    model, _ = _train(compiled)
    compiled.save(tmp_path / "compiled")
    (saved,) = (tmp_path / "compiled").glob("step-*/model.safetensors")
    assert sorted(load_file(saved)) == ["0.bias", "0.weight", "2.bias", "2.weight"]

    plain = gk.Runtime(devices="cpu", seed=0)
    other = plain.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    plain.setup(other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    plain.load(tmp_path / "compiled")
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _weights(plain, other).values(), _weights(compiled, model).values(), strict=True
        )
    )
    plain.save(tmp_path / "plain")

    again = gk.Runtime(devices="cpu", compile="aot_eager", seed=0)
    third = again.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    again.setup(third, torch.optim.SGD(third.parameters(), lr=0.1, momentum=0.9))
    again.load(tmp_path / "plain")
    assert again.global_step == STEPS
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _weights(again, third).values(), _weights(compiled, model).values(), strict=True
        )
    )


def test_fsdp_compiles_each_block_and_dp_is_refused() -> None:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], compile="aot_eager")
    assert rt.strategy.options.compile == "blocks"  # type: ignore[attr-defined]
    assert rt.strategy.compile_backend == "aot_eager"  # type: ignore[attr-defined]
    for strategy in ("dp", "dp-balanced"):
        with pytest.raises(ConfigError, match=r"strategy='ddp'.*drop compile"):
            gk.Runtime(strategy=strategy, devices=["cpu", "cpu"], compile=True)


@pytest.mark.parametrize(
    ("value", "match"),
    [(3, "compile=3: give True"), ("", "give True"), ("nope", "neither a torch.compile mode")],
)
def test_bad_compile_values_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        gk.Runtime(devices="cpu", compile=value)


def test_a_torch_that_cannot_compile_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    said = "Python 3.12+ not yet supported for torch.compile"
    monkeypatch.setattr(compiling, "_dynamo_supported", lambda: (False, said))
    with pytest.raises(
        ConfigError, match=rf"torch.compile does not run .*{re.escape(said)}.*drop compile"
    ):
        gk.Runtime(devices="cpu", compile=True)
    gk.Runtime(devices="cpu")  # without compile, nothing is asked of torch


def _ddp_run(rt: gk.Runtime, backend: str | bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    rt2 = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], compile=backend, accumulate=2, seed=0)
    graphs: list[int] = []
    model, _ = _train(rt2, graphs=graphs)
    plain = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], accumulate=2, seed=0)
    want, _ = _train(plain)
    return {
        "wrapped": isinstance(model, DistributedDataParallel)
        and model._compiled_call_impl is not None,
        "got": _weights(rt2, model),
        "want": _weights(plain, want),
        "graphs": graphs,
        "names": list(model.state_dict()),
    }


@pytest.mark.processes
def test_ddp_on_two_ranks_compiles_the_wrapper_and_matches_the_plain_run() -> None:
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"])
    result = rt.launch(_ddp_run, True)
    assert result["wrapped"]
    assert result["names"] == [
        "module.0.weight",
        "module.0.bias",
        "module.2.weight",
        "module.2.bias",
    ]
    for name, want in result["want"].items():
        torch.testing.assert_close(result["got"][name], want, rtol=1e-5, atol=1e-6)
    # DDPOptimizer may cut the model into a graph per gradient bucket; after the first step
    # (accumulating, then synchronising) nothing compiles again.
    graphs = result["graphs"]
    assert graphs[0] >= 1 and graphs == [graphs[0]] * STEPS, graphs


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _fsdp_run(rt: gk.Runtime) -> dict[str, Any]:
    graphs: list[int] = []
    model, _ = _train(rt, _Blocks(), graphs=graphs)
    return {
        "compiled": [b._compiled_call_impl is not None for b in rt.unwrap(model).blocks],
        "root": model._compiled_call_impl is None,
        "names": sorted(rt.full_state_dict(model)),
        "graphs": graphs,
        "plan": rt.strategy.plans[0].render(),  # type: ignore[attr-defined]
    }


@pytest.mark.processes
def test_fsdp_on_two_ranks_compiles_each_block_before_sharding() -> None:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], compile="aot_eager", seed=0)
    result = rt.launch(_fsdp_run)
    assert result["compiled"] == [True, True] and result["root"]
    assert "compile: blocks" in result["plan"]
    assert result["names"] == sorted(_Blocks().state_dict())
    graphs = result["graphs"]
    assert graphs == [graphs[0]] * STEPS, graphs  # no recompile after the first step


# -- torch.compile's modes -------------------------------------------------------------------


def test_a_mode_compiles_in_that_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: asked.append(kw))
    rt = gk.Runtime(devices="cpu", compile="max-autotune-no-cudagraphs")
    rt.setup(_model())
    assert asked == [{"mode": "max-autotune-no-cudagraphs"}]
    assert not rt._compiler.graphs  # the mode records no CUDA graphs


def test_cuda_graph_modes_on_a_cpu_compile_without_graphs_and_say_so() -> None:
    with pytest.warns(UserWarning, match=r"CUDA graphs need a CUDA device.*trains on cpu"):
        rt = gk.Runtime(devices="cpu", compile="reduce-overhead")
    assert rt._compiler.mode == "reduce-overhead" and not rt._compiler.graphs


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_over_several_devices_are_refused(mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"compile='{mode}' records CUDA graphs.*'ddp' \(over 2"):
        gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], compile=mode)
    with pytest.raises(ConfigError, match=r"fsdp compiles each repeated block with .*default"):
        gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], compile=mode)


def test_a_loader_with_a_short_last_batch_is_refused_under_cuda_graphs() -> None:
    from torch.utils.data import DataLoader

    rt = gk.Runtime(devices="cpu")
    rt._compiler.graphs, rt._compiler.mode = True, "reduce-overhead"  # as on a GPU
    with pytest.raises(ConfigError, match=r"last batch has 2 samples, not batch_size=4.*drop_last"):
        rt.setup_loader(DataLoader(list(range(10)), batch_size=4))
    rt.setup_loader(DataLoader(list(range(10)), batch_size=4, drop_last=True))
    rt.setup_loader(DataLoader(list(range(8)), batch_size=4))  # every batch the same size


def _as_under_cuda_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[gk.Runtime, Any, torch.optim.Optimizer, list[int]]:
    """A Runtime that takes its model to replay CUDA graphs (as on a GPU), its model and
    optimizer set up, and the list each new replay's start is noted in."""
    begun: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: begun.append(1))
    rt = gk.Runtime(devices="cpu")
    rt._compiler.graphs = True
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return rt, model, optimizer, begun


def test_under_cuda_graphs_a_step_begins_a_new_replay_and_returns_its_own_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt, model, optimizer, begun = _as_under_cuda_graphs(monkeypatch)
    returned: list[torch.Tensor] = []

    def loss_of(batch: Any) -> torch.Tensor:
        returned.append(nn.functional.cross_entropy(model(batch[0]), batch[1]))
        return returned[-1]

    losses = [rt.train_step(optimizer, batch, loss_of) for batch in _batches(2)]
    assert len(begun) == 2
    # A copy, so the next replay cannot overwrite what rt.log holds; the same value.
    assert all(got is not made for got, made in zip(losses, returned, strict=True))
    assert [g.item() for g in losses] == [m.item() for m in returned]


class _ReturnsItsLoss(nn.Module):
    """A model that computes its own loss (as nanoGPT's does): under CUDA graphs the loss is
    one of the graph's outputs, which the next replay overwrites."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.gpu
def test_reduce_overhead_on_a_gpu_trains_as_eager_and_keeps_every_logged_loss() -> None:
    def run(compile: bool | str) -> tuple[list[float], dict[str, torch.Tensor]]:
        rt = gk.Runtime(devices="cuda", compile=compile, log_every=3)
        model = _ReturnsItsLoss()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for batch in _batches(6):
            batch = gk.to(batch, rt.device)
            loss = rt.train_step(optimizer, batch, lambda b: model(b[0], b[1]))
            rt.log(loss=loss)  # held across 3 replays before it is read back
        history = [r["loss"] for r in rt.history]
        weights = _weights(rt, model)
        rt.teardown()
        return history, weights

    graphs, graph_weights = run("reduce-overhead")
    eager, eager_weights = run(False)
    assert len(graphs) == len(eager) == 2
    torch.testing.assert_close(graphs, eager, rtol=1e-4, atol=1e-5)
    for name, want in eager_weights.items():
        torch.testing.assert_close(graph_weights[name], want, rtol=1e-4, atol=1e-5)


def test_cuda_graph_modes_refuse_what_changes_a_steps_shapes() -> None:
    with pytest.raises(ConfigError, match=r"accumulate=2 runs 2 forwards.*compile=True"):
        gk.Runtime(devices="cpu", compile="reduce-overhead", accumulate=2)
    with pytest.raises(ConfigError, match=r"oom='recover' cuts a batch.*oom='raise'"):
        gk.Runtime(devices="cpu", compile="max-autotune", oom="recover")
    with pytest.warns(UserWarning, match="CUDA graphs need a CUDA device"):
        rt = gk.Runtime(devices="cpu", compile="reduce-overhead", oom="auto")
    assert not rt.settings.recovers(distributed=False)  # auto: no recovery under graphs
    assert gk.Runtime(devices="cpu", oom="auto").settings.recovers(distributed=False)


def test_a_loop_of_its_own_begins_a_new_replay_after_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt, model, optimizer, begun = _as_under_cuda_graphs(monkeypatch)
    for x, y in _batches(3):
        rt.backward(nn.functional.cross_entropy(model(x), y))
        rt.step(optimizer)
    assert len(begun) == 3
