"""Raw torch/CUDA/cuDNN/NCCL/gloo errors translated into readable gpukit errors
(gpukit.diagnostics.readable and its rules).

The messages are verbatim from torch (those that need a GPU, a driver or NCCL are copied from
real runs); the cross-device error with the meta device and the gloo timeout are provoked here.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gpukit as gk
from gpukit.diagnostics.readable import explain_error, reraise_readable
from gpukit.diagnostics.rules import cuda as cuda_rules
from gpukit.errors import (
    ConfigError,
    CrossDeviceError,
    CudnnError,
    DeviceAssertError,
    DistributedError,
    DriverTooOldError,
    GpukitError,
    NoKernelImageError,
    OutOfMemory,
)
from gpukit.launch.ports import free_port
from tests.ranks import start_processes

ASYNC = (
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.\nFor "
    "debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to "
    "enable device-side assertions.\n"
)
LOSS_ASSERT = (
    "../aten/src/ATen/native/cuda/Loss.cu:240: nll_loss_forward_reduce_cuda_kernel_2d: block: "
    "[0,0,0], thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed.\n"
)
INDEX_ASSERT = (
    "../aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [0,0,0], thread: "
    '[0,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && "index out of bounds"` '
    "failed.\n"
)
TIMEOUT = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600123 milliseconds "
    "before timing out."
)
NCCL_SYSTEM = (
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
    "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.14.3\nncclSystemError: System "
    "call (e.g. socket, malloc) or external library call failed or device error."
)
DRIVER = (
    "The NVIDIA driver on your system is too old (found version 11040). Please update your GPU "
    "driver by downloading and installing a new version from the URL: "
    "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to "
    "install a PyTorch version that has been compiled with your version of the CUDA driver."
)
TRACE = "\nException raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:44"


def explained(message: str, kind: type[GpukitError]) -> str:
    err = explain_error(RuntimeError(message))
    assert isinstance(err, kind), f"{message!r} -> {err!r}"
    assert isinstance(err, RuntimeError)  # code catching torch's RuntimeError keeps working
    return str(err)


# -- tensors on different devices ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "specifics"),
    [
        (
            "Expected all tensors to be on the same device, but found at least two devices, "
            "cuda:0 and cpu! (when checking argument for argument mat1 in method "
            "wrapper_CUDA_addmm)",
            ["addmm", "'mat1'", "cuda:0 and cpu"],
        ),
        (
            "Expected all tensors to be on the same device, but got mat1 is on cpu, different "
            "from other tensors on cuda:0 (when checking argument in method wrapper_CUDA_addmm)",
            ["addmm got 'mat1' on cpu", "other tensors on cuda:0"],
        ),
        (
            "Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while "
            "checking arguments for addmm)",
            ["addmm got 'mat1' on CPU but expected it on GPU"],
        ),
        (
            "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be "
            "the same",
            ["input is on cpu (torch.FloatTensor)", "weight is on cuda (torch.cuda.FloatTensor)"],
        ),
        (
            "Expected all tensors to be on the same device. addmm: expected 'mat1' to be a CPU "
            "tensor, but got tensor on cuda:0",
            ["addmm runs on cpu", "'mat1' on cuda:0"],
        ),
        (
            "indices should be either on cpu or on the same device as the indexed tensor (cpu)",
            ["the tensor they index (cpu)", "t[idx.to(t.device)]"],
        ),
    ],
)
def test_cross_device_messages_name_the_argument_devices_and_op(
    message: str, specifics: list[str]
) -> None:
    text = explained("RuntimeError: " + message + TRACE, CrossDeviceError)
    assert text.startswith("tensors on different devices: ")
    for words in specifics:
        assert words in text.splitlines()[0] or words in text
    assert "gk.to(x, model_device)" in text and "rt.setup(loader)" in text
    assert "gk.placement(model)" in text


def test_input_and_weight_of_different_dtypes_are_not_a_device_problem() -> None:
    message = "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should"
    assert explain_error(RuntimeError(message + " be the same")) is None


@pytest.mark.parametrize(
    "provoke",
    [
        lambda: torch.nn.Linear(3, 2).to("meta")(torch.ones(1, 3)),
        lambda: torch.ones(2, device="meta") + torch.ones(3, 2),
    ],
)
def test_a_real_cross_device_error_with_the_meta_device_is_translated(provoke) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError) as raw:
        provoke()
    # torch 2.13 says "Tensor on device meta is not on the expected device cpu!" (or the reverse)
    text = explained(str(raw.value), CrossDeviceError)
    first = text.splitlines()[0]
    assert "meta" in first and "cpu" in first, first
    assert "model.to_empty(device=...)" in text  # meta tensors have no data to move


# -- device-side assert ------------------------------------------------------------------------


def test_device_side_assert_explains_asynchrony_and_the_usual_causes() -> None:
    text = explained(ASYNC + TRACE, DeviceAssertError)
    assert "asynchronously" in text and "may not be the one that failed" in text
    assert "gpukit trace --blocking script.py" in text and "CUDA_LAUNCH_BLOCKING=1" in text
    assert "[0, num_classes)" in text and "num_embeddings" in text
    assert "restart the process" in text


def test_n_classes_assertion_points_at_the_targets() -> None:
    text = explained(LOSS_ASSERT + ASYNC, DeviceAssertError)
    first = text.splitlines()[0]
    assert "class targets outside [0, num_classes)" in first
    assert "nll_loss_forward_reduce_cuda_kernel_2d" in first and "Loss.cu:240" in first
    assert "check the labels" in text and "y - 1" in text


def test_index_assertion_points_at_the_index() -> None:
    first = explained(INDEX_ASSERT + ASYNC, DeviceAssertError).splitlines()[0]
    assert "an index out of range" in first and "IndexKernel.cu:92" in first


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="torch.AcceleratorError: 2.8+")
def test_device_side_assert_inside_accelerator_error() -> None:
    err = explain_error(torch.AcceleratorError(ASYNC))
    assert isinstance(err, DeviceAssertError)


# -- cuDNN, kernels, driver ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ("NOT_INITIALIZED", "out of memory"),
        ("EXECUTION_FAILED", "earlier"),
        ("MAPPING_ERROR", "illegal memory access"),
        ("NOT_SUPPORTED", "no kernel for this layer's configuration"),
    ],
)
def test_cudnn_status_is_named_and_explained(status: str, why: str) -> None:
    text = explained(f"cuDNN error: CUDNN_STATUS_{status}" + TRACE, CudnnError)
    assert text.splitlines()[0] == f"cuDNN failed: CUDNN_STATUS_{status}"
    assert why in text and "gpukit doctor" in text
    assert "torch.backends.cudnn.enabled = False" in text and "reinstall the torch wheel" in text


@pytest.mark.parametrize(
    ("message", "built", "found"),
    [
        (
            "cuDNN version incompatibility: PyTorch was compiled  against (8, 9, 2) but found "
            "runtime version (8, 5, 0). PyTorch already comes bundled with cuDNN...",
            "8.9.2",
            "8.5.0",
        ),
        (
            "cuDNN version mismatch: PyTorch was compiled against 8907 but linked against 90100",
            "8.9.7",
            "9.1.0",
        ),
    ],
)
def test_cudnn_version_mismatch_names_both_versions(message: str, built: str, found: str) -> None:
    text = explained(message, CudnnError)
    assert f"built against {built} but loaded {found}" in text.splitlines()[0]
    assert "LD_LIBRARY_PATH" in text


def test_no_kernel_image_names_the_gpu_and_the_builds_architectures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        cuda_rules,
        "_cuda_build",
        lambda: ("NVIDIA GeForce RTX 5090", (12, 0), ["sm_80", "sm_90"]),
    )
    text = explained(
        "CUDA error: no kernel image is available for execution on the device" + TRACE,
        NoKernelImageError,
    )
    first = text.splitlines()[0]
    assert "NVIDIA GeForce RTX 5090, sm_120" in first and "kernels for sm_80 sm_90" in first
    assert "install a torch build that includes sm_120" in text and "gpukit doctor" in text


def test_no_kernel_image_without_a_gpu_to_ask_still_explains() -> None:
    # The real queries on this machine: a CPU build answers with no GPU and no architectures.
    text = explained("no kernel image is available", NoKernelImageError)
    assert "architecture" in text


def test_driver_too_old_reads_the_cuda_version_it_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    text = explained(DRIVER, DriverTooOldError)
    assert "supports CUDA up to 11.4 but this torch was built for CUDA 12.4" in text
    assert "update the NVIDIA driver" in text and "whl/cu118" in text and "gpukit doctor" in text
    explained("CUDA driver version is insufficient for CUDA runtime version", DriverTooOldError)


# -- NCCL and gloo ------------------------------------------------------------------------------


def test_collective_timeout_names_rank_collective_and_timeout() -> None:
    text = explained(TIMEOUT, DistributedError)
    first = text.splitlines()[0]
    assert "rank 1" in first and "ALLREDUCE" in first and "600000 ms" in first
    assert "another rank" not in first  # the why is below, the first line says what happened
    assert "other ranks' errors first" in text and "NCCL_DEBUG=INFO" in text
    assert "same collectives in the same order" in text and "gpukit doctor" in text
    assert "gk.strategies.DDP(timeout=" in text


def test_newer_watchdog_prefix_still_gives_the_rank() -> None:
    text = explained("[PG ID 0 PG GUID 0(default_pg) Rank 3] " + TIMEOUT[9:], DistributedError)
    assert text.startswith("collective failed: rank 3: ALLREDUCE (collective #5)")


@pytest.mark.parametrize(
    ("message", "name"),
    [
        (NCCL_SYSTEM, "ncclSystemError (NCCL 2.14.3)"),
        (
            "NCCL error: unhandled cuda error\nncclUnhandledCudaError: Call to CUDA function "
            "failed.\nLast error:\nCuda failure 'invalid device ordinal'",
            "ncclUnhandledCudaError: Cuda failure 'invalid device ordinal'",
        ),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, internal error, NCCL version 2.18.1\n"
            "ncclInternalError: Internal check failed.",
            "ncclInternalError",
        ),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN "
            "for details), NCCL version 2.18.1\nncclInvalidUsage: This usually reflects invalid "
            "usage of NCCL library.",
            "ncclInvalidUsage",
        ),
    ],
)
def test_nccl_errors_are_named(message: str, name: str) -> None:
    text = explained(message + TRACE, DistributedError)
    assert name in text.splitlines()[0]
    assert "NCCL_DEBUG=INFO" in text and "gpukit doctor" in text


def test_gloo_errors_name_the_peer_and_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
    text = explained(closed + "[127.0.0.1]:1234", DistributedError)
    assert "127.0.0.1:1234 was closed" in text and "crashed" in text
    monkeypatch.setenv("RANK", "1")  # gloo's message has no rank: this process's is used
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = explained("Timed out waiting 1800000ms for recv operation to complete", DistributedError)
    assert "rank 1: gloo timed out after 1800000 ms (30 min) waiting to recv" in text


def test_a_backend_error_of_unknown_wording_is_still_distributed() -> None:
    err = explain_error(dist.DistBackendError("something new went wrong"))
    assert isinstance(err, DistributedError)


def _wait_alone(rank: int, port: int, outbox: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=2),
    )
    done = Path(outbox, "0.txt")
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
            done.write_text("no error")
        except RuntimeError as err:
            done.write_text(str(explain_error(err)))
    else:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    dist.destroy_process_group()


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
@pytest.mark.slow
def test_a_real_gloo_timeout_is_translated(tmp_path: Path) -> None:
    start_processes(_wait_alone, (free_port(), str(tmp_path)), 2)
    text = (tmp_path / "0.txt").read_text()
    assert text.startswith("collective failed: gloo timed out after 2000 ms waiting to recv"), text


# -- what is not translated, and re-raising -----------------------------------------------------


@pytest.mark.parametrize(
    "err",
    [
        ValueError("bad value"),
        RuntimeError("shape '[2, 3]' is invalid for input of size 5"),
        KeyboardInterrupt(),
        RuntimeError(""),
    ],
)
def test_unknown_errors_give_none(err: BaseException) -> None:
    assert explain_error(err) is None


def test_gpukit_errors_pass_through_unchanged() -> None:
    err = ConfigError("already readable")
    assert explain_error(err) is err


def test_out_of_memory_becomes_the_oom_report() -> None:
    err = explain_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert isinstance(err, OutOfMemory) and "out of memory on" in str(err)


def test_reraise_readable_keeps_the_raw_error_as_cause() -> None:
    raw = RuntimeError(TIMEOUT)
    with pytest.raises(DistributedError) as caught:
        reraise_readable(raw)
    assert caught.value.__cause__ is raw
    unknown = RuntimeError("something else")
    with pytest.raises(RuntimeError) as again:
        reraise_readable(unknown)
    assert again.value is unknown
    readable = ConfigError("x")
    with pytest.raises(ConfigError) as same:
        reraise_readable(readable)
    assert same.value is readable and same.value.__cause__ is None


def test_a_sharded_parameter_met_by_a_plain_tensor_is_explained() -> None:
    raw = RuntimeError(
        "aten.mm.default got mixed torch.Tensor and DTensor, need to convert all torch.Tensor "
        "to DTensor before calling distributed operators!"
    )
    err = explain_error(raw)
    assert isinstance(err, gk.ShardedTensorError)
    text = str(err)
    assert text.splitlines()[0] == (
        "a sharded parameter was used outside its module: mm got a DTensor and a plain tensor"
    )
    assert "rt.full_state_dict()" in text and "fix:" in text


def test_a_real_mixed_use_after_fsdp_setup_is_explained() -> None:
    rt = gk.Runtime(strategy="fsdp", devices=["cpu"], seed=0)
    model = rt.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    try:
        with pytest.raises(RuntimeError) as caught:
            _ = torch.randn(2, 4) @ model[1].weight.T
        assert isinstance(explain_error(caught.value), gk.ShardedTensorError)
    finally:
        rt.teardown()
