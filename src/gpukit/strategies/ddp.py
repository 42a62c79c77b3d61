"""DistributedDataParallel: one process per device, gradients averaged by all-reduce.

Each process holds a full replica; ``torch.distributed`` (NCCL on GPUs, gloo on CPUs) sums the
gradients bucket by bucket while the backward pass is still running.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpukit import _env
from gpukit._util import placement
from gpukit._util.fake import real_tensors
from gpukit._util.text import described
from gpukit.devices.device import Device
from gpukit.errors import ConfigError, DistributedError, LaunchError
from gpukit.strategies._bucketed import average, broadcast_from_rank0
from gpukit.strategies._ddp_options import check_options
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies._simulated_ddp import SimulatedDDP
from gpukit.strategies._user_sharded import refuse_for_replicas
from gpukit.strategies.base import Recovery, ReduceOp, Strategy
from gpukit.strategies.float8 import check_float8_recipe
from gpukit.strategies.traits import Collective, Traits

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class DDPRecovery(Recovery):
    """Out-of-memory recovery under ddp: gradients are held back from DDP's reducer and
    averaged once every rank is known to have finished its backward."""

    strategy: DDP

    def hold_sync(self, module: nn.Module, first: bool) -> None:
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = False
            # Otherwise the forward may broadcast buffers itself: a collective that a rank which
            # failed before its forward would never join.
            module.require_forward_param_sync = False
            if first and module.broadcast_buffers:
                # What DDP's own first forward after a synchronised step would do (rank 0's
                # buffers, BatchNorm's statistics say, are everyone's), at a point every rank
                # reaches: before any forward of the attempt.
                self.strategy.broadcast_state(self.strategy.unwrap(module), parameters=False)

    def held_flags(self, module: nn.Module) -> list[bool]:
        # Which parameters got a gradient here: one used only on another rank must still join
        # the sum (as zeros); one that no rank used keeps no gradient, as under DDP's reducer.
        return [p.grad is not None for p in self.strategy.trained(module)]

    def sync_held(self, module: nn.Module, anywhere: list[bool]) -> None:
        grads: list[torch.Tensor] = []
        for p, used in zip(self.strategy.trained(module), anywhere, strict=True):
            if used:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        average(grads, self.strategy.world_size)


class DDP(Strategy):
    """Distributed data parallel over processes started by ``Runtime.launch`` or a launcher.
    ``float8``: None, or a torchao recipe ("tensorwise", "rowwise") the Linear layers
    compute in (see ``gpukit.strategies.float8``).

    >>> import gpukit as gk
    >>> strategy = gk.strategies.DDP(find_unused_parameters=True)
    >>> rt = gk.Runtime(strategy=strategy, devices=["cpu", "cpu"])
    >>> rt.world_size
    2
    """

    name: ClassVar[str] = "ddp"
    # A full replica per process; the reducer's buckets all-reduce the gradients once per
    # optimizer step, behind the backward (the last bucket fills as it ends).
    traits: ClassVar[Traits] = Traits(
        gradient_buckets=True,
        process_per_device=True,
        collectives=(Collective("all-reduce", "gradients", unit="bucket", hidden_by="backward"),),
    )
    recovery_class: ClassVar[type[Recovery]] = DDPRecovery

    # What wraps the model. The planner's simulation swaps in a stand-in that holds the same
    # memory: DDP's reducer reads parameter values, which fake tensors do not have.
    wrapper: ClassVar[type[DistributedDataParallel]] = DistributedDataParallel

    @classmethod
    def for_simulation(cls, *, activation_checkpointing: str = "off") -> Strategy:
        simulated = type(cls.__name__, (cls,), {"wrapper": SimulatedDDP})
        return simulated()

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        float8: str | None = None,
    ) -> None:
        super().__init__()
        check_options(find_unused_parameters, static_graph, bucket_cap_mb, timeout)
        self.float8 = check_float8_recipe(float8, type(self).__name__)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.bucket_cap_mb = bucket_cap_mb
        self.timeout = timeout
        self.launch_env: placement.LaunchEnv | None = None
        self._owns_group = False
        self._guard: Any = None
        self._background: Any = None  # made at its first use (see background_group)

    def configure(self, devices: list[Device]) -> None:
        super().configure(devices)
        # Read here, not in __init__: a strategy object built in the parent is configured
        # again inside each process rt.launch starts.
        self.launch_env = env = placement.launched()
        if env is None:
            self.world_size = len(devices)
            return
        if env.local_rank >= len(devices):
            raise ConfigError(
                f"local rank {env.local_rank} has no device: {len(devices)} given "
                f"({', '.join(map(str, devices))}); give one device per process on this node: "
                f"{_one_each(devices, env.local_world_size)}"
            )
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size

    @property
    def distributed(self) -> bool:
        # Even one rank trains through DDP's reducer, which a backward that fails halfway (out
        # of memory) leaves waiting for gradients: recovery must then hold gradients back and
        # average them itself, as under several ranks. A one-rank run thus takes the same
        # paths as a run of N, which is what a one-device DDP run is for.
        return True

    @property
    def needs_launch(self) -> bool:
        return self.launch_env is None and self.world_size > 1 and not dist.is_initialized()

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def setup_environment(self) -> None:
        super().setup_environment()
        if not dist.is_initialized():
            if self.launch_env is None:
                # One process that no launcher started (several would have needed rt.launch):
                # a process group of one, whose store lives in this process, so no port or
                # MASTER_ADDR is needed. The run is still DDP: DDP's wrapper, reducer and
                # collectives, over one rank.
                dist.init_process_group(
                    self.backend,
                    store=dist.HashStore(),
                    rank=0,
                    world_size=1,
                    timeout=self.timeout,
                )
            else:
                # The store env:// would make, but with a bounded wait for the other ranks: a
                # rank that never comes (RANK/WORLD_SIZE left in the shell, a node that never
                # started) must end the run in minutes with a reason, not hang it.
                addr, port = _env.master_endpoint()
                where = f"rank {self.rank} of {self.world_size}"
                if addr is None or port is None or not port.isdigit():
                    raise ConfigError(
                        f"{where} (RANK and WORLD_SIZE are set) needs MASTER_ADDR and "
                        f"MASTER_PORT, but MASTER_ADDR={addr!r} and MASTER_PORT={port!r}: start "
                        "it with `gpukit launch` or torchrun, or, if no launcher should be "
                        "involved, `unset RANK WORLD_SIZE` (left from an earlier job)"
                    )
                bound = _env.rendezvous_timeout()
                # DistStoreError (rank 0: not everyone came), DistNetworkError (the others: no
                # rank 0); torch before 2.2 raises plain RuntimeErrors for both.
                waits: type[Exception] = getattr(dist, "DistError", RuntimeError)
                try:
                    store = dist.TCPStore(
                        addr,
                        int(port),
                        self.world_size,
                        # Under torchrun the agent on node 0 hosts the store already.
                        is_master=self.rank == 0 and not _env.torchelastic_agent_store(),
                        timeout=datetime.timedelta(seconds=bound),
                        wait_for_workers=True,
                        multi_tenant=True,
                    )
                    dist.init_process_group(
                        self.backend,
                        store=store,
                        rank=self.rank,
                        world_size=self.world_size,
                        timeout=self.timeout,
                    )
                except waits as err:
                    said = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                    raise LaunchError(
                        f"{where} waited {bound:g} s at {addr}:{port} for all "
                        f"{self.world_size} ranks to join, in vain ({said}). Likely causes: "
                        "RANK/WORLD_SIZE left in the shell from an earlier job (`unset RANK "
                        "WORLD_SIZE MASTER_ADDR MASTER_PORT`, or start the program with "
                        "`gpukit launch`); a rank or node that never started or died before "
                        f"joining; a firewall closing port {port} between the nodes. "
                        "GPUKIT_RENDEZVOUS_TIMEOUT=SECONDS waits longer"
                    ) from None
                # Later waits on the store (new groups) follow the collectives' timeout.
                store.set_timeout(self.timeout)
            self._owns_group = True
        # A gloo group beside the training one (gloo even when training uses NCCL): its
        # monitored barrier names the ranks that never arrive, within a timeout of our choice.
        # Made here, where every rank passes, because making a group is itself collective.
        # A fake group (the planner's simulation, one process standing for all ranks) has no
        # peers to pair a gloo group with: its guard is fake too.
        fake = dist.get_backend() == "fake"
        self._guard = dist.new_group(backend="fake" if fake else "gloo")

    def setup_module(self, module: nn.Module) -> nn.Module:
        refuse_for_replicas(module, self.name)
        module = super().setup_module(module)
        options: dict[str, Any] = {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
        }
        if self.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = self.bucket_cap_mb
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return self.wrapper(module, device_ids=device_ids, **options)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def set_backward_sync(self, module: nn.Module, enabled: bool) -> None:
        # What DistributedDataParallel.no_sync() toggles; set before the forward, since DDP
        # decides in forward whether the coming backward all-reduces.
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = enabled

    def broadcast_state(
        self, module: nn.Module, parameters: bool = True, sharded: bool = True
    ) -> None:
        """Make rank 0's buffers (and parameters) ``module``'s on every rank, in buckets;
        ``sharded=False`` leaves out DTensors (shards differ by rank, by design)."""
        tensors = [*(module.parameters() if parameters else ()), *module.buffers()]
        if not sharded:
            tensors = [t for t in tensors if not is_dtensor(t)]
        broadcast_from_rank0(tensors)

    def trained(self, module: nn.Module) -> list[torch.Tensor]:
        """The parameters of the set-up ``module`` that train."""
        return [p for p in self.unwrap(module).parameters() if p.requires_grad]

    def check_gradients(self, module: nn.Module) -> None:
        if self.find_unused_parameters or self.static_graph:
            return
        params = list(self.unwrap(module).named_parameters())
        mine = [p.requires_grad and p.grad is None for _, p in params]
        # Every rank must reach the same verdict, or the ones that carry on wait forever.
        anywhere = self.any_rank(mine)
        unused = [n for (n, _), missing in zip(params, anywhere, strict=True) if missing]
        if unused:
            more = f" and {len(unused) - 10} more" if len(unused) > 10 else ""
            shown = ", ".join(unused[:10]) + more
            raise ConfigError(
                f"ddp: {len(unused)} parameter(s) got no gradient in the first backward: {shown}. "
                "DDP waits for every gradient and would fail at the next step. Use "
                "strategy=gk.strategies.DDP(find_unused_parameters=True) if they are used only "
                "sometimes, or freeze them with p.requires_grad_(False) if never"
            )

    def any_rank(self, flags: list[bool]) -> list[bool]:
        if not flags:
            return []
        with real_tensors():  # host flags: real values even in the planner's simulation
            found = torch.tensor(flags, dtype=torch.float32).to(self.device.torch)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            return [v > 0 for v in found.tolist()]  # the one read: every rank decides alike

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        if not isinstance(op, str) or op not in _OPS:
            raise ConfigError(f"unknown reduce op {described(op)}: use one of {', '.join(_OPS)}")
        out = tensor.detach().clone()
        dist.all_reduce(out, op=_OPS[op])
        if op == "mean":
            out = out / self.world_size
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.detach().contiguous())
        return torch.stack(parts)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._check_src(src)
        out = tensor.detach().clone()
        dist.broadcast(out, src=src)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self._check_src(src)
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ConfigError(
                f"src={src} is not a rank of this job: ranks are 0..{self.world_size - 1}"
            )

    def barrier(self) -> None:
        dist.barrier()

    def background_group(self) -> Any:
        """A gloo group of every rank for a thread's collectives (a checkpoint's background
        write): training's own group must never see collectives from two threads at once,
        whose order would differ between ranks. Made at the first call, which every rank
        makes at the same point (making a group is collective), and kept for the run."""
        if self._background is None:
            self._background = dist.new_group(backend="gloo")
        return self._background

    def check_every_rank_calls(self, what: str) -> None:
        if self._guard is None:
            return
        seconds = _env.collective_check_timeout()
        try:
            dist.monitored_barrier(
                group=self._guard,
                timeout=datetime.timedelta(seconds=seconds),
                wait_all_ranks=True,
            )
        except RuntimeError as err:
            missing = re.search(r"Ranks? ([\d, ]+) failed to pass", str(err))
            who = (
                f"rank(s) {missing.group(1).strip()} did not call it"
                if missing
                else "rank 0 did not answer (it did not call it, or failed)"
            )
            raise DistributedError(
                f"{what} is collective: every rank must call it, and on rank {self.rank} {who} "
                f"within {seconds:g} s. A rank that failed or was stopped first never comes: "
                "its own error is the cause. Otherwise call it on every rank, not under `if "
                "rank == 0:` (gpukit writes files on rank 0 only); see README, 'Collective calls'"
            ) from None

    def hand_over(self, successor: DDP) -> None:
        """Give the process group this process joined to ``successor`` (over the same ranks),
        which sets up its own environment in it (every rank together); this one then holds
        nothing to tear down."""
        successor._owns_group, self._owns_group = self._owns_group, False
        successor.setup_environment()  # the group exists: a guard group (and fsdp's mesh)
        self._drop_side_groups()

    def teardown(self) -> None:
        if not self._owns_group:
            self._drop_side_groups()  # the user's own group stays
        self._guard = self._background = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def _drop_side_groups(self) -> None:
        """Destroy the groups made beside the training one (the guard, the background's)."""
        for group in (self._guard, self._background):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self._guard = self._background = None


def _one_each(devices: list[Device], processes: int) -> str:
    """How to give each of a node's ``processes`` its device, in words that work today."""
    if all(d.type == "cpu" for d in devices):
        listed = ", ".join(["cpu"] * processes)
        return (
            f"devices='cpu' (every process on the CPU), or devices='{listed}' (one 'cpu' "
            "per process)"
        )
    listed = ", ".join(f"{devices[0].type}:{i}" for i in range(processes))
    return f"devices='{listed}' (local rank i takes the i-th)"
