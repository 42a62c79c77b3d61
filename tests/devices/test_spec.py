"""The device-spec parser: every spelling, and nothing but SpecError for bad ones."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpukit.devices.spec import AUTO, Spec, SpecError, parse

VALID = [
    (None, AUTO),
    ("auto", AUTO),
    ("AUTO", AUTO),
    ("cpu", Spec("cpu")),
    ("CPU", Spec("cpu")),
    ("cpu:0", Spec("cpu", 0)),
    ("/cpu:0", Spec("cpu", 0)),
    ("/device:CPU:0", Spec("cpu", 0)),
    ("/job:localhost/replica:0/task:0/device:CPU:0", Spec("cpu", 0)),
    ("gpu", Spec("cuda")),
    ("gpu:1", Spec("cuda", 1)),
    ("GPU:1", Spec("cuda", 1)),
    ("cuda", Spec("cuda")),
    ("cuda:3", Spec("cuda", 3)),
    ("CUDA:3", Spec("cuda", 3)),
    ("/gpu:1", Spec("cuda", 1)),
    ("/GPU:1", Spec("cuda", 1)),
    ("/device:GPU:1", Spec("cuda", 1)),
    ("/device:gpu:2", Spec("cuda", 2)),
    ("/job:localhost/replica:0/task:0/device:GPU:1", Spec("cuda", 1)),
    ("/job:localhost/device:GPU:0", Spec("cuda", 0)),
    ("/replica:0/task:0/device:GPU:0", Spec("cuda", 0)),
    ("  cuda:1  ", Spec("cuda", 1)),
    ("mps", Spec("mps")),
    ("mps:0", Spec("mps", 0)),
    ("2", Spec("cuda", 2)),
    (0, Spec("cuda", 0)),
    (5, Spec("cuda", 5)),
    (torch.device("cpu"), Spec("cpu")),
    (torch.device("cuda", 1), Spec("cuda", 1)),
    (torch.device("cuda"), Spec("cuda")),
]

INVALID = [
    ("", "empty"),
    ("   ", "empty"),
    ("tpu:0", "TPUs are not supported"),
    ("xla", "XLA"),
    ("meta", "no data"),
    ("hip:0", "name AMD GPUs 'cuda'"),
    ("npu:0", "unknown device kind 'npu'"),
    ("cuda:", "missing"),
    ("cuda:x", "not a whole number"),
    ("cuda:1.5", "not a whole number"),
    ("cuda:-1", "negative"),
    ("-1", "negative"),
    (-2, "negative"),
    ("cuda:1:2", "not a device spelling"),
    ("cuda 1", "not a device spelling"),
    ("gpu²", "not a device spelling"),
    ("cuda:²", "not a whole number"),
    ("cpu:1", "only one cpu device"),
    ("mps:1", "only one mps device"),
    ("/job:worker/replica:0/task:0/device:GPU:0", "another TensorFlow job"),
    ("/job:localhost/replica:1/task:0/device:GPU:0", "another TensorFlow job"),
    ("/job:localhost/replica:0/task:3/device:GPU:0", "another TensorFlow job"),
    ("/device:GPU:0/extra", "not a TensorFlow device name"),
    ("//gpu:0", "not a TensorFlow device name"),
    (True, "bool"),
    (1.0, "float is not a device spec"),
    ([0], "list is not a device spec"),
    (torch.device("meta"), "no data"),
]


@pytest.mark.parametrize(("spec", "expected"), VALID, ids=repr)
def test_valid_spellings_parse(spec: object, expected: Spec) -> None:
    assert parse(spec) == expected


@pytest.mark.parametrize(("spec", "message"), INVALID, ids=repr)
def test_invalid_spellings_say_what_is_wrong(spec: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(spec)


def test_tensorflow_name_without_index_means_current_gpu() -> None:
    # tf.device("/GPU") is not valid TensorFlow, but "gpu" alone is the current GPU everywhere
    # else, so the TensorFlow form without index follows it.
    assert parse("/gpu") == Spec("cuda")


@given(st.text())
def test_any_string_parses_or_raises_spec_error(text: str) -> None:
    try:
        result = parse(text)
    except SpecError as err:
        assert err.problem and err.fix
    else:
        assert result.kind in ("auto", "cpu", "cuda", "mps")
        assert result.index is None or result.index >= 0


TF_NAME = (
    r"\s*(/job:localhost(/replica:0/task:0)?)?/(device:)?((gpu|GPU):[0-9]{1,3}|(cpu|CPU):0)\s*"
)


@given(st.from_regex(TF_NAME, fullmatch=True))
def test_tensorflow_names_always_parse(text: str) -> None:
    spec = parse(text)
    assert spec.kind in ("cpu", "cuda")
