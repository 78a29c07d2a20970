"""The driver of ``ray_stats``: block references in, exact partial statistics merged out.

It never reads a row: it passes each block's reference to an actor (``StatsActor.check``),
receives a few integers per block, numbers the kept rows, sends groups of whole batches to the
actors with the references of the blocks that hold them, and merges the partials as they
arrive. What it holds at any time is bounded by the tasks in flight, not by the corpus.

A resumed run first hashes the checkpoint's batches on the actors (``StatsActor.digest``, in
groups like the computing ones) and compares them with the checkpoint before it computes a
batch. Ray restarts a worker that dies and re-runs its tasks there (``max_restarts``,
``max_task_retries``); the kept texts are return values the driver owns, so none is lost with
the worker. A worker lost more often than that, or data lost with a node, stops the run with
one line that names the cause and how to resume; the finished prefix is checkpointed first.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import DatasetStats, save_stats
from tl_dynamics.scale._read import from_bytes
from tl_dynamics.scale._ray_worker import PARTS, ROW
from tl_dynamics.scale._run import check_resumed_corpus

SPLIT = 8192  # rows of a block per check task
_ROW = re.compile(re.escape(ROW) + r"(\d+)")
_HASH_MOD = 1 << 256


class WorkerLost(TLDynamicsError):
    """A worker lost more often than Ray restarts it, or data lost with a node."""


def losses(errors: Any) -> tuple[type[BaseException], ...]:
    """Ray's exceptions for a lost worker, node or object (those this Ray has)."""
    names = ("RayActorError", "ObjectLostError", "NodeDiedError", "WorkerCrashedError")
    return tuple(getattr(errors, n) for n in names if hasattr(errors, n))


@dataclass
class Plan:
    """Batch size, batches per task, checkpoint spacing, and where a resumed run starts."""

    name: str
    settings: dict[str, Any]
    batch_size: int
    group: int
    checkpoint_every: int
    start: int = 0  # the first batch to compute (a checkpoint's next_batch)
    base: DatasetStats | None = None  # the checkpoint's statistics
    restarts: int = 3  # times Ray restarts each worker

    @property
    def on_long(self) -> str:
        return self.settings.get("on_long", "error")

    @property
    def task(self) -> tuple[str, dict[str, Any]]:
        return self.name, self.settings

    @property
    def prefix_groups(self) -> int:
        """Groups of the checkpoint's batches (hashed, not computed)."""
        return -(-self.start // self.group)

    def batches(self, kind: str, g: int) -> tuple[int, int]:
        """Batches ``[first, stop)`` of group ``g`` of ``kind`` (``digest``: the checkpoint's,
        from batch 0; ``run``: from ``start``)."""
        if kind == "digest":
            return g * self.group, min((g + 1) * self.group, self.start)
        first = self.start + g * self.group
        return first, first + self.group

    def group_of(self, position: int) -> int:
        """The group whose batches count a row left out before kept row ``position``."""
        return (position // self.batch_size - self.start) // self.group


@dataclass
class _Block:
    offset: int  # its first kept row's number
    n: int
    kept: Any  # the reference to its kept texts


def resume_hint(checkpoint: Path | None) -> str:
    """How to continue: the command line run with ``--resume`` where this is the CLI, else the
    call with ``resume=True``."""
    if checkpoint is None:
        return "give out= to checkpoint a run that can be resumed"
    argv = list(sys.argv)
    cli = argv and (
        Path(argv[0]).name == "tl-dynamics" or argv[0].endswith("tl_dynamics/__main__.py")
    )
    if cli and len(argv) > 1 and argv[1] == "stats":
        words = ["tl-dynamics", *argv[1:]] + ([] if "--resume" in argv else ["--resume"])
        return f"resume with: {shlex.join(words)}"
    return "resume with the same command and --resume (ray_stats(..., resume=True))"


@dataclass
class Driver:
    ray: Any
    actors: list[Any]
    plan: Plan
    checkpoint: Path | None
    bar: Any
    load: list[int] = field(default_factory=list)
    owner: dict[Any, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.load = [0] * len(self.actors)
        self.checks: deque[list[Any]] = deque()  # the blocks' check tasks (references), in order
        self.blocks: deque[_Block] = deque()
        self.running: dict[Any, tuple[str, int]] = {}  # a task's reference -> (kind, group)
        self.done: dict[int, DatasetStats] = {}
        self.skips: dict[int, dict[str, int]] = {}  # group -> counts of rows left out or cut
        self.prefix, self.folded, self.since = self.plan.base, 0, 0
        self.kept_total = self.raw_total = 0
        self.emitted = {"digest": 0, "run": 0}
        self.ended = self.short = False  # short: the data ended inside the checkpoint's rows
        self.window = 2 * len(self.actors)  # tasks in flight: what the driver holds is bounded
        # a resumed run: the checkpoint's batches, hashed on the actors, must be this data's
        self.seen, self.hashed, self.checked = [0, 0, 0], 0, self.plan.start == 0

    # ------------------------------------------------------------------ tasks
    def _submit(self, method: str, *args: Any, returns: int = 1) -> Any:
        i = min(range(len(self.actors)), key=lambda k: self.load[k])  # the least loaded
        refs = getattr(self.actors[i], method).options(num_returns=returns).remote(*args)
        first = refs[0] if returns > 1 else refs
        self.load[i] += 1
        self.owner[first] = i
        return refs

    def _get(self, ref: Any) -> Any:
        i = self.owner.pop(ref, None)
        if i is not None:
            self.load[i] -= 1
        errors = self.ray.exceptions
        try:
            return self.ray.get(ref)
        except errors.RayTaskError as exc:  # a user error on a worker: by name
            cause = getattr(exc, "cause", None)
            if isinstance(cause, TLDynamicsError):
                raise TLDynamicsError(str(cause)) from None
            raise
        except losses(errors) as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: BaseException) -> WorkerLost:
        """One line: what was lost, what is kept, how to resume."""
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        pid = re.search(r"\bpid: (\d+)", str(exc))
        what = (
            f"a Ray worker died more often than the {self.plan.restarts} restarts allowed per "
            "worker (max_restarts)"
            if isinstance(exc, self.ray.exceptions.RayActorError)
            else "data a task needed was lost with its node"
        )
        kept = (
            "nothing was checkpointed"
            if self.checkpoint is None
            else f"the checkpoint {self.checkpoint} keeps the batches before "
            f"{self.plan.start + self.folded * self.plan.group}"
        )
        return WorkerLost(
            f"{what} ({type(exc).__name__}: {detail.rstrip('.')}"
            f"{f', pid {pid.group(1)}' if pid else ''}); {kept}; {resume_hint(self.checkpoint)}"
        )

    # ------------------------------------------------------------------ the loop
    def run(self, bundles: Iterable[Any]) -> DatasetStats:
        stream = iter(bundles)
        try:
            while True:
                while (
                    not self.ended
                    and len(self.checks) < self.window
                    and len(self.running) < self.window
                ):
                    bundle = next(stream, None)
                    if bundle is None:
                        self.ended = True
                        break
                    self._read(bundle)
                self._emit()
                waiting = ([self.checks[0][0]] if self.checks else []) + list(self.running)
                if not waiting:
                    if self.ended:
                        break
                    continue
                ready, _ = self.ray.wait(waiting, num_returns=1)
                if self.checks and ready[0] == self.checks[0][0]:
                    self._summary(self.checks.popleft())
                else:
                    self._finish(ready[0])
        except WorkerLost:  # what finished is checkpointed at once
            self._save()
            raise
        except TLDynamicsError:  # a user error: what is running finishes and is checkpointed
            self._drain()
            self._save()
            raise
        except BaseException:  # interrupted (SIGTERM, Ctrl-C): what finished, at once
            self._save()
            raise
        finally:
            close = getattr(stream, "close", None)
            if close is not None:  # stops Ray Data's executor when the run ends early
                close()
        return self._result()

    def _read(self, bundle: Any) -> None:
        """Check every block of a bundle where it lies (a long one in pieces of ``SPLIT`` rows,
        so that one big block is read by every actor, not by one)."""
        pieces = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
        for entry, piece in zip(bundle.blocks, pieces):
            # a BlockEntry (Ray >= 2.5x) or a (ref, metadata) pair (older Ray)
            ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
            rows = getattr(meta, "num_rows", None)
            start, stop = (0, rows) if piece is None else (piece.start_offset, piece.end_offset)
            cuts = (
                [None]
                if stop is None
                else [
                    (first, min(stop, first + SPLIT))
                    for first in range(start, max(stop, start + 1), SPLIT)
                ]
            )
            for cut in cuts:
                refs = self._submit("check", ref, cut, self.plan.on_long, returns=1 + PARTS)
                self.checks.append(list(refs))

    def _summary(self, refs: list[Any]) -> None:
        summary = self._get(refs[0])
        if summary["error"] is not None:  # the first error in input order stops the run
            message = _ROW.sub(
                lambda m: f"row {self.raw_total + int(m.group(1))}", summary["error"]
            )
            raise TLDynamicsError(message)
        offset = self.kept_total
        self.raw_total += summary["n_raw"]
        self.kept_total += summary["n_kept"]
        for position, key in summary["skips"]:
            group = self.plan.group_of(offset + position)
            if position + offset >= self.plan.start * self.plan.batch_size:
                counts = self.skips.setdefault(group, {})
                counts[key] = counts.get(key, 0) + 1
        for n, kept in zip(summary["parts"], refs[1:]):
            if n:
                self.blocks.append(_Block(offset, n, kept))
                offset += n

    def _emit(self) -> None:
        """Send the groups whose rows are all numbered (at the end: the last, shorter one), as
        long as fewer than ``window`` tasks are in flight: the checkpoint's batches to hash
        first, then, once they matched, the batches to compute."""
        final = self.ended and not self.checks
        size = self.plan.batch_size
        while len(self.running) < self.window:
            kind = "digest" if self.emitted["digest"] < self.plan.prefix_groups else "run"
            if kind == "digest" and self.short:
                kind = "run"
            if kind == "run" and not self.checked:
                if self.short and self.hashed == self.emitted["digest"]:
                    self._compare()  # the data ended before the checkpoint's rows
                    continue
                break
            b0, b1 = self.plan.batches(kind, self.emitted[kind])
            first, stop = b0 * size, b1 * size
            if first >= self.kept_total and final and kind == "digest":
                self.short = True  # no more of its rows
                continue
            if first >= self.kept_total or (stop > self.kept_total and not final):
                break
            refs = [b.kept for b in self.blocks if b.offset < stop and b.offset + b.n > first]
            offset = next(b.offset for b in self.blocks if b.offset + b.n > first)
            args = (size,) if kind == "digest" else self.plan.task
            ref = self._submit(kind, *args, b0, b1, offset, *refs)
            self.running[ref] = (kind, self.emitted[kind])
            self.emitted[kind] += 1
            while self.blocks and self.blocks[0].offset + self.blocks[0].n <= stop:
                self.blocks.popleft()  # its rows are all sent: the reference can go

    def _compare(self) -> None:
        self.checked = True
        base = self.plan.base
        if base is not None:
            seen = (self.seen[0], self.seen[1], self.seen[2])
            check_resumed_corpus(base, seen, self.plan.start, "this dataset", self.checkpoint)

    def _finish(self, ref: Any) -> None:
        kind, group = self.running.pop(ref)
        if kind == "digest":
            n, prompts, ordered = self._get(ref)
            self.seen = [
                self.seen[0] + n,
                (self.seen[1] + prompts) % _HASH_MOD,
                (self.seen[2] + ordered) % _HASH_MOD,
            ]
            self.hashed += 1
            if self.hashed == self.plan.prefix_groups:
                self._compare()
            return
        data, n = self._get(ref)
        stats = from_bytes(data, "a Ray worker's partial statistics")[0]
        self.done[group] = dataclasses.replace(stats, skipped=self.skips.pop(group, {}))
        if self.bar is not None:
            self.bar.update(n)
        while self.folded in self.done:  # the finished prefix, merged in order of groups
            part = self.done.pop(self.folded)
            self.prefix = part if self.prefix is None else self.prefix.merge(part)
            self.folded += 1
            self.since += self.plan.group
        if self.checkpoint is not None and self.since >= self.plan.checkpoint_every:
            self._save()

    def _save(self) -> None:
        if self.checkpoint is not None and self.prefix is not None and self.since:
            next_batch = self.plan.start + self.folded * self.plan.group
            save_stats(self.prefix, self.checkpoint, {"next_batch": next_batch})
            self.since = 0

    def _drain(self) -> None:
        for ref in list(self.running):
            try:
                self._finish(ref)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                self.running.pop(ref, None)

    def _result(self) -> DatasetStats:
        stats = self.prefix
        if stats is None:  # nothing at all: the empty statistics, from an actor
            data, _ = self._get(self._submit("run", *self.plan.task, 0, 0, 0))
            stats = from_bytes(data, "a Ray worker's partial statistics")[0]
        total = dict(stats.skipped)
        for counts in self.skips.values():  # rows left out after the last batch
            for key, n in counts.items():
                total[key] = total.get(key, 0) + n
        return dataclasses.replace(stats, skipped={k: n for k, n in total.items() if n})
