"""A model the user sharded with ``fully_shard`` before ``rt.setup``: what gpukit refuses, on
one rank in this process (training on 2 ranks: tests/runtime/test_user_sharded_fsdp.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies._user_sharded import is_user_sharded, user_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


@pytest.fixture
def one_rank() -> Iterator[Callable[..., Any]]:
    """Run ``fn(rt, *args)`` on one rank here with the Runtime's ``options``."""
    made: list[gk.Runtime] = []

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
        options.setdefault("strategy", "fsdp")
        rt = gk.Runtime(devices=["cpu"], seed=0, **options)
        made.append(rt)
        return rt.launch(fn, *args)

    yield run
    for rt in made:
        rt.teardown()


def _sharded_setup(rt: gk.Runtime, mixed: bool, root: bool) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rt.barrier()  # the process group exists: fully_shard needs it
    model = Net()
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mixed else {}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    if root:
        fully_shard(model, **kwargs)
    model = rt.setup(model)
    out = rt.unwrap(model)
    loss = model(torch.ones(3, 4)).float().sum()
    rt.backward(loss)
    return {
        "groups": len(user_groups(out)),
        "root dtype": out._get_fsdp_state()._mp_policy.param_dtype,  # type: ignore[operator]
        "printed": [(g.name, g.parameters) for g in rt.strategy.plans[-1].groups],  # type: ignore[attr-defined]
        "mixed": rt.strategy.plans[-1].settings["mixed"],  # type: ignore[attr-defined]
    }


def test_a_model_the_user_sharded_is_seen_before_anything_else(
    one_rank: Callable[..., Any],
) -> None:
    assert not is_user_sharded(Net())
    # Blocks sharded by the user, the root by gpukit on their mesh with their mp_policy.
    got = one_rank(_sharded_setup, True, False)
    # The printed plan shows the user's groups, not gpukit's.
    printed = [("blocks.0", 20), ("blocks.1", 20), ("(root: the rest)", 10)]
    mixed = "your mp_policy (parameters in bfloat16)"
    assert got == {"groups": 3, "root dtype": torch.bfloat16, "printed": printed, "mixed": mixed}


@pytest.mark.parametrize("strategy", ["ddp", gk.strategies.DDP()])
def test_ddp_refuses_a_sharded_model_and_names_fsdp(
    one_rank: Callable[..., Any], strategy: Any
) -> None:
    with pytest.raises(ConfigError, match=r"'ddp' replicates .* fully_shard .* strategy='fsdp'"):
        one_rank(_sharded_setup, False, True, strategy=strategy)


def test_precision_beside_the_users_mp_policy_is_refused(one_rank: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match=r"mp_policy=.*precision='bf16-mixed'.*Keep one"):
        one_rank(_sharded_setup, True, True, precision="bf16-mixed")


def test_precision_without_a_mp_policy_is_kept(one_rank: Callable[..., Any]) -> None:
    got = one_rank(_sharded_setup, False, True, precision="bf16-mixed")
    assert got["groups"] == 3


@pytest.mark.parametrize("option", [{"mixed": "bf16"}, {"tp": 1, "compile": "blocks"}])
def test_fsdp_settings_for_the_groups_are_refused(
    one_rank: Callable[..., Any], option: dict[str, Any]
) -> None:
    strategy = gk.strategies.FSDP(**option)
    with pytest.raises(ConfigError, match=r"already sharded with fully_shard.*mp_policy"):
        one_rank(_sharded_setup, False, True, strategy=strategy)
