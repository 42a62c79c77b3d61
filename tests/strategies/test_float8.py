"""Float8 training through torchao: the conversion, short trainings against float32, two fsdp
ranks gathering float8 weights against one process, the step's host reads, and each refusal.
Everything runs on the CPU, where torchao emulates float8 products."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
import gpukit.strategies.float8
from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import fsdp2
from gpukit.strategies.float8 import check_float8_device, convert_float8

pytest.importorskip("torchao")
float8 = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
WeightWithDynamicFloat8CastTensor = pytest.importorskip(
    "torchao.float8.fsdp_utils"
).WeightWithDynamicFloat8CastTensor

CPU = Device("cpu")
STEPS = 10


class Block(nn.Module):
    """A small residual MLP block whose dimensions are multiples of 16."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Two blocks (fsdp's groups), a projection float8 cannot take (10 features) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.side = nn.Linear(32, 10)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.side(x).mean(-1, keepdim=True)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _data(batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of a learnable task: the targets are a fixed map of the inputs."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 16, generator=gen) / 32**0.5
    xs = [torch.randn(batch, 32, generator=gen) for _ in range(STEPS)]
    return [(x, x @ teacher) for x in xs]


def _train(rt: gk.Runtime) -> list[float]:
    """STEPS AdamW steps; each step's loss over the whole batch (averaged over the ranks)."""
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    losses = []
    for x, y in _data():
        share = x.shape[0] // rt.world_size
        mine = slice(rt.rank * share, (rt.rank + 1) * share)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(float(rt.all_reduce(loss.detach(), "mean")))
    return losses


# -- the conversion ----------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_recipe_converts_the_layers_float8_can_take(
    recipe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _net()
    run = convert_float8(model, recipe, CPU, fsdp=False)
    assert run.converted == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    assert run.left_out == {"side": "32x10 not multiples of 16", "head": "output head"}
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in run.converted)
    assert type(model.side) is nn.Linear and type(model.head) is nn.Linear
    assert model.blocks[0].up.config.emulate  # the CPU: emulated
    said = capsys.readouterr().out
    assert f"float8 {recipe}: 4 of 6 Linear layers converted" in said
    assert "emulated on the CPU" in said
    model(torch.randn(4, 32)).sum().backward()
    assert model.blocks[0].up.weight.grad is not None


def test_the_line_is_said_once_and_fsdp_gathers_tensorwise_weights_in_float8(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpukit.strategies.float8, "_SAID", set())  # as in a new process
    convert_float8(_net(), "tensorwise", CPU, fsdp=False, rank=0)
    convert_float8(_net(), "tensorwise", CPU, fsdp=False, rank=0)
    convert_float8(_net(), "tensorwise", CPU, fsdp=False, rank=1)  # other ranks stay quiet
    said = capsys.readouterr().out
    assert said.count("float8 tensorwise") == 1 and said.count("emulated on the CPU") == 1
    model = _net()
    tensorwise = convert_float8(model, "tensorwise", CPU, fsdp=True, quiet=True)
    assert tensorwise.all_gather
    assert isinstance(model.blocks[0].up.weight.data, WeightWithDynamicFloat8CastTensor)
    # Rowwise weights have one scale per row: torchao gathers them in their own dtype.
    assert not convert_float8(_net(), "rowwise", CPU, fsdp=True, quiet=True).all_gather


# -- training ----------------------------------------------------------------------------------
# Measured on the CPU: float32 goes from 1.633 to 0.572 in 10 steps, tensorwise from 1.634 to
# 0.571, rowwise from 1.628 to 0.572; at every step each recipe is within 0.6% of float32
# (0.7% of bf16-mixed under it). 3% leaves room for other CPUs' kernels and still catches a
# layer that does not train.
TOLERANCE = 0.03


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_short_training_learns_as_float32_does(recipe: str) -> None:
    plain = _train(gk.Runtime(devices="cpu", seed=0))
    strategy = gk.strategies.SingleDevice(float8=recipe)
    fp8 = _train(gk.Runtime(strategy=strategy, devices="cpu", seed=0))
    assert fp8[-1] < 0.5 * fp8[0]  # it learns
    assert fp8 == pytest.approx(plain, rel=TOLERANCE)
    assert fp8 != plain  # float8 did round


def test_bf16_mixed_on_the_cpu_trains_too() -> None:
    strategy = gk.strategies.SingleDevice(float8="rowwise")
    rt = gk.Runtime(strategy=strategy, devices="cpu", seed=0, precision="bf16-mixed")
    plain = _train(gk.Runtime(devices="cpu", seed=0, precision="bf16-mixed"))
    assert _train(rt) == pytest.approx(plain, rel=TOLERANCE)


def test_one_fsdp_rank_trains_as_one_device() -> None:
    """Sharding over one rank changes nothing: the float8 all-gather and the scales computed
    after each step give the plain float8 run's losses, bit for bit."""
    single = gk.strategies.SingleDevice(float8="tensorwise")
    plain = _train(gk.Runtime(strategy=single, devices="cpu", seed=0))
    rt = gk.Runtime(strategy=gk.strategies.FSDP(float8="tensorwise"), devices=["cpu"], seed=0)
    try:
        assert rt.launch(_train) == plain
    finally:
        rt.teardown()


def _plain_float8() -> list[float]:
    single = gk.strategies.SingleDevice(float8="tensorwise")
    return _train(gk.Runtime(strategy=single, devices="cpu", seed=0))


def test_checkpointed_blocks_train_alike(one_rank: Callable[..., Any]) -> None:
    """Float8 first, then activation checkpointing, as torchtitan orders them: the blocks
    recompute their float8 forward in the backward, and no loss changes."""
    plain = _plain_float8()
    assert one_rank(_train, float8="tensorwise", activation_checkpointing="full") == plain


@pytest.mark.slow  # dynamo traces torchao's float8 tensors: seconds of CPU
def test_compiled_blocks_train_alike() -> None:
    plain = _plain_float8()
    compiled = gk.strategies.FSDP(float8="tensorwise")
    rt = gk.Runtime(strategy=compiled, devices=["cpu"], seed=0, compile="aot_eager")
    try:
        assert rt.launch(_train) == plain
    finally:
        rt.teardown()


# Two ranks scale each half-batch's activations on their own. Tensorwise scales are per
# tensor, so each half gets its own scale and the losses move off one process's by 0.7% at most
# (measured); rowwise scales are per row, the same however the batch is split (2e-7 measured).
RANKS_TOLERANCE = {"tensorwise": 0.02, "rowwise": 1e-5}


@pytest.mark.processes
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_two_fsdp_ranks_train_as_one_process(recipe: str) -> None:
    one = gk.Runtime(strategy=gk.strategies.FSDP(float8=recipe), devices=["cpu"], seed=0)
    try:
        alone = one.launch(_train)
    finally:
        one.teardown()
    two = gk.Runtime(strategy=gk.strategies.FSDP(float8=recipe), devices=["cpu", "cpu"], seed=0)
    together = two.launch(_train)
    assert together == pytest.approx(alone, rel=RANKS_TOLERANCE[recipe])
    assert together[-1] < 0.5 * together[0]


def _gathers_in_float8(rt: gk.Runtime) -> list[bool]:
    model = rt.setup(_net())
    up = model.blocks[0].up
    return [
        isinstance(up.weight.to_local(), WeightWithDynamicFloat8CastTensor),
        isinstance(model.head.weight.to_local(), WeightWithDynamicFloat8CastTensor),
    ]


def test_fsdp_tensorwise_shards_float8_weights_and_leaves_the_head(
    one_rank: Callable[..., Any],
) -> None:
    assert one_rank(_gathers_in_float8, float8="tensorwise") == [True, False]


def _resumed(rt: gk.Runtime, folder: str) -> tuple[list[float], list[float]]:
    """Three steps, a save, three more; the load of the save, the same three again."""
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data = _data()
    runs: list[list[float]] = []
    for batches in (data[:3], data[3:6], data[3:6]):
        if len(runs) == 1:
            rt.save(folder)
        elif len(runs) == 2:
            rt.load(folder)
        runs.append([])
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            runs[-1].append(float(loss.detach()))
    return runs[1], runs[2]


def test_a_load_gives_the_next_step_the_loaded_weights_scales(
    one_rank: Callable[..., Any], tmp_path: Any
) -> None:
    """The scales of weights gathered in float8 are computed after each step: a load must
    compute them again, or the next forward would cast the loaded weights with the scales of
    the weights it replaced."""
    after, again = one_rank(_resumed, str(tmp_path / "ckpt"), float8="tensorwise")
    assert again == after


def _full_weights(rt: gk.Runtime, folder: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Two steps; the full weights, those of the export, and whether the first stayed as
    they were through one more step."""
    from safetensors.torch import load_file

    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data = _data()
    for x, y in data[:2]:
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(optimizer)
    full = rt.full_state_dict(model)
    kept = {k: v.clone() for k, v in full.items()}
    exported = load_file(str(rt.save(folder, export=True) / "model.safetensors"))
    x, y = data[3]
    rt.backward(nn.functional.mse_loss(model(x), y))
    rt.step(optimizer)
    return full, exported, all(torch.equal(full[k], kept[k]) for k in kept)


def test_full_weights_of_float8_weights_are_plain_and_load_into_a_plain_model(
    one_rank: Callable[..., Any], tmp_path: Any
) -> None:
    """Under fsdp's tensorwise recipe each weight is wrapped by torchao (its all-gather casts
    to float8): the full weights the user gets are plain tensors, named as the plain model's,
    and they do not follow the training on."""
    full, exported, unchanged = one_rank(_full_weights, str(tmp_path / "ckpt"), float8="tensorwise")
    assert {type(v) for v in full.values()} == {torch.Tensor}
    plain = _net()
    plain.load_state_dict(full)  # strict: the same names as without float8
    assert list(full) == list(plain.state_dict()) and sorted(exported) == sorted(full)
    assert all(torch.equal(exported[k], full[k]) for k in full)
    assert unchanged


def _load_full(rt: gk.Runtime, folder: str) -> dict[str, torch.Tensor]:
    net = _net()
    model, _ = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    rt.load(folder)
    return rt.full_state_dict(model)


def test_a_float8_checkpoint_loads_into_a_run_without_float8_and_back(
    one_rank: Callable[..., Any], tmp_path: Any
) -> None:
    """The weights saved after two float8 steps, the same after a load with float8 or without."""
    folder = str(tmp_path / "ckpt")
    full, _, _ = one_rank(_full_weights, folder, float8="tensorwise")
    saved = sorted((tmp_path / "ckpt").glob("step-*"))[0]
    for float8 in (None, "tensorwise"):
        loaded = one_rank(_load_full, str(saved), float8=float8)
        assert list(loaded) == list(full)
        assert all(torch.equal(loaded[k], full[k]) for k in full)


def _save_pretrained(rt: gk.Runtime, folder: str) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = LlamaConfig(vocab_size=64, num_attention_heads=2, num_key_value_heads=2, **sizes)
    model = rt.setup(LlamaForCausalLM(config))
    rt.unwrap(model).save_pretrained(folder)
    return rt.full_state_dict(model)


def test_save_pretrained_writes_float8_weights_as_plain_ones(
    one_rank: Callable[..., Any], tmp_path: Any
) -> None:
    """transformers' save_pretrained under fsdp with weights gathered in float8: safetensors
    gets plain tensors, which load back into the plain model."""
    transformers = pytest.importorskip("transformers")
    full = one_rank(_save_pretrained, str(tmp_path), float8="tensorwise")
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert all(torch.equal(back[k], full[k]) for k in full)


# -- host reads --------------------------------------------------------------------------------
LOG_EVERY = 5


def _reads(rt: gk.Runtime) -> int:
    """Host reads over 10 steps of rt.train_step and rt.log, after two warm-up steps."""
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    batches = _data() + _data()[:2]

    def compute_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    for batch in batches[:2]:
        rt.train_step(optimizer, batch, compute_loss)
    rt.flush_logs()
    with gk.trace() as t:
        for batch in batches[2:]:
            rt.log(loss=rt.train_step(optimizer, batch, compute_loss))
    return sum(s.count for s in t.syncs)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_adds_no_host_read_per_step(recipe: str) -> None:
    """One read per flush of the logs, as without float8: its scales stay on the device."""
    flushes = STEPS // LOG_EVERY
    assert _reads(gk.Runtime(devices="cpu", log_every=LOG_EVERY)) == flushes
    single = gk.strategies.SingleDevice(float8=recipe)
    assert _reads(gk.Runtime(strategy=single, devices="cpu", log_every=LOG_EVERY)) == flushes
    # fsdp with float8 weights: the scales computed after each step are not read either.
    strategy = gk.strategies.FSDP(float8=recipe)
    fsdp = gk.Runtime(strategy=strategy, devices=["cpu"], log_every=LOG_EVERY)
    try:
        assert fsdp.launch(_reads) == flushes
    finally:
        fsdp.teardown()


@pytest.fixture
def one_rank() -> Any:
    """Run ``fn(rt, *args)`` on one fsdp rank here, in a process group of one."""
    made: list[gk.Runtime] = []

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
        rt = gk.Runtime(strategy=gk.strategies.FSDP(**options), devices=["cpu"], seed=0)
        made.append(rt)
        return rt.launch(fn, *args)

    yield run
    for rt in made:
        rt.teardown()


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "owner"),
    [
        (lambda: gk.strategies.FSDP(float8="fp8"), "FSDP"),
        (lambda: gk.strategies.DDP(float8="mxfp8"), "DDP"),
        (lambda: gk.strategies.SingleDevice(float8=True), "SingleDevice"),  # type: ignore[arg-type]
        (lambda: gk.strategies.Parallel(float8="fp8"), "Parallel"),
        (lambda: gk.Runtime(parallel={"float8": "fp8"}, devices=["cpu"] * 2), "Parallel"),
    ],
)
def test_an_unknown_recipe_is_refused_with_the_known_ones(
    make: Callable[[], Any], owner: str
) -> None:
    with pytest.raises(
        ConfigError, match=rf"^{owner}\(float8=.*give None.*'tensorwise'.*'rowwise'"
    ):
        make()


def test_without_torchao_the_error_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install torchao.*torch \("):
        gk.strategies.FSDP(float8="tensorwise")
    gk.strategies.FSDP()  # without float8, torchao is not needed


def test_a_torchao_that_does_not_load_with_this_torch_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # torchao itself is found
    with pytest.raises(ConfigError, match=r"does not load with torch .*release made for"):
        gk.strategies.SingleDevice(float8="rowwise")


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_gpu_without_float8_tensor_cores_is_named(
    strategy: str, fake_gpus: Callable[..., Any]
) -> None:
    fake_gpus(1, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    made = {"single": gk.strategies.SingleDevice, "fsdp": gk.strategies.FSDP}[strategy]
    with pytest.raises(
        ConfigError,
        match=r"float8 tensor cores.*cuda:0 is NVIDIA A100-SXM4-80GB of compute "
        r"capability 8\.0",
    ):
        gk.Runtime(strategy=made(float8="tensorwise"), devices="cuda:0", precision="bf16-mixed")


def test_on_a_gpu_float8_needs_bf16_mixed(fake_gpus: Callable[..., Any]) -> None:
    fake_gpus(1, name="NVIDIA H100 80GB HBM3", capability=(9, 0))
    with pytest.raises(ConfigError, match=r"bf16 mixed precision.*'32'.*precision='bf16-mixed'"):
        gk.Runtime(
            strategy=gk.strategies.DDP(float8="tensorwise"), devices="cuda:0", precision="32"
        )
    # fsdp computing in bfloat16 by its own setting is bf16 mixed precision too.
    fsdp = gk.strategies.FSDP(float8="tensorwise", mixed="bf16")
    assert gk.Runtime(strategy=fsdp, devices="cuda:0", precision="32").strategy is fsdp


def test_a_model_float8_cannot_convert_is_refused() -> None:
    odd = nn.Sequential(nn.Linear(10, 30), nn.ReLU(), nn.Linear(30, 3))
    with pytest.raises(ConfigError, match=r"no Linear layer float8 can convert.*0: 10x30"):
        convert_float8(odd, "tensorwise", CPU, fsdp=False)
    with pytest.raises(ConfigError, match=r"Linear layers found: 1; \(the model\): output head"):
        convert_float8(nn.Linear(32, 32), "rowwise", CPU, fsdp=False)
    rt = gk.Runtime(strategy=gk.strategies.SingleDevice(float8="tensorwise"), devices="cpu")
    with pytest.raises(ConfigError, match=r"no Linear layer float8 can convert"):
        rt.setup(odd)


def test_a_model_already_in_float8_is_refused() -> None:
    model = _net()
    convert_float8(model, "tensorwise", CPU, fsdp=False, quiet=True)
    with pytest.raises(ConfigError, match=r"already has float8 layers \(blocks\.0\.up"):
        convert_float8(model, "tensorwise", CPU, fsdp=False)


def test_a_device_neither_cuda_nor_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"CUDA GPUs of compute capability 8\.9.*trains on mps"):
        check_float8_device("rowwise", Device("mps"))


def _shard_then_setup(rt: gk.Runtime) -> None:
    model = _net()
    rt.barrier()  # fully_shard needs the process group
    fsdp2().fully_shard(model)
    rt.setup(model)


def test_a_model_sharded_by_hand_is_refused(one_rank: Callable[..., Any]) -> None:
    """Float8 must convert the layers before they are sharded: too late once they are."""
    with pytest.raises(ConfigError, match=r"already sharded with fully_shard: let gpukit shard"):
        one_rank(_shard_then_setup, float8="tensorwise")


def test_a_torchao_without_the_recipes_by_name_is_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    import enum

    old = enum.Enum("Float8LinearRecipeName", {"ALL_TENSORWISE": "all_tensorwise"})
    monkeypatch.setattr(float8, "Float8LinearRecipeName", old)
    with pytest.raises(ConfigError, match=r"torchao .* is too old.*pip install 'torchao>=0.10'"):
        gk.strategies.FSDP(float8="tensorwise")
