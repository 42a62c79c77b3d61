"""Float8 training through torchao: the model's Linear layers compute their matrix products in
float8, on top of bf16 mixed precision, with the scales torchao's recipes choose.

A strategy given ``float8="tensorwise"`` or ``"rowwise"`` converts the model before anything
else touches it (in torchtitan's order: float8, then tensor parallel, activation
checkpointing, compile, sharding). Left out, as torchtitan leaves them out: Linear layers whose
dimensions are not multiples of 16 (float8 matrix products need them), and the output head
(the model's last Linear), whose logits float8 would round the most.

- ``"tensorwise"``: one scale per tensor. Under fsdp the weights are all-gathered in float8
  (half the bytes of bf16); their scales are computed for every weight in one all-reduce right
  after each optimizer step and after each load (``precompute_scales``, which fsdp's
  ``after_optimizer_step`` calls). Weights changed by hand between steps keep the scales of
  the step before: their largest values may then clip at float8's range.
- ``"rowwise"``: one scale per row: more accurate, slower; weights gathered in bf16.

Float8 tensor cores need a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell). On
the CPU torchao emulates them (float8 values, float32 products): the same numbers' rounding,
none of the speed, which is what tests and a first try on a laptop need.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 10))
>>> run = convert_float8(model, "tensorwise", Device("cpu"), fsdp=False, quiet=True)
>>> run.converted, sorted(run.left_out)
(['0', '2'], ['3'])
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from gpukit._util.text import described
from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor

RECIPES = ("tensorwise", "rowwise")
# Float8 tensor cores: Ada (8.9), Hopper (9.0) and later.
FLOAT8_CAPABILITY = (8, 9)
_MULTIPLE = 16  # float8 matrix products need each dimension a multiple of 16
_SAID: set[str] = set()  # the lines this process printed (each is said once)


def check_float8_recipe(recipe: object, owner: str) -> str | None:
    """``recipe`` if it is None or a torchao recipe gpukit trains with, else the error naming
    ``owner`` (the strategy's class); torchao must then be importable."""
    if recipe is None:
        return None
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ConfigError(
            f"{owner}(float8={described(recipe)}): give None (no float8), 'tensorwise' (one "
            "scale per tensor; under fsdp the weights are gathered in float8) or 'rowwise' "
            "(one scale per row: more accurate, slower)"
        )
    torchao_float8()
    return recipe


def torchao_float8() -> Any:
    """torchao's float8 module, or the error that says how to install it."""
    try:
        float8 = importlib.import_module("torchao.float8")
    except ImportError as err:
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(
                "float8 training needs torchao, which is not installed: pip install torchao "
                "(or pip install 'gpukit[float8]'), 0.10 or newer, in the release made for this "
                f"torch ({torch.__version__}: each torchao release names the torch it needs)"
            ) from None
        raise ConfigError(
            f"torchao is installed but its float8 module does not load with torch "
            f"{torch.__version__} ({err}): install the torchao release made for this torch "
            "(pip install -U torchao), or the torch that torchao needs"
        ) from None
    if not hasattr(float8, "Float8LinearRecipeName") or not _names_recipes(float8):
        version = getattr(importlib.import_module("torchao"), "__version__", "an old release")
        raise ConfigError(
            f"torchao {version} is too old for float8 training under gpukit (it has no "
            "'tensorwise' and 'rowwise' recipes): pip install 'torchao>=0.10'"
        )
    return float8


def _names_recipes(float8: Any) -> bool:
    values = {r.value for r in float8.Float8LinearRecipeName}
    return set(RECIPES) <= values


def check_float8_device(recipe: str | None, device: Device) -> None:
    """Refuse float8 on ``device`` where it cannot run: a CUDA GPU without float8 tensor
    cores, or a device that is neither a CUDA GPU nor the CPU (emulated there)."""
    if recipe is None or device.type == "cpu":
        return
    if device.type != "cuda":
        raise ConfigError(
            f"float8={recipe!r} runs on CUDA GPUs of compute capability 8.9 or more, or "
            f"emulated on the CPU, but this run trains on {device}: drop float8= or train on "
            "such a GPU"
        )
    capability = device.compute_capability
    if capability is not None and tuple(capability) < FLOAT8_CAPABILITY:
        name = device.name or str(device)
        raise ConfigError(
            f"float8={recipe!r} needs float8 tensor cores (compute capability 8.9 or more: "
            f"Ada, Hopper, Blackwell, e.g. L4, L40S, H100), but {device} is {name} of "
            f"compute capability {capability[0]}.{capability[1]}: drop float8= (train in "
            "bf16-mixed alone) or train on such a GPU"
        )


def check_float8_precision(
    recipe: str | None, device: Device, precision: str, *, bf16: bool
) -> None:
    """Refuse a run ``precision`` float8 cannot go with on a GPU: float8 converts the Linear
    layers only, and the rest of the model must compute in bfloat16 (``bf16``: the strategy
    computes in bfloat16 by its own setting, fsdp's ``mixed='bf16'``). The CPU's emulation
    runs under any precision."""
    if recipe is None or device.type != "cuda" or precision == "bf16-mixed" or bf16:
        return
    raise ConfigError(
        f"float8={recipe!r} trains on top of bf16 mixed precision, but this run's precision is "
        f"{precision!r}: use precision='bf16-mixed' (gpukit train --precision bf16-mixed)"
    )


@dataclass
class Float8Training:
    """What ``convert_float8`` did to one model: its ``recipe``, whether the products are
    ``emulated`` (the CPU), whether fsdp gathers the weights in float8 (``all_gather``), and
    the names of the Linear layers ``converted`` and ``left_out`` (name -> why)."""

    recipe: str
    emulated: bool
    all_gather: bool
    converted: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: the recipe, how many Linear layers were converted, which were not."""
        line = (
            f"float8 {self.recipe}: {len(self.converted)} of "
            f"{len(self.converted) + len(self.left_out)} Linear layers converted"
        )
        if self.left_out:
            shown = list(self.left_out.items())[:4]
            more = f" and {len(self.left_out) - 4} more" if len(self.left_out) > 4 else ""
            line += "; left out: " + ", ".join(f"{n} ({why})" for n, why in shown) + more
        if self.all_gather:
            line += "; weights all-gathered in float8"
        if self.emulated:
            line += "; emulated on the CPU (float8 rounding, float32 products: no speed-up)"
        return line


def convert_float8(
    model: nn.Module,
    recipe: str,
    device: Device,
    *,
    fsdp: bool,
    rank: int = 0,
    quiet: bool = False,
) -> Float8Training:
    """Swap ``model``'s Linear layers for torchao's float8 ones, in place, with ``recipe``
    ("tensorwise" or "rowwise"); emulated on a CPU ``device``. ``fsdp``: the model is sharded
    next (under "tensorwise" its weights are then gathered in float8). Rank 0 prints one line
    saying what was converted, unless ``quiet``. Call it before tensor parallel, activation
    checkpointing, compile and sharding."""
    float8 = torchao_float8()
    converted, left_out = _choose(model, recipe)
    emulated = device.type != "cuda"
    all_gather = fsdp and recipe == "tensorwise"
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulated,
        enable_fsdp_float8_all_gather=all_gather,
    )
    chosen = set(converted)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _module, name: name in chosen
    )
    run = Float8Training(recipe, emulated, all_gather, converted, left_out)
    if rank == 0 and not quiet:
        _say_once(run.summary())
    return run


def precompute_scales(module: nn.Module) -> None:
    """After each optimizer step, for weights all-gathered in float8: every weight's scale at
    once (one all-reduce of their maxima, nothing read back), instead of one all-reduce per
    weight at its next all-gather. Nothing to do for a model without such weights."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)


def plain_weight(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or the plain tensor inside torchao's float8 weight wrapper (under fsdp's
    "tensorwise" each weight's data is wrapped so that its all-gather casts to float8): what
    a state dict hands to the user, safetensors or a model without float8 must hold."""
    # Without importing torchao: its wrapper is a tensor subclass around one plain tensor.
    while is_traceable_wrapper_subclass(tensor) and not is_dtensor(tensor):
        inner, _ = tensor.__tensor_flatten__()
        if len(inner) != 1:
            break
        tensor = getattr(tensor, inner[0])
    return tensor


def _choose(model: nn.Module, recipe: str) -> tuple[list[str], dict[str, str]]:
    """The Linear layers to convert, and those left out with the reason."""
    float8_linear = importlib.import_module("torchao.float8.float8_linear").Float8Linear
    done = [n for n, m in model.named_modules() if isinstance(m, float8_linear)]
    if done:
        raise ConfigError(
            f"float8={recipe!r}: the model already has float8 layers ({', '.join(done[:3])}), "
            "converted by torchao or by an earlier rt.setup: pass the plain model, or drop "
            "float8= and keep your own conversion"
        )
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted: list[str] = []
    left_out: dict[str, str] = {}
    for i, (name, linear) in enumerate(linears):
        if i == len(linears) - 1:
            left_out[name] = "output head"
        elif linear.in_features % _MULTIPLE or linear.out_features % _MULTIPLE:
            left_out[name] = f"{linear.in_features}x{linear.out_features} not multiples of 16"
        else:
            converted.append(name)
    if not converted:
        why = "; ".join(f"{n or '(the model)'}: {w}" for n, w in left_out.items()) or "none"
        raise ConfigError(
            f"float8={recipe!r}: the model has no Linear layer float8 can convert (Linear "
            f"layers found: {len(linears)}; {why}). Float8 converts nn.Linear layers other than "
            "the last one (the output head) whose in and out features are multiples of 16: "
            "drop float8= for this model"
        )
    return converted, left_out


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, flush=True)
