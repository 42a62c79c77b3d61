"""rt.load_weights: safetensors files (one file, or Hugging Face's split layout with its index)
into a set-up model; under fsdp a meta-device model's shards are filled with each rank reading
only its rows. Every kind of mismatch is refused before anything changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import gpukit as gk
from gpukit.errors import ConfigError
from tests.fsdp_models import VOCAB, TiedLM, assert_bit_identical


def _source() -> dict[str, torch.Tensor]:
    """A trained-looking TiedLM's weights as Hugging Face writes them: the tied one once."""
    torch.manual_seed(11)
    weights = {k: v.clone() for k, v in TiedLM().state_dict().items()}
    del weights["head.weight"]  # tied to emb.weight
    return weights


def _split(folder: Path, weights: dict[str, torch.Tensor]) -> None:
    """``weights`` in two files and an index, as save_pretrained splits a large model."""
    names = sorted(weights)
    parts = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    weight_map = {}
    for file, part in parts.items():
        save_file({n: weights[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _load_into_meta(rt: gk.Runtime, path: str) -> dict[str, Any]:
    reads = {"whole": [], "rows": []}
    opened = safetensors.safe_open

    class Counted:  # what each rank reads from the files
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = opened(*args, **kwargs)

        def __enter__(self) -> Counted:
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def keys(self) -> Any:
            return self.handle.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            reads["whole"].append(name)
            return self.handle.get_tensor(name)

        def get_slice(self, name: str) -> Any:
            reads["rows"].append(name)
            return self.handle.get_slice(name)

    safetensors.safe_open = Counted  # type: ignore[misc,assignment]
    with torch.device("meta"):
        model = TiedLM()
    model = rt.setup(model)
    got = rt.load_weights(path)
    user = rt.unwrap(model)
    return {
        "got": got,
        "full": rt.full_state_dict(),
        "tied": user.head.weight is user.emb.weight,
        "whole": reads["whole"],
    }


@pytest.mark.processes
@pytest.mark.parametrize("layout", ["one file", "split with an index"])
def test_a_meta_model_on_two_ranks_is_filled_from_the_files_row_by_row(
    tmp_path: Path, layout: str
) -> None:
    weights = _source()
    if layout == "one file":
        save_file(weights, str(tmp_path / "model.safetensors"))
    else:
        _split(tmp_path, weights)
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=0)
    try:
        run = rt.launch(_load_into_meta, str(tmp_path))
    finally:
        rt.teardown()
    assert run["got"] == {
        "loaded": 13,
        "files": 1 if layout == "one file" else 2,
        "missing": [],
        "unexpected": [],
    }
    assert run["tied"]
    want = {**weights, "head.weight": weights["emb.weight"]}
    assert_bit_identical(run["full"], want)
    # Every weight is sharded by rows (the tied embedding's 67 rows unevenly): rank 0 never
    # read a whole tensor from the files, only its rows.
    assert run["whole"] == []
    assert VOCAB % 2 == 1


@pytest.fixture
def one_rank() -> Any:
    made: list[gk.Runtime] = []

    def start(strategy: str = "single") -> tuple[gk.Runtime, torch.nn.Module]:
        rt = gk.Runtime(strategy=strategy, devices=["cpu"], seed=0)
        made.append(rt)
        return rt, rt.setup(TiedLM())

    yield start
    for rt in made:
        rt.teardown()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_an_exported_checkpoint_loads_back_into_a_fresh_model(
    tmp_path: Path, one_rank: Any
) -> None:
    rt, model = one_rank()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # not what a fresh model starts from
    rt.save(str(tmp_path))
    saved = rt.full_state_dict()
    other, fresh = one_rank()
    assert not torch.equal(fresh.emb.weight, model.emb.weight)
    folder = next(tmp_path.glob("step-*"))
    assert other.load_weights(folder)["loaded"] == 13
    assert_bit_identical(other.full_state_dict(), saved)


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert_bit_identical({k: v.clone() for k, v in model.state_dict().items()}, before)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda w: w.pop("blocks.0.0.bias"), r"1 \('blocks.0.0.bias'\) missing, none unexpected"),
        (lambda w: w.update(extra=torch.ones(1)), r"none missing, 1 \('extra'\) unexpected"),
        (
            lambda w: w.update({"blocks.0.0.bias": torch.ones(3)}),
            r"'blocks.0.0.bias' is \[3\] in model.safetensors but \[32\] in the model",
        ),
    ],
)
def test_a_mismatch_is_refused_and_changes_nothing(
    tmp_path: Path, one_rank: Any, change: Any, said: str
) -> None:
    weights = _source()
    change(weights)
    save_file(weights, str(tmp_path / "model.safetensors"))
    rt, model = one_rank()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=said):
        rt.load_weights(tmp_path)
    _unchanged(model, before)


def test_strict_false_loads_what_both_have_and_says_what_was_left(
    tmp_path: Path, one_rank: Any
) -> None:
    weights = _source()
    weights.pop("blocks.0.0.bias")
    weights["extra"] = torch.ones(1)
    save_file(weights, str(tmp_path / "model.safetensors"))
    rt, model = one_rank()
    kept = model.blocks[0][0].bias.clone()
    got = rt.load_weights(tmp_path / "model.safetensors", strict=False)
    left = {"missing": ["blocks.0.0.bias"], "unexpected": ["extra"]}
    assert got == {"loaded": 12, "files": 1, **left}
    assert torch.equal(model.emb.weight, weights["emb.weight"])
    assert torch.equal(model.blocks[0][0].bias, kept)


def test_paths_that_hold_no_weights_are_refused(tmp_path: Path, one_rank: Any) -> None:
    rt, _ = one_rank()
    with pytest.raises(ConfigError, match="does not exist"):
        rt.load_weights(tmp_path / "nothing")
    with pytest.raises(ConfigError, match=r"holds no \.safetensors file"):
        rt.load_weights(tmp_path)
    save_file({"a": torch.ones(1)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(ConfigError, match=r"'a' is in both x\.safetensors and y\.safetensors"):
        rt.load_weights(tmp_path)


def test_without_a_model_it_needs_exactly_one(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    rt.setup(torch.nn.Linear(2, 2))
    rt.setup(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="needs exactly one model set up, and setup saw 2"):
        rt.load_weights(tmp_path)


def _truncated(folder: Path) -> Path:
    save_file(_source(), str(folder / "whole.safetensors"))
    data = (folder / "whole.safetensors").read_bytes()
    (folder / "whole.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder / "model.safetensors"


def _shard_missing(folder: Path) -> Path:
    _split(folder, _source())
    (folder / "model-00002-of-00002.safetensors").unlink()
    return folder


def _index_not_json(folder: Path) -> Path:
    _split(folder, _source())
    (folder / "model.safetensors.index.json").write_text("{not json")
    return folder / "model.safetensors.index.json"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        pytest.param(
            lambda f: (f / "model.safetensors").write_text("a text file") and f,
            r"model\.safetensors' is not a readable safetensors file \(.*header.*\): it is "
            "another format, or was cut short",
            id="not-safetensors",
        ),
        pytest.param(
            _truncated, r"model\.safetensors' is not a readable safetensors file", id="truncated"
        ),
        pytest.param(
            _shard_missing,
            r"index '.*model\.safetensors\.index\.json' names 1 \('model-00002-of-00002"
            r"\.safetensors'\) file\(s\) not in",
            id="index-names-a-missing-shard",
        ),
        pytest.param(
            _index_not_json,
            r"index\.json' is not a safetensors index \(JSONDecodeError",
            id="index-not-json",
        ),
    ],
)
def test_files_that_are_not_whole_safetensors_are_named_in_one_error(
    tmp_path: Path, one_rank: Any, make: Any, said: str
) -> None:
    path = make(tmp_path)
    rt, model = one_rank()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=said):
        rt.load_weights(path)
    _unchanged(model, before)


def test_the_index_file_itself_is_read_as_its_folder(tmp_path: Path, one_rank: Any) -> None:
    _split(tmp_path, _source())
    rt, _ = one_rank()
    assert rt.load_weights(tmp_path / "model.safetensors.index.json")["files"] == 2
