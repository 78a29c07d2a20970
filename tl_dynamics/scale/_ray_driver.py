"""The driver of ``ray_stats``: block references in, exact partial statistics merged out.

It never reads a row: it passes each block's reference to an actor (``StatsActor.check``),
receives a few integers per block, numbers the kept rows, sends groups of whole batches to the
actors with the references of the blocks that hold them, and merges the partials as they
arrive. What it holds at any time is bounded by the tasks in flight, not by the corpus.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import DatasetStats, prompt_hash, save_stats
from tl_dynamics.scale._read import from_bytes
from tl_dynamics.scale._ray_worker import ROW

SPLIT = 8192  # rows of a block per check task
_ROW = re.compile(re.escape(ROW) + r"(\d+)")


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

    @property
    def on_long(self) -> str:
        return self.settings.get("on_long", "error")

    @property
    def task(self) -> tuple[str, dict[str, Any]]:
        return self.name, self.settings

    def rows(self, g: int) -> tuple[int, int]:
        """Kept rows ``[first, stop)`` of group ``g`` (without the corpus end)."""
        first = (self.start + g * self.group) * self.batch_size
        return first, first + self.group * self.batch_size

    def group_of(self, position: int) -> int:
        """The group whose batches count a row left out before kept row ``position``."""
        return (position // self.batch_size - self.start) // self.group


@dataclass
class _Block:
    offset: int  # its first kept row's number
    n: int
    kept: Any  # the reference to its kept texts


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
        self.checks: deque[Any] = deque()  # the blocks' summaries (references), in order
        self.blocks: deque[_Block] = deque()
        self.running: dict[Any, int] = {}  # a task's reference -> its group
        self.done: dict[int, DatasetStats] = {}
        self.skips: dict[int, dict[str, int]] = {}  # group -> counts of rows left out or cut
        self.prefix, self.folded, self.since = self.plan.base, 0, 0
        self.kept_total = self.raw_total = 0
        self.emitted, self.ended = 0, False
        self.window = 2 * len(self.actors)  # tasks in flight: what the driver holds is bounded
        # a resumed run: the kept rows before its first batch must be the checkpoint's
        self.seen, self.checked = [0, 0], self.plan.start == 0

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
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:  # a user error on a worker: by name
            cause = getattr(exc, "cause", None)
            if isinstance(cause, TLDynamicsError):
                raise TLDynamicsError(str(cause)) from None
            raise

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
                waiting = ([self.checks[0]] if self.checks else []) + list(self.running)
                if not waiting:
                    if self.ended:
                        break
                    continue
                ready, _ = self.ray.wait(waiting, num_returns=1)
                if self.checks and ready[0] == self.checks[0]:
                    self._summary(self.checks.popleft())
                else:
                    self._finish(ready[0])
        except BaseException:
            self._drain()  # what finished is checkpointed before the error goes up
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
            if stop is None:
                self.checks.append(self._submit("check", ref, None, self.plan.on_long))
                continue
            for first in range(start, max(stop, start + 1), SPLIT):
                cut = (first, min(stop, first + SPLIT))
                self.checks.append(self._submit("check", ref, cut, self.plan.on_long))

    def _summary(self, summary_ref: Any) -> None:
        summary = self._get(summary_ref)
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
        for n, kept, digest in summary["chunks"]:
            self._check_resumed(offset, n, kept, digest)
            self.blocks.append(_Block(offset, n, kept))
            offset += n

    def _check_resumed(self, offset: int, n: int, kept: Any, digest: int) -> None:
        need = self.plan.start * self.plan.batch_size
        if self.checked or not n:
            return
        take = min(n, need - offset)
        part = digest if take == n else None
        if part is None:
            part = self._get(self._submit("hash_prefix", kept, take))
        self.seen = [self.seen[0] + take, prompt_hash([], self.seen[1] + part)]
        if offset + take >= need:
            self._compare()

    def _emit(self) -> None:
        """Send the groups whose rows are all numbered (at the end: the last, shorter one), as
        long as fewer than ``window`` tasks are in flight."""
        final = self.ended and not self.checks
        if final and not self.checked:
            self._compare()  # the data ended before the checkpoint's rows
        while len(self.running) < self.window:
            first, stop = self.plan.rows(self.emitted)
            if first >= self.kept_total or (stop > self.kept_total and not final):
                break
            refs = [b.kept for b in self.blocks if b.offset < stop and b.offset + b.n > first]
            offset = next(b.offset for b in self.blocks if b.offset + b.n > first)
            b0 = self.plan.start + self.emitted * self.plan.group
            ref = self._submit("run", *self.plan.task, b0, b0 + self.plan.group, offset, *refs)
            self.running[ref] = self.emitted
            self.emitted += 1
            while self.blocks and self.blocks[0].offset + self.blocks[0].n <= stop:
                self.blocks.popleft()  # its rows are all sent: the reference can go

    def _compare(self) -> None:
        self.checked = True
        rows, digest = self.seen
        base = self.plan.base
        if base is not None and (rows, digest) != (base.n_prompts, base.prompts_hash):
            raise TLDynamicsError(
                f"checkpoint {str(self.checkpoint)!r} was made from different prompts: it holds "
                f"{base.n_prompts} prompts (hash {base.prompts_hash:064x}), but the first "
                f"{self.plan.start} batches of this dataset are {rows} prompts (hash "
                f"{digest:064x}); resume with the same data, or delete the checkpoint"
            )

    def _finish(self, ref: Any) -> None:
        group = self.running.pop(ref)
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
        self._save()

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
