"""Models built on the meta device: materialised by rt.setup (fsdp: each rank's shards only) and
initialised to the same weights whatever the rank count."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies.meta_init import initialise
from tests.fsdp_models import VOCAB, TiedLM, assert_bit_identical

SEED = 5


class Rotary(nn.Module):
    """A cache computed in ``__init__`` and not saved: to_empty loses it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(4.0), persistent=False)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def _meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def _normal(build: Callable[[], nn.Module], seed: int = SEED) -> nn.Module:
    model = build()
    initialise(model, seed)
    return model


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


# -- one process ---------------------------------------------------------------------------------
def test_single_materialises_and_initialises_as_initialise_does() -> None:
    rt = gk.Runtime(devices="cpu", seed=SEED)
    before = torch.random.get_rng_state()
    model = _meta(_bn_net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the meta parameters
    got, optimizer = rt.setup(model, optimizer)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global generator untouched
    assert not any(t.is_meta for t in [*got.parameters(), *got.buffers()])
    assert_bit_identical(got.state_dict(), _normal(_bn_net).state_dict())
    assert torch.equal(got[1].running_var, torch.ones(8))  # BatchNorm's stats reset too
    assert optimizer.param_groups[0]["params"][0] is got[0].weight  # it trains the real ones


def test_a_tied_parameter_keeps_the_first_holders_init() -> None:
    model = gk.Runtime(devices="cpu", seed=SEED).setup(_meta(TiedLM))
    assert model.head.weight is model.emb.weight
    assert_bit_identical(model.state_dict(), _normal(TiedLM).state_dict())
    assert model.emb.weight.std().item() > 0.5  # Embedding's normal init, not Linear's


def test_init_function_is_called_per_module_on_full_tensors() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []

    def init(module: nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            seen.append((type(module).__name__ + "." + name, tuple(p.shape)))
            nn.init.constant_(p, 0.25)
        for b in module.buffers(recurse=False):
            b.fill_(3.0)

    model = gk.Runtime(devices="cpu", init=init).setup(
        _meta(lambda: nn.Sequential(Scale(), Rotary()))
    )
    assert seen == [("Scale.gain", (4,))]
    assert torch.equal(model[0].gain, torch.full((4,), 0.25))
    assert torch.equal(model[1].cache, torch.full((4,), 3.0))


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: nn.Sequential(nn.Linear(2, 2), Scale()), r"module 1 \(Scale\) holds 1\.gain"),
        (lambda: nn.Sequential(nn.Linear(2, 4), Rotary()), r"module 1 \(Rotary\) holds 1\.cache"),
    ],
)
def test_a_module_nothing_can_initialise_is_named(build: Any, said: str) -> None:
    with pytest.raises(ConfigError, match=said + r".*reset_parameters\(\).*init="):
        gk.Runtime(devices="cpu").setup(_meta(build))


def test_a_half_meta_model_is_refused() -> None:
    model = _meta(_bn_net)
    model[2] = nn.Linear(8, 3)
    with pytest.raises(ConfigError, match=r"partly on the meta device but its 2\.weight"):
        gk.Runtime(devices="cpu").setup(model)


def test_init_must_be_callable() -> None:
    with pytest.raises(ConfigError, match=r"init=3: give a function taking a module"):
        gk.Runtime(devices="cpu", init=3)


@pytest.mark.parametrize(
    "init",
    [
        pytest.param(lambda: None, id="no-argument"),
        pytest.param(lambda module, gain: None, id="two-arguments"),
        pytest.param(lambda *, module: None, id="keyword-only"),
    ],
)
def test_init_of_another_signature_is_refused_before_setup(init: Any) -> None:
    with pytest.raises(ConfigError, match=r"it cannot be called as init\(module\) \("):
        gk.Runtime(devices="cpu", init=init)


def test_init_with_optional_arguments_is_accepted() -> None:
    seen: list[str] = []
    rt = gk.Runtime(devices="cpu", init=lambda m, gain=1.0, **kw: seen.append(type(m).__name__))
    rt.setup(_meta(_bn_net))
    assert "Linear" in seen


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_init_given_for_a_model_not_on_meta_says_it_is_not_used(strategy: str) -> None:
    calls: list[nn.Module] = []
    rt = gk.Runtime(strategy=strategy, devices="cpu", init=calls.append)
    model = _normal(_bn_net)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"init= is not used for this Sequential: it is not on"):
        rt.setup(model)
    assert calls == []  # the stated behaviour: the weights stay as built
    assert_bit_identical(rt.full_state_dict(), before)
    rt.teardown()


# -- fsdp ----------------------------------------------------------------------------------------
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (8, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(rt: gk.Runtime, meta: bool, steps: int) -> dict[str, Any]:
    build = lambda: TiedLM().double()  # noqa: E731
    model = _meta(build) if meta else _normal(build)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = rt.setup(model, optimizer)
    first = rt.full_state_dict()
    n, r = rt.world_size, rt.rank
    for step in range(steps):
        x, y = _batch(step)
        x, y = x[r * 8 // n : (r + 1) * 8 // n], y[r * 8 // n : (r + 1) * 8 // n]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        rt.backward(loss)
        rt.step(optimizer)
    user = rt.unwrap(model)
    tied = user.head.weight is user.emb.weight
    return {"init": first, "trained": rt.full_state_dict(), "tied": tied}


def _launch(ranks: int, meta: bool, steps: int = 0) -> dict[str, Any]:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu"] * ranks, seed=SEED)
    try:
        return rt.launch(_run, meta, steps)
    finally:
        rt.teardown()


@pytest.mark.processes
def test_fsdp_meta_init_gives_the_same_weights_on_one_and_two_ranks_and_trains_alike() -> None:
    one = _launch(1, meta=True)["init"]
    two = _launch(2, meta=True, steps=3)
    normal = _launch(2, meta=False, steps=3)
    assert two["tied"] and normal["tied"]
    assert_bit_identical(two["init"], one)
    assert_bit_identical(one, _normal(lambda: TiedLM().double()).state_dict())
    assert_bit_identical(two["trained"], normal["trained"])
    assert not all(torch.equal(two["trained"][k], one[k]) for k in one)  # it did train


# -- host memory ---------------------------------------------------------------------------------
class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(16))  # 256 MiB

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peaks(rt: gk.Runtime) -> dict[bool, int]:
    """The most resident memory (bytes) this rank held above its start while building and
    setting up the model, built on the meta device and then as usual: the high-water mark is
    reset before each, so imports and the earlier build do not count."""
    grew = {}
    for meta in (True, False):
        Path("/proc/self/clear_refs").write_text("5")
        start = _status("VmRSS:")
        model = _meta(Big) if meta else Big()
        rt.setup(model)
        grew[meta] = _status("VmHWM:") - start
        del model
        gc.collect()
    return grew


# Cold: glibc reads MALLOC_MMAP_THRESHOLD_ when a process starts, which a forked rank did not.
@pytest.mark.cold_start
@pytest.mark.processes
def test_meta_init_keeps_a_ranks_peak_host_memory_below_the_models_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # glibc gives every block of 64 KiB or more back on free, so the mark counts what is held,
    # not what the allocator kept cached (the ranks inherit the variable). One launch measures
    # both builds, the meta one first, so that nothing the normal build made is still around.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=SEED)
    try:
        grew = {meta: peak / 2**20 for meta, peak in rt.launch(_peaks).items()}
    finally:
        rt.teardown()
    print(
        f"rank 0's peak host memory above its start (MiB): meta {grew[True]:.0f}, "
        f"normal {grew[False]:.0f}"
    )
    # The model is 256 MiB, a rank's shards 128 MiB, one block 16 MiB.
    assert grew[False] >= 256  # the normal build held the whole model
    assert grew[True] < 200  # the meta build: its shards and about one block more


class Titan(nn.Module):
    """torchtitan's pattern: the root initialises everything in ``init_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)

    def init_weights(self) -> None:
        nn.init.ones_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.freqs.copy_(torch.arange(4.0))


def test_a_roots_init_weights_initialises_the_whole_model() -> None:
    model = gk.Runtime(devices="cpu").setup(_meta(Titan))
    assert torch.equal(model.proj.weight, torch.ones(4, 4))
    assert torch.equal(model.freqs, torch.arange(4.0))


def _save_then_resume(rt: gk.Runtime, folder: str, meta: bool) -> dict[str, torch.Tensor]:
    model = rt.setup(_meta(TiedLM) if meta else TiedLM())
    if meta:
        rt.load(folder)  # the checkpoint's weights into this rank's shards
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        rt.save(folder)
    return rt.full_state_dict()


def test_a_meta_model_resumes_from_a_checkpoint_into_its_shards(tmp_path: Any) -> None:
    got = {}
    for meta in (False, True):
        rt = gk.Runtime(strategy="fsdp", devices=["cpu"], seed=SEED)
        try:
            got[meta] = rt.launch(_save_then_resume, str(tmp_path / "ckpt"), meta)
        finally:
            rt.teardown()
    assert_bit_identical(got[True], got[False])
