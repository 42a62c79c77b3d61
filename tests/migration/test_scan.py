"""The scan behind ``gpukit check``: which calls it finds in a script's source, which object
is the Accelerator or the Fabric, and which behaviours it says will differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukit.errors import ConfigError
from gpukit.migration import scan_file, scan_source
from gpukit.migration.behaviours import BEHAVIOURS
from gpukit.migration.table import TABLE


def calls(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.call) for f in scan_source(source).findings]


def differs(source: str) -> list[str]:
    keys = {b.text: (b.library, b.key) for b in BEHAVIOURS}
    return [f"{keys[t][0]}:{keys[t][1]}" for t in scan_source(source).behaviours]


ACCELERATE = """\
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

accelerator = Accelerator(mixed_precision="bf16")
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.AdamW(model.parameters())
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
for epoch in range(2):
    for x in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
if accelerator.is_main_process:
    accelerator.print(accelerator.gather(x))
"""


def test_accelerate_calls_each_with_gpukits_spelling() -> None:
    found = scan_source(ACCELERATE).findings
    assert [(f.line, f.call) for f in found] == [
        (5, "accelerator = Accelerator(...)"),
        (5, 'Accelerator(mixed_precision="bf16")'),
        (10, "accelerator.prepare(model, optimizer, loader, scheduler)"),
        (13, "with accelerator.accumulate(model):"),
        (14, "accelerator.backward(loss)"),
        (15, "optimizer.step()"),
        (17, "optimizer.zero_grad()"),
        (18, "accelerator.is_main_process"),
        (19, "accelerator.print(...)"),
        (19, "accelerator.gather(x)"),
    ]
    assert found[3].written == "accelerator.accumulate(model)"
    assert found[2].gpukit == "`rt.setup(model, optimizer, loader, scheduler)`"


def test_accelerate_behaviours_that_apply_to_this_script_only() -> None:
    assert differs(ACCELERATE) == [
        "accelerate:shuffle",
        "accelerate:scheduler-per-batch",
        "accelerate:gather",
    ]
    per_epoch = ACCELERATE.replace("            scheduler.step()\n", "").replace(
        "if accelerator", "    scheduler.step()\nif accelerator"
    )
    assert "accelerate:scheduler-per-epoch" in differs(per_epoch)
    assert "accelerate:scheduler-per-batch" not in differs(per_epoch)
    unshuffled = ACCELERATE.replace("shuffle=True", "shuffle=False")
    assert "accelerate:shuffle" not in differs(unshuffled)


def test_the_accelerator_held_as_an_attribute_or_a_typed_parameter() -> None:
    source = """\
import accelerate

class Trainer:
    def __init__(self):
        self.acc = accelerate.Accelerator()

    def step(self, loss):
        self.acc.backward(loss)
        self.acc.wait_for_everyone()

def evaluate(acc: accelerate.Accelerator, x):
    return acc.gather_for_metrics(x), acc.device
"""
    assert calls(source) == [
        (5, "accelerator = Accelerator(...)"),
        (8, "accelerator.backward(loss)"),
        (9, "accelerator.wait_for_everyone()"),
        (12, "accelerator.gather_for_metrics(x)"),
        (12, "accelerator.device"),
    ]


def test_a_parameter_named_as_the_library_names_its_object() -> None:
    source = """\
import accelerate

def train(accelerator, model):
    accelerator.backward(model.loss)

def unrelated(fabric):
    fabric.backward(1)
"""
    assert calls(source) == [(4, "accelerator.backward(loss)")]
    assert calls(source.replace("import accelerate", "import os")) == []


def test_an_unknown_method_is_listed_with_where_to_look() -> None:
    source = "from accelerate import Accelerator\na = Accelerator(odd_option=1)\na.odd(1)\n"
    found = scan_source(source).findings
    assert [(f.written, f.call, f.gpukit) for f in found[1:]] == [
        ("odd_option=1", "Accelerator(odd_option=...)", "not in gpukit's table"),
        ("a.odd(1)", "accelerator.odd(...)", "not in gpukit's table"),
    ]


FABRIC = """\
import lightning as L
from torch.utils.data import DataLoader

fabric = L.Fabric(accelerator="cpu", devices=2)
fabric.launch()
fabric.seed_everything(0)
loader = fabric.setup_dataloaders(DataLoader(range(8), shuffle=True))
for x in loader:
    with fabric.no_backward_sync(model, enabled=True):
        fabric.backward(x.sum() / 2)
    fabric.log_dict({"loss": 1.0}, step=0)
fabric.save("x.pt", {"model": model})
"""


def test_fabric_calls_and_behaviours() -> None:
    assert [c for _, c in calls(FABRIC)] == [
        "fabric = Fabric(...)",
        'Fabric(accelerator="cpu")',
        "Fabric(devices=N)",
        "fabric.launch(fn)",
        "fabric.seed_everything(seed)",
        "fabric.setup_dataloaders(loader1, loader2)",
        "with fabric.no_backward_sync(model, enabled=...):",
        "fabric.backward(loss)",
        "fabric.log_dict(values, step=N)",
        "fabric.save(path, state)",
    ]
    assert differs(FABRIC) == [
        "fabric:shuffle",
        "fabric:accumulate",
        "fabric:launch",
        "fabric:save",
    ]


def test_fabric_under_its_other_import_names() -> None:
    for line in ("from lightning.fabric import Fabric", "from lightning_fabric import Fabric"):
        assert calls(f"{line}\nf = Fabric()\nf.barrier()\n")[-1] == (3, "fabric.barrier()")


DDP = """\
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

def worker(rank):
    dist.init_process_group("gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    model = DDP(torch.nn.Linear(2, 2))
    sampler = DistributedSampler(range(8))
    sampler.set_epoch(0)
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), "m.pt")

mp.spawn(worker, nprocs=2)
"""


def test_plain_ddp_and_spawn_by_their_import_names() -> None:
    assert [c for _, c in calls(DDP)] == [
        'dist.init_process_group("nccl")',
        'int(os.environ["LOCAL_RANK"])',
        "DistributedDataParallel(model, device_ids=[i])",
        "DistributedSampler(dataset)",
        "sampler.set_epoch(epoch)",
        "dist.all_reduce(t)",
        "dist.get_rank()",
        "torch.save(state, path)",
        "mp.spawn(fn, args=(...), nprocs=N)",
    ]
    assert differs(DDP) == ["ddp:sampler", "ddp:all_reduce", "ddp:rank0-save", "ddp:spawn"]


def test_names_that_only_look_like_the_libraries_are_not_calls() -> None:
    source = """\
def barrier():
    pass

class Accelerator:
    def backward(self, loss):
        pass

barrier()
a = Accelerator()
a.backward(1)
os.environ["HOME"]
"""
    assert calls(source) == []


def test_a_plain_loop_gets_its_rows_and_no_behaviours() -> None:
    source = """\
import torch
from torch.utils.data import DataLoader
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in DataLoader(range(4), shuffle=True):
    model(x).sum().backward()
    opt.step()
"""
    assert [c for _, c in calls(source)] == ["loss.backward()", "optimizer.step()"]
    assert scan_source(source).behaviours == ()


def test_a_script_with_none_of_the_calls() -> None:
    found = scan_source("print('hello')\n")
    assert found.findings == () and found.behaviours == () and found.libraries == []


def test_the_script_is_read_not_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("open('ran', 'w').close()\nraise SystemExit(3)\n")
    scan_file(script)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("missing.py", None, "'{path}' is no such file"),
        ("folder", "folder", "'{path}' is a folder"),
        ("broken.py", "x = 1\nfor\n", "{path}:2: not valid Python (invalid syntax)"),
        ("model.bin", b"\x80\x81\x00", "{path} is not Python source: byte 0 is not UTF-8"),
        ("nul.py", b"x = 1\x00\n", "{path}"),
    ],
)
def test_a_file_that_is_not_a_python_script_is_a_config_error(
    tmp_path: Path, name: str, content: str | bytes | None, said: str
) -> None:
    path = tmp_path / name
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        scan_file(path)
    assert said.format(path=path) in str(err.value)


def test_every_row_is_found_by_one_key() -> None:
    keys = [(r.library, r.kind, r.name) for r in TABLE]
    assert len(keys) == len(set(keys))
    assert all(r.call and r.gpukit for r in TABLE)
    assert len({(b.library, b.key) for b in BEHAVIOURS}) == len(BEHAVIOURS)


def test_accelerates_batch_dealing_keywords_have_gpukits_spelling() -> None:
    source = """\
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

old = Accelerator(split_batches=True, even_batches=False)
new = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
"""
    found = scan_source(source).findings
    assert [(f.line, f.written, f.gpukit) for f in found if not f.call.endswith("(...)")] == [
        (4, "split_batches=True", '`gk.Runtime(data_order="accelerate", split_batches=True)`'),
        (4, "even_batches=False", '`gk.Runtime(data_order="accelerate", even_batches=False)`'),
        (
            5,
            "dataloader_config=DataLoaderConfiguration(split_batches=True)",
            '`gk.Runtime(data_order="accelerate", split_batches=..., even_batches=...)`',
        ),
    ]


def test_a_fabric_methods_keyword_that_changes_what_it_does_is_listed() -> None:
    source = """\
from lightning.fabric import Fabric

fabric = Fabric()
loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
fabric.load("run.pt", state, strict=False)
fabric.load("run.pt", state, strict=True)
"""
    found = scan_source(source).findings
    assert [(f.line, f.written) for f in found] == [
        (3, "Fabric()"),
        (4, "fabric.setup_dataloaders(loader, use_distributed_sampler=False)"),
        (4, "use_distributed_sampler=False"),
        (5, 'fabric.load("run.pt", state, strict=False)'),
        (5, "strict=False"),
        (6, 'fabric.load("run.pt", state, strict=True)'),  # on, as by default: nothing to say
    ]
    assert "each rank iterates the whole data set" in found[2].note
    assert found[4].note.startswith("always strict")
