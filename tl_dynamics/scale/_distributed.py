"""torch.distributed: shard by rank, gather the partial statistics on rank 0, merge exactly.

Launched by ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` set), ``run_stats`` joins
(or creates) the default process group: gloo on CPU, NCCL when CUDA is available (each rank on
``cuda:LOCAL_RANK``). Partials travel as statistics-file bytes (``gather_object``), so what
rank 0 merges is exactly what each rank computed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import DatasetStats, from_bytes, to_bytes


@dataclass(frozen=True)
class Dist:
    """This process's place in the run (``world == 1``: a plain single process)."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"

    def checkpoint_path(self, out: Path) -> Path:
        suffix = ".partial" if self.world == 1 else f".partial-rank{self.rank}-of{self.world}"
        return out.with_name(out.name + suffix)

    def all_true(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], device=self.device)
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


@contextmanager
def session() -> Iterator[Dist]:
    """The distributed context: joins torchrun's process group (creating it if needed, and
    then destroying it on exit); a plain ``Dist()`` outside torchrun."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1 and not (torch_dist.is_available() and torch_dist.is_initialized()):
        yield Dist()
        return
    created = False
    cuda = torch.cuda.is_available()
    local = _env_int("LOCAL_RANK", 0)
    if cuda:
        torch.cuda.set_device(local)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if cuda else "gloo")
        created = True
    try:
        yield Dist(torch_dist.get_rank(), torch_dist.get_world_size(),
                   f"cuda:{local}" if cuda else "cpu")
    finally:
        if created:
            torch_dist.destroy_process_group()


def to_device(model: Any, dist: Dist) -> Any:
    """The model on this rank's device (models are loaded before the process group exists:
    transformers saves and loads differently on ranks other than 0 once it does)."""
    if dist.device != "cpu" and hasattr(model, "to"):
        return model.to(dist.device)
    return model
