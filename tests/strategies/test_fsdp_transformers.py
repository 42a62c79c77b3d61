"""Hugging Face ``transformers`` causal LMs (Llama and GPT-2 configs, built without a download)
under fsdp on 2 gloo ranks: their decoder layers are the groups, the tied head stays tied,
and ``save_pretrained`` (the Accelerate idiom ``rt.unwrap(model).save_pretrained(dir)``, every
rank calling it) writes the Hugging Face folder that ``from_pretrained`` loads back bit for
bit equal to ``rt.full_state_dict()``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies._groups import find_groups
from tests.hf_models import tiny_config

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("fsdp-transformers")

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install gpukit[hf])"
)

VOCAB, CONTEXT, STEPS = 64, 8, 3


def _model(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(kind, VOCAB))


LAYERS = {"gpt2": "transformer.h", "llama": "model.layers"}


def _train_and_save(rt: gk.Runtime, kind: str, folder: str) -> dict[str, Any]:
    """run_clm_no_trainer's shape: AdamW with no decay on biases and norms, built before
    setup; a few steps; then the unwrapped model's save_pretrained on every rank."""
    model = _model(kind)
    no_decay = ("bias", "norm", "ln_")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)]},
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    model, optimizer = rt.setup(model, optimizer)
    tied = [model.lm_head.weight is model.get_input_embeddings().weight]
    before = rt.full_state_dict()
    g = torch.Generator().manual_seed(rt.rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (4, CONTEXT), generator=g)
        loss = model(input_ids=x, labels=x).loss
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(float(loss))
    tied.append(model.lm_head.weight is model.get_input_embeddings().weight)
    rt.unwrap(model).save_pretrained(folder, is_main_process=rt.is_global_zero)
    rt.unwrap(model).save_pretrained(Path(folder) / "split", max_shard_size="20KB")
    refused = ""
    try:
        model.save_pretrained(Path(folder) / "refused", state_dict=model.state_dict())
    except ConfigError as err:
        refused = str(err)
    return {
        "groups": [g.name for g in rt.strategy.plans[0].groups],
        "note": rt.strategy.plans[0].note,
        "tied": tied,
        "losses": losses,
        "before": before,
        "after": rt.full_state_dict(),
        "refused": refused,
    }


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=0)
    return request.param, folder, rt.launch(_train_and_save, request.param, str(folder))


@pytest.mark.processes
def test_the_decoder_layers_are_the_groups_and_the_model_trains(run: Any) -> None:
    kind, _, got = run
    layers = LAYERS[kind]
    assert got["groups"] == [f"{layers}.0", f"{layers}.1", f"{layers}.2", "(root: the rest)"]
    block = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}[kind]
    assert got["note"] == f"groups: the blocks the model names in _no_split_modules ({block})"
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    changed = [k for k, v in got["before"].items() if not torch.equal(v, got["after"][k])]
    assert len(changed) == len(got["after"])  # AdamW moved every weight


@pytest.mark.processes
def test_the_tied_head_stays_tied_after_setup_and_after_steps(run: Any) -> None:
    _, _, got = run
    assert got["tied"] == [True, True]
    assert torch.equal(got["after"]["lm_head.weight"], got["after"][_embedding(run[0])])


def _embedding(kind: str) -> str:
    return "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"


@pytest.mark.processes
def test_save_pretrained_after_fsdp_loads_back_equal_to_the_full_state_dict(run: Any) -> None:
    from transformers import AutoModelForCausalLM

    kind, folder, got = run
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    # The tied head is written once, under the embedding's name, as transformers does.
    assert "lm_head.weight" not in written and _embedding(kind) in written
    for where in (folder, folder / "split"):
        back = AutoModelForCausalLM.from_pretrained(where)
        assert back.lm_head.weight is back.get_input_embeddings().weight
        state = back.state_dict()
        assert state.keys() == got["after"].keys()
        unequal = [k for k, v in got["after"].items() if not torch.equal(v, state[k])]
        assert not unequal, unequal
    index = json.loads((folder / "split" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # max_shard_size split it into files


def _fine_tune_start(rt: gk.Runtime, kind: str, folder: str) -> dict[str, Any]:
    """A fine-tuning script's start: the model built on the meta device from its config,
    sharded, then the pretrained files loaded straight into each rank's shards."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_model(kind).config)
    model = rt.setup(model)
    loaded = rt.load_weights(folder)
    model.eval()
    x = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=x).logits.detach()
    return {"loaded": loaded, "full": rt.full_state_dict(), "logits": logits, "x": x}


@pytest.mark.processes
def test_pretrained_files_load_into_a_meta_model_s_shards(run: Any) -> None:
    from transformers import AutoModelForCausalLM

    kind, folder, got = run
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=1)
    try:
        start = rt.launch(_fine_tune_start, kind, str(folder / "split"))
    finally:
        rt.teardown()
    assert start["loaded"]["missing"] == [] and start["loaded"]["unexpected"] == []
    assert start["loaded"]["files"] > 1  # the index's files
    unequal = [k for k, v in got["after"].items() if not torch.equal(v, start["full"][k])]
    assert not unequal, unequal
    back = AutoModelForCausalLM.from_pretrained(folder / "split").eval()
    assert torch.equal(start["logits"], back(input_ids=start["x"]).logits.detach())


@pytest.mark.processes
def test_save_pretrained_refuses_a_sharded_state_dict(run: Any) -> None:
    assert "got sharded tensors (DTensors" in run[2]["refused"]
    assert "rt.full_state_dict()" in run[2]["refused"]


def _save_on_rank_zero_only(rt: gk.Runtime, folder: str) -> None:
    model = rt.setup(_model("gpt2"))
    if rt.is_global_zero:  # the habit that would hang a gathering save
        rt.unwrap(model).save_pretrained(folder)
    else:
        rt.barrier()  # rank 1 goes on to its next collective


@pytest.mark.processes
def test_save_pretrained_on_rank_zero_only_fails_naming_the_other_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_COLLECTIVE_CHECK_TIMEOUT", "2")
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=0)
    with pytest.raises(gk.DistributedError) as err:
        rt.launch(_save_on_rank_zero_only, str(tmp_path / "hf"))
    assert "save_pretrained is collective" in str(err.value)
    assert "rank(s) 1 did not call it within 2 s" in str(err.value)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


# -- in this process ------------------------------------------------------------------------------
def test_the_blocks_a_model_names_in_no_split_modules_are_its_groups() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class EncoderDecoder(nn.Module):
        _no_split_modules = ("Block",)

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.encoder = nn.ModuleList(Block() for _ in range(2))
            self.decoder = nn.ModuleList([Block(), *(nn.Linear(4, 4) for _ in range(3))])

    names = [g.names for g in find_groups(EncoderDecoder())]
    assert names == [["encoder.0"], ["encoder.1"], ["decoder.0"]]


def test_hf_llama_and_gpt2_groups_are_their_decoder_layers() -> None:
    for kind, layers in LAYERS.items():
        names = [g.names for g in find_groups(_model(kind))]
        assert names == [[f"{layers}.{i}"] for i in range(3)]


def test_a_model_output_is_walked_as_its_own_type_with_its_attributes() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from gpukit._util.tree import map_tensors

    out = CausalLMOutputWithPast(loss=torch.ones(1), logits=torch.zeros(2))
    mapped = map_tensors(out, lambda t: t + 1)  # ModelOutput refuses update(): refilled by key
    assert type(mapped) is CausalLMOutputWithPast and list(mapped.keys()) == ["loss", "logits"]
    assert torch.equal(mapped.loss, mapped["loss"]) and torch.equal(
        mapped.loss, torch.full((1,), 2.0)
    )
    assert torch.equal(mapped.logits, torch.ones(2)) and torch.equal(out.loss, torch.ones(1))


def test_a_transformers_model_trains_under_bf16_mixed_precision() -> None:
    rt = gk.Runtime(devices="cpu", precision="bf16-mixed", seed=0)
    model = rt.setup(_model("gpt2"))
    x = torch.randint(0, VOCAB, (2, CONTEXT))
    out = model(input_ids=x, labels=x)
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    rt.backward(out.loss)
    rt.teardown()
