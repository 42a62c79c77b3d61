"""Out-of-memory messages read into numbers, and remedies ranked by them (gpukit.diagnostics.oom).

The messages are verbatim from real runs of torch (current and pre-2.1 CUDA formats, the CPU
allocator's and MPS's); expected byte counts are written out independently of the parser.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpukit.diagnostics.oom import explain
from gpukit.diagnostics.oom_message import OomNumbers, is_oom, parse
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.launch.faults import injected_oom

KiB, MiB, GiB = 2**10, 2**20, 2**30
TORCH_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

HINT = (
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True to avoid fragmentation.  See documentation for Memory Management "
    " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
CURRENT_PROCS = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 12.75 MiB is free. Process 2274 has 4.21 GiB memory in use. Process 97551 has "
    "74.90 GiB memory in use. Of the allocated memory 73.91 GiB is allocated by PyTorch, and "
    "481.31 MiB is reserved by PyTorch but unallocated." + HINT
)
CURRENT_THIS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 22.61 GiB memory "
    "in use. Of the allocated memory 21.89 GiB is allocated by PyTorch, and 268.03 MiB is "
    "reserved by PyTorch but unallocated." + HINT
)
OLD = (
    "CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 10.76 GiB total capacity; 9.12 GiB "
    "already allocated; 51.69 MiB free; 9.45 GiB reserved in total by PyTorch) If reserved "
    "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See "
    "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
OLD_BARE = (
    "CUDA out of memory. Tried to allocate 1.53 GiB (GPU 0; 14.76 GiB total capacity; 12.06 GiB "
    "already allocated; 1.07 GiB free; 12.71 GiB reserved in total by PyTorch)"
)
CPU = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
    "you tried to allocate 1099511627776 bytes."
)
MPS = (
    "MPS backend out of memory (MPS allocated: 17.89 GB, other allocations: 2.37 GB, max "
    "allowed: 20.40 GB). Tried to allocate 256.00 MB on private pool."
)
TRACE = (
    "\nException raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1234 (most "
    "recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 "
    "(0x7f2b5c5a3617 in /usr/lib/python3/site-packages/torch/lib/libc10.so)\nframe #1: "
    "<unknown function> + 0x3a8c1 (0x7f2b5c62b8c1 in libc10_cuda.so)\n"
)


def current(requested: str, total: str, free: str, allocated: str, unused: str) -> str:
    """A message in the current format with chosen numbers (the wording is torch's)."""
    return (
        f"CUDA out of memory. Tried to allocate {requested}. GPU 0 has a total capacity of "
        f"{total} of which {free} is free. Of the allocated memory {allocated} is allocated by "
        f"PyTorch, and {unused} is reserved by PyTorch but unallocated." + HINT
    )


# --- parse: every format, exact bytes ----------------------------------------------------------


def test_current_format_with_process_lines() -> None:
    n = parse(CURRENT_PROCS)
    assert n == OomNumbers(
        device="cuda:0",
        requested=20 * MiB,
        total=round(79.15 * GiB),
        free=round(12.75 * MiB),
        allocated=round(73.91 * GiB),
        reserved_unallocated=round(481.31 * MiB),
        this_process=None,
        # Neither pid is named as this process; 97551 holds PyTorch's 74.4 GiB, so it is us.
        other_processes=round(4.21 * GiB),
        processes=((2274, round(4.21 * GiB)), (97551, round(74.90 * GiB))),
        format="current",
    )


def test_current_format_naming_this_process() -> None:
    n = parse(CURRENT_THIS)
    assert n is not None
    assert (n.requested, n.total, n.free) == (2 * GiB, round(23.65 * GiB), round(1.02 * GiB))
    assert n.allocated == round(21.89 * GiB)
    assert n.reserved_unallocated == round(268.03 * MiB)
    assert n.this_process == round(22.61 * GiB)
    assert n.processes == ()
    assert n.other_processes == n.total - n.free - n.this_process  # type: ignore[operator]


def test_this_process_named_beside_other_processes() -> None:
    text = CURRENT_THIS.replace(
        "is free. ",
        "is free. Process 7 has 300.00 MiB memory in use. Process 8 has 1.00 GiB memory in use. ",
    )
    n = parse(text)
    assert n is not None and n.other_processes == 300 * MiB + GiB
    assert n.processes == ((7, 300 * MiB), (8, GiB))


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "torch.OutOfMemoryError: ",
        "RuntimeError: ",
        "Caught OutOfMemoryError in "
        "replica 0 on device 0.\nOriginal Traceback (most recent call last):\n  File "
        '"x.py", line 1, in f\ntorch.OutOfMemoryError: ',
    ],
)
def test_prefix_and_cpp_trace_are_ignored(prefix: str) -> None:
    assert parse(prefix + CURRENT_PROCS + TRACE) == parse(CURRENT_PROCS)


def test_pre_2_1_format() -> None:
    n = parse(OLD)
    assert n == OomNumbers(
        device="cuda:0",
        requested=64 * MiB,
        total=round(10.76 * GiB),
        free=round(51.69 * MiB),
        allocated=round(9.12 * GiB),
        reserved_unallocated=round(9.45 * GiB) - round(9.12 * GiB),
        format="pre-2.1",
    )
    bare = parse(OLD_BARE)
    assert bare is not None and bare.format == "pre-2.1"
    assert bare.requested == round(1.53 * GiB)
    assert bare.reserved_unallocated == round(12.71 * GiB) - round(12.06 * GiB)


def test_pre_2_1_variants_old_gpu_index_allowed_and_cached() -> None:
    very_old = parse(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; 7.93 GiB total capacity; 6.49 "
        "GiB already allocated; 20.56 MiB free; 6.70 GiB reserved in total by PyTorch)" + TRACE
    )
    assert very_old is not None and very_old.device == "cuda:3"
    assert very_old.free == round(20.56 * MiB)
    allowed = parse(
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 4.00 GiB total capacity; 1.20 "
        "GiB already allocated; 2.50 GiB free; 1.50 GiB allowed; 1.30 GiB reserved in total by "
        "PyTorch)"
    )
    assert allowed is not None and allowed.reserved_unallocated == round(0.1 * GiB)
    # torch 1.0-1.3 said "cached" for memory reserved but not allocated.
    cached = parse(
        "CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; 8.57 "
        "MiB already allocated; 9.28 GiB free; 4.68 MiB cached)"
    )
    assert cached is not None and cached.reserved_unallocated == round(4.68 * MiB)


def test_small_sizes_are_written_in_bytes_and_hip_is_cuda() -> None:
    n = parse(current("512 bytes", "63.98 GiB", "0 bytes", "60.00 GiB", "1.50 KiB"))
    assert n is not None
    assert (n.requested, n.free, n.reserved_unallocated) == (512, 0, 1536)
    hip = parse(
        "HIP out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
        "63.98 GiB of which 0 bytes is free."
    )
    assert hip is not None and hip.device == "cuda:1" and hip.requested == 2 * GiB


def test_cpu_and_mps_formats() -> None:
    assert parse(CPU) == OomNumbers(device="cpu", requested=1099511627776, format="cpu")
    mps = parse(MPS)
    assert mps is not None and mps.format == "mps" and mps.device == "mps"
    # MPS writes "MB"/"GB" but divides by 1024.
    assert (mps.requested, mps.total) == (256 * MiB, round(20.40 * GiB))
    assert mps.allocated == round(17.89 * GiB)
    assert mps.this_process == round(17.89 * GiB) + round(2.37 * GiB)
    assert mps.free == mps.total - mps.this_process  # type: ignore[operator]


@pytest.mark.parametrize(
    "text", ["", "CUDA error: device-side assert triggered", "CUDA out of memory.", "Process 1"]
)
def test_parse_returns_none_without_numbers(text: str) -> None:
    assert parse(text) is None


_PIECES = [
    CURRENT_PROCS,
    CURRENT_THIS,
    OLD,
    CPU,
    MPS,
    TRACE,
    "Tried to allocate ",
    "GPU 0 has",
    "Process 12 has ",
    " memory in use. ",
    "9.99 TiB",
    "1e999 GiB",
    "(GPU 0; ",
    "MPS ",
]


@given(
    st.text()
    | st.lists(st.sampled_from(_PIECES) | st.text(max_size=12), max_size=8).map("".join)
    | st.sampled_from(_PIECES).flatmap(
        lambda s: st.integers(0, len(s)).map(lambda i: s[:i])  # messages cut short
    )
)
def test_parse_never_raises(text: str) -> None:
    n = parse(text)
    assert n is None or isinstance(n, OomNumbers)
    assert isinstance(is_oom(text), bool)


# --- is_oom ------------------------------------------------------------------------------------


def test_is_oom() -> None:
    assert is_oom(TORCH_OOM("anything"))
    assert is_oom(RuntimeError(CURRENT_PROCS + TRACE))
    assert is_oom(RuntimeError(CPU)) and is_oom(MPS) and is_oom(OLD)
    assert is_oom(OutOfMemory("explained"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError(CURRENT_PROCS))  # only torch raises these, as RuntimeErrors
    assert not is_oom("all good")
    with pytest.raises(ConfigError, match="exception or its message"):
        is_oom(42)  # type: ignore[arg-type]


# --- explain: report and ranking ---------------------------------------------------------------


def titles(text: str | BaseException, **kwargs: object) -> list[str]:
    return [r.title for r in explain(text, **kwargs).remedies]  # type: ignore[arg-type]


def test_report_reads_in_numbers() -> None:
    e = explain(TORCH_OOM(CURRENT_PROCS))
    lines = str(e).splitlines()
    assert lines[0] == "out of memory on cuda:0: asked for 20 MiB with 12.8 MiB free of 79.2 GiB"
    assert lines[1] == (
        "  PyTorch tensors 73.9 GiB, cached but unused 481.3 MiB, other processes 4.2 GiB"
    )
    assert lines[2] == "  what to try, best first:"
    assert lines[3].startswith("  1. free the GPU: other processes hold 4.2 GiB of cuda:0")
    assert e.raw == CURRENT_PROCS
    scores = [r.score for r in e.remedies]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    data = json.loads(json.dumps(e.to_dict()))
    assert data["numbers"]["requested"] == 20 * MiB and data["raw"] == CURRENT_PROCS


def test_fragmentation_first_when_much_is_cached_but_unusable() -> None:
    text = current("2.00 GiB", "39.39 GiB", "1.10 GiB", "24.00 GiB", "12.50 GiB")
    e = explain(text)
    assert e.remedies[0].title == "expandable segments"
    assert "12.5 GiB" in e.remedies[0].detail
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in e.remedies[0].detail
    newer = text.replace("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in explain(newer).remedies[0].detail


def test_little_cache_means_no_fragmentation_remedy() -> None:
    assert "expandable segments" not in titles(CURRENT_THIS)


def test_weights_and_optimizer_state_first_when_they_fill_the_gpu() -> None:
    e = explain(CURRENT_PROCS, state_bytes=60 * GiB)
    assert e.remedies[0].title == "smaller weights and optimizer state"
    assert "60 GiB of 79.2 GiB" in e.remedies[0].detail and "FSDP" in e.remedies[0].detail
    assert "smaller weights and optimizer state" not in titles(CURRENT_PROCS, state_bytes=GiB)


def test_state_that_cannot_fit_at_all_ranks_first() -> None:
    text = current("1.00 GiB", "23.65 GiB", "10.00 MiB", "23.00 GiB", "0 bytes")
    assert titles(text, state_bytes=23 * GiB)[0] == "smaller weights and optimizer state"


def test_micro_batch_halved_with_accumulation() -> None:
    e = explain(CURRENT_THIS, micro_batch=32)
    micro = next(r for r in e.remedies if r.title == "smaller micro-batch")
    assert "run 16 samples per micro-batch instead of 32" in micro.detail
    assert "Runtime(accumulate=2)" in micro.detail and "--accumulate 2" in micro.detail
    assert 'Runtime(oom="recover")' in micro.detail
    assert "accumulate=3" in str(explain(CURRENT_THIS, micro_batch=3))  # 1 sample, 3 times
    assert "smaller micro-batch" not in titles(CURRENT_THIS, micro_batch=1)
    assert "activation checkpointing and bf16" in titles(CURRENT_THIS, micro_batch=1)


def test_activations_measured_when_state_is_known() -> None:
    e = explain(CURRENT_THIS, state_bytes=4 * GiB, micro_batch=8)
    micro = next(r for r in e.remedies if r.title == "smaller micro-batch")
    assert micro.detail.startswith("activations take 17.9 GiB; run 4 samples")


def test_dp_points_to_dp_balanced() -> None:
    e = explain(CURRENT_THIS, strategy="dp", imbalance=1.8)
    dp = next(r for r in e.remedies if r.title == "balance memory over GPUs")
    assert 'strategy="dp-balanced"' in dp.detail and "1.8x" in dp.detail
    assert "dp-balanced" in str(explain(CURRENT_THIS, strategy="dp"))  # imbalance unknown
    assert "balance memory over GPUs" not in titles(CURRENT_THIS, strategy="dp", imbalance=1.1)
    assert "balance memory over GPUs" not in titles(CURRENT_THIS, strategy="ddp")


def test_dp_balanced_gets_advice_of_its_own() -> None:
    e = explain(CURRENT_THIS, strategy="dp-balanced", imbalance=1.6)
    own = next(r for r in e.remedies if r.title == "one replica per process")
    assert "master weights" in own.detail and 'strategy="ddp"' in own.detail
    assert "1.6x" in own.detail
    assert "one replica per process" not in titles(
        CURRENT_THIS, strategy="dp-balanced", imbalance=1.0
    )


def test_a_name_without_a_strategy_adds_no_advice() -> None:
    assert str(explain(CURRENT_THIS, strategy="auto")) == str(explain(CURRENT_THIS))
    assert str(explain(CURRENT_THIS, strategy="my-own")) == str(explain(CURRENT_THIS))


def test_the_runtime_passes_its_strategy_object() -> None:
    import gpukit as gk

    rt = gk.Runtime(strategy="dp", devices=["cpu", "cpu"])
    assert "balance memory over GPUs" in str(rt.out_of_memory(CURRENT_THIS))


def test_request_larger_than_the_gpu_points_at_shapes() -> None:
    text = current("400.00 GiB", "79.15 GiB", "70.00 GiB", "1.00 GiB", "0 bytes")
    assert titles(text)[0] == "check tensor shapes"


def test_cpu_and_mps_remedies() -> None:
    assert titles(CPU) == ["smaller batch", "fewer DataLoader workers", "stream the dataset"]
    assert "PYTORCH_MPS_HIGH_WATERMARK_RATIO" in str(explain(MPS))


def test_unreadable_message_gets_generic_remedies() -> None:
    e = explain(RuntimeError("CUDA out of memory."))
    assert e.numbers is None
    assert titles(e.raw) == [
        "smaller micro-batch",
        "activation checkpointing and bf16",
        "look at memory",
    ]
    assert "gk.memory()" in str(e) and "no numbers" in str(e)
    assert "no numbers in the message: ''" in str(explain(""))


def test_explain_reads_the_torch_error_behind_gpukits() -> None:
    try:
        try:
            raise TORCH_OOM(CURRENT_PROCS)
        except RuntimeError as err:
            raise OutOfMemory("explained elsewhere") from err
    except OutOfMemory as wrapped:
        assert explain(wrapped).numbers == parse(CURRENT_PROCS)


@pytest.mark.parametrize(
    ("err", "kwargs", "said"),
    [
        (42, {}, "got int 42"),
        (CURRENT_THIS, {"state_bytes": -1}, "state_bytes=-1.*>= 0"),
        (CURRENT_THIS, {"state_bytes": 1.5}, "state_bytes=1.5.*whole number"),
        (CURRENT_THIS, {"state_bytes": True}, "state_bytes=True"),
        (CURRENT_THIS, {"micro_batch": 0}, "micro_batch=0.*>= 1"),
        (CURRENT_THIS, {"imbalance": float("nan")}, "imbalance=nan.*>= 1"),
        (CURRENT_THIS, {"imbalance": 0.5}, "imbalance=0.5"),
        (CURRENT_THIS, {"strategy": 3}, "strategy=3.*strategy name"),
    ],
)
def test_bad_input_says_what_was_given(err: object, kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        explain(err, **kwargs)  # type: ignore[arg-type]


# --- injected_oom ------------------------------------------------------------------------------


def test_injected_oom_is_a_real_torch_oom_that_parses() -> None:
    err = injected_oom(16, 8)
    assert isinstance(err, TORCH_OOM) and is_oom(err)
    assert str(err).endswith(" (injected by GPUKIT_FAULT_OOM_ABOVE=8: a micro-batch of 16 samples)")
    n = parse(str(err))
    assert n is not None and n.format == "current" and n.requested == 16 * MiB
    assert n.total and n.allocated and n.requested < n.total
    assert explain(err, micro_batch=16).remedies[0].title == "smaller micro-batch"
    huge = parse(str(injected_oom(10**9, 1)))
    assert huge is not None and (huge.requested or 0) > 0
    with pytest.raises(ConfigError, match="samples=0"):
        injected_oom(0, 8)


@pytest.mark.parametrize(
    ("device", "named", "format"),
    [("cpu", "cpu", "cpu"), ("cuda:1", "cuda:1", "current"), ("mps", "mps", "mps")],
)
def test_injected_oom_is_worded_by_the_allocator_of_the_device(
    device: str, named: str, format: str
) -> None:
    err = injected_oom(16, 8, device)
    assert isinstance(err, TORCH_OOM) and is_oom(err)
    n = parse(str(err))
    assert n is not None and n.device == named and n.format == format
    assert n.requested == 16 * 2**20
    assert str(explain(err)).startswith(f"out of memory on {named}: asked for 16 MiB")


def test_a_cpu_run_with_injected_oom_names_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpukit as gk

    monkeypatch.setenv("GPUKIT_FAULT_OOM_ABOVE", "2")
    rt = gk.Runtime(devices="cpu", oom="raise")
    plain = torch.nn.Linear(3, 1)
    model, optimizer = rt.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    with pytest.raises(gk.OutOfMemory) as caught:
        rt.train_step(optimizer, batch, lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
    text = str(caught.value)
    assert text.startswith("out of memory on cpu") and "cuda" not in text.split("\n")[0]
    assert "injected by GPUKIT_FAULT_OOM_ABOVE=2" in text
