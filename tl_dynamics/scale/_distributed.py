"""torch.distributed: shard by rank, gather the partial statistics on rank 0, merge exactly.

Launched by ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` set), ``run_stats`` joins
(or creates) the default process group (``plan``): with ``device`` ``auto`` (CUDA present) or
``cuda``, each rank runs on its own ``cuda:LOCAL_RANK`` and the group is NCCL; with ``cuda:N``
every rank of a node shares that one GPU and the group is gloo (NCCL refuses two ranks on one
GPU); on the CPU it is gloo. Partials travel as statistics-file bytes (``gather_object``), so
what rank 0 merges is exactly what each rank computed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist

from tl_dynamics import devices
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import DatasetStats, to_bytes
from tl_dynamics.scale._read import from_bytes


@dataclass(frozen=True)
class Dist:
    """This process's place in the run (``world == 1``: a plain single process)."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"
    backend: str = "none"

    @property
    def comm_device(self) -> str:
        """Where collective tensors live: the rank's GPU for NCCL, the CPU for gloo."""
        return self.device if self.backend == "nccl" else "cpu"

    def checkpoint_path(self, out: Path) -> Path:
        suffix = ".partial" if self.world == 1 else f".partial-rank{self.rank}-of{self.world}"
        return out.with_name(out.name + suffix)

    def all_true(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], device=self.comm_device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def merge_on_rank0(self, part: DatasetStats) -> DatasetStats | None:
        """Every rank's statistics merged on rank 0 (None on the other ranks)."""
        if self.world == 1:
            return part
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        torch_dist.gather_object(to_bytes(part), gathered, dst=0)
        if gathered is None:
            return None
        out = None
        for rank, data in enumerate(gathered):
            stats = from_bytes(data, f"rank {rank}'s partial statistics")[0]
            out = stats if out is None else out.merge(stats)
        return out


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise TLDynamicsError(f"environment variable {name}={value!r} is not an integer") from None


def plan(
    request: Any, world: int, local: int, count: int, what: str = "device"
) -> tuple[torch.device, str]:
    """This process's device and the process group's backend (``"none"`` for one process), for
    ``request`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) with ``count`` CUDA devices.

    Example:
        >>> plan("auto", world=2, local=1, count=2)
        (device(type='cuda', index=1), 'nccl')
        >>> plan("auto", world=2, local=1, count=0)
        (device(type='cpu'), 'gloo')
    """
    text = "auto" if request is None else str(request).strip()
    if world <= 1:
        return devices.resolve_device(text, what), "none"
    if text == "cpu" or (text == "auto" and count == 0):
        return torch.device("cpu"), "gloo"
    if text in ("auto", "cuda"):
        if count == 0:
            devices.resolve_device(text, what)  # raises: no CUDA device
        if local >= count:
            raise TLDynamicsError(
                f"{what} {text!r} under torchrun: LOCAL_RANK {local} has no GPU of its own "
                f"({count} CUDA device{'s' if count > 1 else ''} here); start at most {count} "
                f"process{'es' if count > 1 else ''} per node (--nproc-per-node), give {what} "
                "cuda:0 for every rank to share one GPU (gloo), or cpu"
            )
        return torch.device("cuda", local), "nccl"
    return devices.resolve_device(text, what), "gloo"  # cuda:N: shared by the node's ranks


def rank_device(request: Any = "auto", what: str = "device") -> torch.device:
    """This process's device for ``request`` (``plan`` with torchrun's environment), checked
    before the model loads."""
    return plan(
        request, _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0), devices.cuda_count(), what
    )[0]


@contextmanager
def session(request: Any = "auto") -> Iterator[Dist]:
    """The distributed context: joins torchrun's process group (creating it if needed, and
    then destroying it on exit; backend from ``plan``); a one-process ``Dist`` outside
    torchrun."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1 and not (torch_dist.is_available() and torch_dist.is_initialized()):
        yield Dist(device=str(rank_device(request)))
        return
    device, backend = plan(request, max(world, 2), _env_int("LOCAL_RANK", 0), devices.cuda_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = False
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend=backend)
        created = True
    try:
        yield Dist(
            torch_dist.get_rank(),
            torch_dist.get_world_size(),
            str(device),
            torch_dist.get_backend(),
        )
    finally:
        if created:
            torch_dist.destroy_process_group()


def to_device(model: Any, dist: Dist, dtype: Any = None) -> Any:
    """The model on this rank's device, in ``dtype`` (None: its own). Models are loaded before
    the process group exists: transformers saves and loads differently on ranks other than 0
    once it does."""
    return devices.place(model, devices.Placement(torch.device(dist.device), dtype))
