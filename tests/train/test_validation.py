"""gpukit train's validation pass: held-out sets, exact metrics over ranks, and a training
that goes on as if there were none."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gpukit as gk
from gpukit.train.loop import TrainConfig, fit
from gpukit.train.validation import evaluate
from gpukit.workloads import Workload, cnn, gpt, load_workload


def test_the_training_sets_are_the_ones_drawn_before_validation_sets_existed() -> None:
    # The draws of the training sets, as they were: same generator, same order.
    gen = torch.Generator().manual_seed(20240601)
    centres = torch.randn(4, 32, generator=gen) * 0.45
    labels = torch.randint(0, 4, (2048,), generator=gen)
    points = centres[labels] + torch.randn(2048, 32, generator=gen)
    x, y = load_workload("mlp").dataset.tensors  # type: ignore[attr-defined]
    assert torch.equal(x, points) and torch.equal(y, labels)
    gen = torch.Generator().manual_seed(20240602)
    torch.randn(10, 3, 4, 4, generator=gen)  # the patterns' draw comes first
    assert torch.equal(cnn.make_dataset(8).tensors[1], torch.randint(0, 10, (8,), generator=gen))
    text = gpt.corpus()
    data = load_workload("gpt").dataset
    assert len(data) == len(gpt.CharDataset(text, 64)) and gpt.corpus("heldout") not in text


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_validation_sets_are_held_out_and_the_same_for_every_seed(name: str) -> None:
    a, b = load_workload(name, seed=0), load_workload(name, seed=7)
    assert a.accuracy
    va, vb = a.validation.tensors, b.validation.tensors  # type: ignore[union-attr]
    assert all(torch.equal(p, q) for p, q in zip(va, vb, strict=True))
    train = {tuple(row.flatten()[:8].tolist()) for row in a.dataset.tensors[0]}  # type: ignore[attr-defined]
    assert not any(tuple(row.flatten()[:8].tolist()) in train for row in va[0])


def test_gpt_validates_on_bundled_text_it_never_trains_on() -> None:
    w = load_workload("gpt")
    assert not w.accuracy and w.validation is not None
    held = w.validation
    assert held.vocab == w.dataset.vocab  # type: ignore[attr-defined]
    x, y = held[0]
    assert torch.equal(x[1:], y[:-1]) and held.stride == held.context  # type: ignore[attr-defined]


def _rows(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def _reference(data: TensorDataset) -> tuple[float, float]:
    """Loss and accuracy of the same weights over the whole set in one batch, in float64."""
    model = _model().double().eval()
    x, y = data.tensors
    with torch.no_grad():
        out = model(x.double())
    return float(F.cross_entropy(out, y)), float((out.argmax(-1) == y).double().mean())


def _evaluate_on_ranks(rt: gk.Runtime, size: int, batch: int) -> dict[str, Any]:
    model = rt.setup(_model())
    criterion = rt.setup_criterion(F.cross_entropy)
    frozen = rt.unwrap(model)[1]
    frozen.eval()  # a module the program keeps in eval mode stays so
    data, rng = _rows(size), torch.random.get_rng_state()
    result = evaluate(rt, model, criterion, data, batch, accuracy=True)
    modes = [m.training for m in rt.unwrap(model).modules()]
    return {**result, "modes": modes, "rng": torch.equal(rng, torch.random.get_rng_state())}


@pytest.mark.parametrize(("size", "batch"), [(101, 8), (7, 4), (1, 4)])
def test_one_process_evaluation_is_the_mean_over_the_samples(size: int, batch: int) -> None:
    out = _evaluate_on_ranks(gk.Runtime(devices="cpu"), size, batch)
    loss, accuracy = _reference(_rows(size))
    assert out["val_loss"] == pytest.approx(loss, rel=1e-6)
    assert out["val_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert out["modes"] == [True, True, False, True, True]  # each module's own mode back
    assert out["rng"]  # no random number was drawn


@pytest.mark.processes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_count_every_sample_of_an_odd_set_once(strategy: str) -> None:
    # 101 samples: rank 0 evaluates 51, rank 1 50, in as many forwards (7 of at most 8), and
    # no sample is counted twice; 1 sample: rank 1 runs a forward it does not count.
    for size in (101, 1):
        rt = gk.Runtime(strategy=strategy, devices=["cpu", "cpu"], seed=0)
        out = rt.launch(_evaluate_on_ranks, size, 8)
        loss, accuracy = _reference(_rows(size))
        assert out["val_loss"] == pytest.approx(loss, rel=1e-6), size
        assert out["val_accuracy"] == pytest.approx(accuracy, abs=1e-12), size
        assert out["rng"] and out["modes"] == [True, True, False, True, True]


# A workload with dropout (random draws every step) and batch norm (buffers), 4 steps an
# epoch: a validation pass that moved a random stream or a buffer would change the weights.
def noisy_workload(seed: int) -> Workload:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(85, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    train, held = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(16, 3),
    )
    loss = torch.nn.CrossEntropyLoss()
    return Workload("noisy", model, train, loss, 16, 0.01, 3, 0.0, None, held, True)


def _final_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "checkpoints" / "step-00000012" / "model.safetensors"))


def test_validation_leaves_training_as_it_was_and_resume_exact(tmp_path: Path) -> None:
    workload = "tests.train.test_validation:noisy_workload"
    runs = {}
    for name, validate in (("plain", False), ("checked", True)):
        config = TrainConfig(workload=workload, out=str(tmp_path / name), validate=validate)
        runs[name] = gk.Runtime(devices="cpu", seed=0, log_every=2).launch(fit, config)
    # Stopped at step 6 (mid-epoch: a validation pass there too), then resumed.
    part = TrainConfig(workload=workload, out=str(tmp_path / "resumed"), max_steps=6)
    gk.Runtime(devices="cpu", seed=0, log_every=2).launch(fit, part)
    rest = TrainConfig(workload=workload, out=str(tmp_path / "resumed"), resume=True)
    resumed = gk.Runtime(devices="cpu", seed=0, log_every=2).launch(fit, rest)
    plain = _final_state(tmp_path / "plain")
    for name in ("checked", "resumed"):
        state = _final_state(tmp_path / name)
        assert all(torch.equal(state[k], v) for k, v in plain.items()), name  # bit for bit
    assert runs["plain"]["final_loss"] == runs["checked"]["final_loss"] == resumed["final_loss"]
    assert runs["plain"]["validation"] == [] and runs["plain"]["final_val_loss"] is None
    checked = runs["checked"]["validation"]
    assert [(v["step"], v["epoch"]) for v in checked] == [(4, 1), (8, 2), (12, 3)]
    assert [v["step"] for v in resumed["validation"]] == [4, 6, 8, 12]
    assert resumed["validation"][-1] == checked[-1]  # the same model, the same numbers


def test_a_validation_pass_reads_back_once(capsys: pytest.CaptureFixture[str]) -> None:
    rt = gk.Runtime(devices="cpu", seed=0, log_every=8)
    with gk.trace() as t:
        fit(rt, TrainConfig(workload="mlp", epochs=2, progress=False, sample=False))
    reads = collections.Counter()
    for s in t.syncs:
        reads[Path(s.file).name] += s.count
    assert reads["validation.py"] == 2  # one per pass: the end of each epoch


def test_lr_epoch_and_elapsed_are_recorded_and_elapsed_continues_on_resume(
    tmp_path: Path,
) -> None:
    import csv

    config = TrainConfig(workload="mlp", max_steps=8, out=str(tmp_path), progress=False)
    gk.Runtime(devices="cpu", seed=0, log_every=4).launch(fit, config)
    first = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    more = TrainConfig(workload="mlp", max_steps=40, out=str(tmp_path), resume=True)
    gk.Runtime(devices="cpu", seed=0, log_every=4).launch(fit, more)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert rows[: len(first)] == first
    assert [int(r["epoch"]) for r in rows if r["loss"]] == [1] * 8 + [2, 2]
    elapsed = [float(r["elapsed"]) for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[len(first)] > elapsed[len(first) - 1]
    assert {r["lr"] for r in rows} == {"0.003"}
