"""fsdp's pieces: the groups it shards, its settings, its plan, and the errors a user meets.
Mostly without processes; the errors that need a sharded model use one rank, in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError, ShardedTensorError
from gpukit.strategies._fsdp_options import FSDPOptions
from gpukit.strategies._groups import find_blocks, find_groups, tied_names
from gpukit.strategies._recompute import refuse_reentrant
from gpukit.strategies.fsdp import is_sharded


class Tied(nn.Module):
    """Embedding, three blocks and a head tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h).relu()
        return self.head(h)


# -- groups ------------------------------------------------------------------------------------
def test_each_repeated_block_is_a_group_and_the_tied_pair_stays_with_the_root() -> None:
    model = Tied()
    assert [g.names for g in find_groups(model)] == [["blocks.0"], ["blocks.1"], ["blocks.2"]]
    assert tied_names(model) == [["emb.weight", "head.weight"]]


def test_blocks_sharing_a_parameter_are_one_group() -> None:
    model = Tied()
    model.blocks[2].weight = model.blocks[0].weight
    assert [g.names for g in find_groups(model)] == [["blocks.0", "blocks.2"], ["blocks.1"]]


def test_a_block_tied_to_a_module_outside_the_blocks_stays_in_the_root() -> None:
    model = Tied(width=4, vocab=4)
    model.blocks[1].weight = model.head.weight  # 4 x 4: the head's weight serves a block too
    assert [g.names for g in find_groups(model)] == [["blocks.0"], ["blocks.2"]]


def test_a_block_listed_twice_is_one_group_and_no_blocks_means_no_groups() -> None:
    layer = nn.Linear(4, 4)
    assert [g.names for g in find_groups(nn.Sequential(layer, layer, nn.Linear(4, 4)))] == [
        ["0"],
        ["2"],
    ]
    assert find_groups(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == []
    assert find_blocks(nn.Linear(4, 4)) is None


def test_the_longest_list_of_blocks_wins() -> None:
    model = nn.Sequential(
        nn.ModuleList(nn.Linear(2, 2) for _ in range(2)),
        nn.ModuleList(nn.Linear(2, 2) for _ in range(4)),
    )
    found = find_blocks(model)
    assert found is not None and found[0] == "1" and len(found[1]) == 4


# -- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("reshard", "sometimes", "reshard='sometimes'"),
        ("reshard", 0, "reshard=0"),
        ("reshard", 1.5, "reshard=1.5"),
        ("mixed", "fp8", "mixed='fp8'"),
        ("mixed", torch.bfloat16, "mixed="),
        ("offload", "yes", "offload='yes'"),
        ("activation_checkpointing", "some", "activation_checkpointing='some'"),
        ("activation_checkpointing", True, "activation_checkpointing=True"),
        ("compile", "all", "compile='all'"),
        ("tp", 0, "tp=0"),
        ("tp", True, "tp=True"),
        ("replicas", 0, "replicas=0"),
        ("replicas", 2.0, "replicas=2.0"),
        ("accumulation", "sum", "accumulation='sum'"),
    ],
)
def test_each_bad_setting_is_named_with_what_to_give(option: str, value: Any, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        gk.strategies.FSDP(**{option: value})
    text = str(err.value)
    assert said in text and "give" in text


def test_good_settings_are_kept() -> None:
    o = FSDPOptions(reshard=False, mixed="bf16", accumulation="no-sync", compile=True)
    assert o.reshard_after_forward is False
    assert o.mixed_policy().param_dtype == torch.bfloat16
    assert FSDPOptions().reshard_after_forward is None and FSDPOptions().mixed_policy() is None


def test_tensor_parallel_without_a_plan_reads_one_from_the_model() -> None:
    assert gk.strategies.FSDP(tp=2).options.tp_plan is None  # tensor_plans.auto_plan's
    assert gk.strategies.FSDP(tp=2, tp_plan="auto").options.tp_plan == "auto"


def test_tensor_parallel_and_replicas_must_divide_the_ranks() -> None:
    strategy = gk.strategies.FSDP(tp=2, tp_plan={"0": None})
    with pytest.raises(ConfigError, match="needs a multiple of 2 ranks, but this job has 3"):
        gk.Runtime(strategy=strategy, devices=["cpu"] * 3)
    with pytest.raises(ConfigError, match="needs a multiple of 4 ranks, but this job has 2"):
        gk.Runtime(strategy=gk.strategies.FSDP(replicas=4), devices=["cpu"] * 2)


def test_reshard_to_a_group_that_does_not_divide_the_shards_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"FSDP\(reshard=3\).*divisor of 2"):
        gk.Runtime(strategy=gk.strategies.FSDP(reshard=3), devices=["cpu"] * 2)


def test_offload_without_a_gpu_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"offload=True.*needs GPUs.*Drop offload=True"):
        gk.Runtime(strategy=gk.strategies.FSDP(offload=True), devices=["cpu"] * 2)


def test_reentrant_checkpoint_wrapper_is_refused() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    model = Tied()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1], checkpoint_impl=CheckpointImpl.REENTRANT)
    with pytest.raises(ConfigError, match=r"blocks\.1 uses reentrant activation checkpointing"):
        refuse_reentrant(model)
    model.blocks[1] = checkpoint_wrapper(nn.Linear(4, 4))  # non-reentrant: fine
    refuse_reentrant(model)


# -- one rank, in this process -----------------------------------------------------------------
@pytest.fixture
def one_rank() -> Iterator[Callable[..., Any]]:
    """Run ``fn(rt, *args)`` on one fsdp rank here, in a process group of one."""
    made: list[gk.Runtime] = []

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
        rt = gk.Runtime(strategy=gk.strategies.FSDP(**options), devices=["cpu"], seed=0)
        made.append(rt)
        return rt.launch(fn, *args)

    yield run
    for rt in made:
        rt.teardown()


def _setup(rt: gk.Runtime, model: nn.Module) -> Any:
    return rt.setup(model)


def test_a_model_without_parameters_is_refused(one_rank: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match=r"the model has no parameters.*'ddp' or 'single'"):
        one_rank(_setup, nn.Sequential(nn.ReLU()))


def _reentrant(rt: gk.Runtime) -> Any:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    model = Tied()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0], checkpoint_impl=CheckpointImpl.REENTRANT)
    return rt.setup(model)


def test_setup_refuses_reentrant_checkpointing(one_rank: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="reentrant"):
        one_rank(_reentrant)


def _tied_across_groups(rt: gk.Runtime) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = Tied()
    rt.barrier()  # the process group exists from here on
    fully_shard(model.head)  # the user shards the head alone: its weight is the embedding's
    return rt.setup(model)


def test_tied_parameters_split_across_groups_are_refused(one_rank: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError) as err:
        one_rank(_tied_across_groups)
    text = str(err.value)
    assert "shares a parameter with a module that is already sharded" in text
    assert "fully_shard([embedding, head])" in text


def _plan(rt: gk.Runtime) -> dict[str, Any]:
    model = rt.setup(Tied())
    return {
        "sharded": is_sharded(model),
        "plan": rt.strategy.plans[0],  # type: ignore[attr-defined]
        "same": model.head.weight is model.emb.weight,
    }


def test_the_plan_names_each_group_and_its_bytes(one_rank: Callable[..., Any]) -> None:
    got = one_rank(_plan, activation_checkpointing="full")
    plan = got["plan"]
    assert got["sharded"] and got["same"]
    assert [g.name for g in plan.groups] == ["blocks.0", "blocks.1", "blocks.2", "(root: the rest)"]
    assert [g.parameters for g in plan.groups] == [20, 20, 20, 44]  # tied weight counted once
    assert plan.full_bytes == plan.local_bytes == 104 * 4  # one rank keeps everything
    text = plan.render()
    assert "activation checkpointing: full" in text
    assert "tied: emb.weight = head.weight (kept in one group)" in text
    assert not is_sharded(Tied())


def _outside_the_forward(rt: gk.Runtime) -> Any:
    model = Tied()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 11, (2, 3))

    def compute_loss(batch: torch.Tensor) -> torch.Tensor:
        h = torch.ones(2, 3, 4)  # a plain tensor, times the shard of a weight, outside its module
        return (h @ model.head.weight.T).sum()

    return rt.train_step(optimizer, x, compute_loss)


def test_a_sharded_weight_used_outside_its_module_is_explained(
    one_rank: Callable[..., Any],
) -> None:
    with pytest.raises(ShardedTensorError) as err:
        one_rank(_outside_the_forward)
    assert "a sharded parameter was used outside its module" in str(err.value)


def _stale(rt: gk.Runtime) -> Any:
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = rt.setup(model)  # the optimizer is not passed: it keeps the old parameters
    rt.backward(F.cross_entropy(model(torch.tensor([[1, 2]])).flatten(0, 1), torch.tensor([3, 4])))
    rt.step(optimizer)


def test_an_optimizer_setup_never_saw_is_refused_at_its_first_step(
    one_rank: Callable[..., Any],
) -> None:
    with pytest.raises(ConfigError, match=r"holds 7 parameter.*Pass the optimizer to rt.setup"):
        one_rank(_stale)


@pytest.mark.parametrize("accumulation", ["reduce-scatter", "no-sync"])
def test_under_mixed_precision_the_users_model_is_the_sharded_root(accumulation: str) -> None:
    # bf16-mixed puts the model inside an autocast module; fsdp shards the model itself as the
    # root, so a call on the model alone (a sample, an evaluation) gathers the root's weights.
    rt = gk.Runtime(
        strategy=gk.strategies.FSDP(accumulation=accumulation),
        devices=["cpu"],
        precision="bf16-mixed",
        accumulate=2,
        seed=0,
    )
    try:
        model = Tied()
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        x = torch.randint(0, 11, (4, 5))
        for _ in range(2):
            rt.backward(F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()))
            rt.step(opt)
        assert rt.global_step == 1
        user = rt.unwrap(model)
        assert is_sharded(user) and type(user).__name__.startswith("FSDP")
        with torch.no_grad():
            assert user(x).shape == (4, 5, 11)  # no ShardedTensorError at the embedding
    finally:
        rt.teardown()


def test_a_parameter_with_no_dimension_is_named(one_rank: Callable[..., Any]) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))
            self.tiny = nn.Linear(3, 1)  # fewer rows than ranks would be fine: padded

    def setup(rt: gk.Runtime) -> None:
        rt.setup(Scaled())

    with pytest.raises(ConfigError, match=r"no dimension \(scale\).*1-element tensor"):
        one_rank(setup)


def test_the_layers_win_over_the_heads_listed_inside_one_layer() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))

    model = nn.Sequential(nn.Embedding(5, 4), nn.ModuleList(Layer() for _ in range(3)))
    found = find_blocks(model)
    assert found is not None and found[0] == "1" and len(found[1]) == 3


def _weights_loaded_on_rank_zero(rt: gk.Runtime) -> list[bool]:
    model = Tied()
    if rt.rank == 0:  # the habit DDP allows: load on rank 0, let the strategy share it
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
    model = rt.setup(model)
    full = rt.full_state_dict()
    return [bool((v == 0.5).all()) for v in full.values()]


@pytest.mark.processes
def test_rank_zeros_weights_become_every_ranks_before_sharding() -> None:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=None)
    loaded = rt.launch(_weights_loaded_on_rank_zero)
    assert loaded and all(loaded)


def test_a_model_the_user_sharded_refuses_settings_for_blocks_gpukit_did_not_choose(
    one_rank: Callable[..., Any],
) -> None:
    def setup(rt: gk.Runtime) -> None:
        from torch.distributed.fsdp import fully_shard

        rt.barrier()  # the process group exists: fully_shard needs it
        model = Tied()
        for block in model.blocks:
            fully_shard(block)
        rt.setup(model)

    with pytest.raises(
        ConfigError, match=r"already sharded with fully_shard.*activation_checkpointing=..."
    ):
        one_rank(setup, activation_checkpointing="full")


def test_a_tp_plan_without_tp_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tp_plan=.*tp=1"):
        gk.strategies.FSDP(tp_plan={"blocks.*": object()})


def test_only_gpukits_own_wrapper_is_looked_inside(one_rank: Callable[..., Any]) -> None:
    # A user's module with one child and no tensors of its own is the root itself: calling a
    # method of the child through it still works (the root gathers for its own forward).
    class Task(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = Tied()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm.head(self.lm.emb(x))

    def run(rt: gk.Runtime) -> tuple[int, ...]:
        model = rt.setup(Task())
        return tuple(model(torch.randint(0, 11, (2, 3))).shape)

    assert one_rank(run) == (2, 3, 11)


def test_fp16_gathering_without_a_scaler_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"mixed='fp16'.*precision='16-mixed'"):
        gk.Runtime(strategy=gk.strategies.FSDP(mixed="fp16"), devices=["cpu"], precision="32")


def test_the_plan_of_a_model_set_up_again_is_printed_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def setup_twice(rt: gk.Runtime, width: int) -> None:
        for _ in range(2):  # a second setup of the same model in the same run
            torch.manual_seed(0)
            rt.setup(nn.Sequential(nn.Linear(4, width), nn.Linear(width, width)))

    for _ in range(2):  # a loop that makes a new Runtime each time
        rt = gk.Runtime(strategy="fsdp", devices=["cpu"])
        try:
            rt.launch(setup_twice, 6)
        finally:
            rt.teardown()
    assert capsys.readouterr().out.count("gpukit: fsdp over 1 rank(s)") == 1
    rt = gk.Runtime(strategy="fsdp", devices=["cpu"])
    try:
        rt.launch(setup_twice, 10)  # another model: its own plan
    finally:
        rt.teardown()
    assert capsys.readouterr().out.count("gpukit: fsdp over 1 rank(s)") == 1
