"""The learner's ranks: one process, or N under torchrun that take each optimiser step together.

Design (one consumer and a broadcast): rank 0 is the service. It alone reads the trajectories
topic, buffers groups, chooses each step's batch, writes checkpoints, publishes versions and serves
gRPC. Before each step it broadcasts the batch (serialised samples) to the other ranks; every rank
then drops the same unusable samples, takes its share of the rest (`share`), runs forward and
backward on it, and the gradients are averaged across ranks (DDP's all-reduce, or FSDP2's
reduce-scatter) with each share's loss weighted so that the average is exactly the gradient of
the whole batch. All ranks then take the same optimiser step. With FSDP the weights and the
optimiser state are sharded, so saving a checkpoint is a collective too: every rank joins the
gather and rank 0 writes the whole.

A rank that dies makes the next collective fail on every other rank: the step stops, nothing is
checkpointed or published, and the launcher (torchrun under `crucible train`'s supervisor, or the
k8s Job) starts the group again from the last checkpoint and its stored offsets.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from crucible.shared.procs import free_port

log = logging.getLogger("crucible.learner")

SHARDINGS = ("ddp", "fsdp")
IDLE_BEAT_S = 30.0  # rank 0 tells the others it is alive at least this often while no step comes


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    sharding: str = "ddp"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether steps are collective: several ranks, or FSDP (which needs a process group even on one)."""
        return self.world > 1 or self.sharding == "fsdp"

    @classmethod
    def from_env(cls, sharding: str = "ddp", timeout_s: float = 600.0) -> "Ranks":
        """The ranks torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...), joined; one rank without them.

        gloo on CPU, NCCL on GPUs. `timeout_s` bounds how long a collective waits for a rank that
        neither answers nor dies."""
        if sharding not in SHARDINGS:
            raise ValueError(f"learner_sharding {sharding!r} is not one of {', '.join(SHARDINGS)}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world == 1 and sharding == "ddp":
            return cls()
        if world > 1:
            _die_with_launcher()
        if not torch.distributed.is_initialized():
            if "MASTER_ADDR" not in os.environ:  # FSDP on one process, started without torchrun
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend, timeout=dt.timedelta(seconds=timeout_s))
        log.info("learner rank %d of %d (%s)", rank, world, sharding)
        return cls(rank, world, sharding)

    def share(self, items: list) -> list:
        """This rank's part of `items` (every rank holds the same list)."""
        return items[self.rank::self.world]

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """The sum over ranks of each value."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def device(self) -> torch.device:
        return torch.device("cuda") if torch.distributed.is_initialized() and \
            torch.distributed.get_backend() == "nccl" else torch.device("cpu")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module forward and backward run through: DDP's replica, or the model sharded in place
        (FSDP2: each block of its layer lists, then the root). One rank without FSDP: the model."""
        if not self.distributed:
            return model
        if self.sharding == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for module in model.modules():
                if isinstance(module, torch.nn.ModuleList):
                    for block in module:
                        fully_shard(block)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.cuda.current_device()] if self.device().type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    @contextmanager
    def accumulating(self, module: torch.nn.Module, last: bool):
        """Around one micro-batch's backward: gradients are reduced across ranks only on the last."""
        if last or not self.distributed:
            yield
        elif hasattr(module, "no_sync"):  # DDP
            with module.no_sync():
                yield
        elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        else:
            yield

    def close(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def launch_args(ranks: int, max_restarts: int = 0) -> list[str]:
    """The command that starts a learner of `ranks` processes on this machine (torchrun, standalone:
    its own rendezvous on a free port). With max_restarts 0 a dead rank ends the launcher, and whoever
    started it starts the group again (`crucible train`'s supervisor, k8s)."""
    import sys

    if ranks == 1:
        return [sys.executable, "-m", "crucible.services.learner"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            f"--max-restarts={max_restarts}", "-m", "crucible.services.learner"]


def _die_with_launcher() -> None:
    """A rank outlives no launcher (torchrun killed outright): the kernel kills it then."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own shutdown has to do
        pass

