"""The Ray side of ``ray_stats``: one actor per worker, one model per actor, and what it does
with a block of the user's dataset.

``StatsActor.check`` reads one block where it lies (a Ray Data block: rows with a ``text``
column, or rows with ``path`` and ``bytes`` from ``ray.data.read_binary_files``, parsed as
``run_stats`` parses a corpus file), applies the ``on_long`` policy, and returns a small
summary for the driver (rows kept, where each left-out row falls, the first error) and the kept
texts in ``PARTS`` further return values: they stay in the object store, owned by the driver (a
return value is owned by its caller), so a worker that dies loses none of them. ``StatsActor.run``
computes the batches ``[first, stop)`` of the kept rows (numbered from 0 over the whole input)
from the kept texts of the blocks that hold them, and returns the partial statistics as file
bytes; ``StatsActor.digest`` hashes the batches a resumed run's checkpoint holds.

A user error while loading the model (a name that does not exist) is kept and raised by every
call, as a task error the driver names; only a process that dies is restarted by Ray.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.collect import torch_threads
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._corpus import PromptCheck, _encodable, file_records, is_jsonl, token_counter
from tl_dynamics.scale._format import to_bytes
from tl_dynamics.scale._provenance import batch_hash, prompt_hash
from tl_dynamics.scale._shard import ShardRunner

PARTS = 4  # kept texts of one check, in this many return values (of at most 2,048 rows a piece)
ROW = "\x00row\x00"  # stands for "row I" in a message until the driver knows the block's offset


def _table(block: Any, piece: tuple[int, int] | None) -> Any:
    """A Ray Data block (Arrow or pandas) as an Arrow table, cut to ``piece``."""
    from ray.data.block import BlockAccessor

    table = BlockAccessor.for_block(block).to_arrow()
    return table if piece is None else table.slice(piece[0], piece[1] - piece[0])


def block_records(block: Any, piece: tuple[int, int] | None) -> Any:
    """``(where, text)`` for every row of a block: ``where`` is ``"FILE:LINE"`` for file rows
    (``path``/``bytes`` columns) and ``ROW + local index`` for ``text`` rows."""
    table = _table(block, piece)
    names = table.column_names
    if "text" in names:
        for i, text in enumerate(table.column("text").to_pylist()):
            if not isinstance(text, str) or not text:
                raise TLDynamicsError(
                    f"{ROW}{i}: the 'text' column holds {text!r}; every row must be a "
                    "non-empty string"
                )
            yield f"{ROW}{i}", text if _encodable(text) else None
    elif "bytes" in names and "path" in names:
        for name, data in zip(table.column("path").to_pylist(), table.column("bytes").to_pylist()):
            yield from file_records(name, io.BytesIO(data), is_jsonl(Path(name)))
    else:
        raise TLDynamicsError(
            f"the Ray dataset has columns {names}; ray_stats needs a 'text' column "
            "(one prompt per row)"
        )


class StatsActor:
    """One model on its device, loaded once (an actor may serve several runs: the run's name
    and settings come with every call)."""

    def __init__(
        self,
        loader: Callable[[], Any] | str,
        threads: int | None,
        device: Any = None,
        dtype: Any = None,
    ):
        from tl_dynamics import devices

        self.threads, self.error = threads, None
        try:
            where = devices.Placement(
                devices.resolve_device(device or "cpu"), devices.resolve_dtype(dtype)
            )
            with torch_threads(threads):
                if isinstance(loader, str):
                    from tl_dynamics import models

                    self.model = models.resolve(loader, where).model
                else:
                    self.model = loader()
                if device is not None or dtype is not None:
                    self.model = devices.place(self.model, where)
                self.adapter = ModelAdapter.of(self.model)
                self.prints = self.adapter.fingerprints()  # once per actor (and restart)
        except TLDynamicsError as exc:  # raised by every call, so the driver names it
            self.error = exc

    def _ready(self) -> None:
        if self.error is not None:
            raise self.error

    def device(self) -> str:
        """Where the model is (for tests and logs)."""
        self._ready()
        param = next(iter(self.model.parameters()), None)
        return "none" if param is None else f"{param.device}/{param.dtype}"

    def fingerprints(self) -> dict[str, str]:
        """The model's fingerprints (``ModelAdapter.fingerprints``), computed at load."""
        self._ready()
        return dict(self.prints)

    def check(self, block: Any, piece: tuple[int, int] | None, on_long: str) -> tuple[Any, ...]:
        """The block's summary for the driver, then its kept texts in ``PARTS`` lists (so a
        task needs only the parts its batches lie in); call with ``num_returns=1 + PARTS``."""
        self._ready()
        kept: list[str] = []
        skips: list[tuple[int, str]] = []  # (kept rows before it in this block, counter)
        n_raw, error = 0, None
        check = PromptCheck(on_long, self.adapter.n_ctx, token_counter(self.adapter))
        try:
            with torch_threads(self.threads):
                for where, text in block_records(block, piece):
                    n_raw += 1
                    used = check(where, text)
                    key = next((k for k, n in check.take().items() if n), None)
                    if key is not None:  # left out or cut: counted where the batch stands
                        skips.append((len(kept), key))
                    if used is not None:
                        kept.append(used)
        except TLDynamicsError as exc:
            error = str(exc)
        size = -(-len(kept) // PARTS)
        parts = [kept[i * size : (i + 1) * size] for i in range(PARTS)]
        summary = {
            "n_raw": n_raw,
            "n_kept": len(kept),
            "skips": skips,
            "parts": [len(p) for p in parts],
            "error": error,
        }
        return (summary, *parts)

    def digest(self, size: int, first: int, stop: int, offset: int, *kept: Any) -> list[int]:
        """``[rows, prompts_hash, batches_hash]`` of batches ``[first, stop)`` of ``size`` rows
        (a resumed run's check of its checkpoint's batches); ``kept`` as for ``run``."""
        self._ready()
        rows = _rows(kept, first * size - offset, stop * size - offset)
        ordered = 0
        for start in range(0, len(rows), size):
            ordered = batch_hash(rows[start : start + size], ordered)
        return [len(rows), prompt_hash(rows), ordered]

    def run(
        self, name: str, settings: dict[str, Any], first: int, stop: int, offset: int, *kept: Any
    ) -> tuple[bytes, int]:
        """Statistics of batches ``[first, stop)``; ``kept`` are the kept texts of consecutive
        blocks, the first starting at kept row ``offset``."""
        self._ready()
        size = settings["batch_size"]
        rows = _rows(kept, first * size - offset, stop * size - offset)
        with torch_threads(self.threads):
            runner = ShardRunner(self.model, name, settings, self.threads, self.prints)
            try:
                for start in range(0, len(rows), size):
                    runner.add(rows[start : start + size])
            finally:
                runner.close()
        return to_bytes(runner.result()), len(rows)


def _rows(kept: tuple[Any, ...], start: int, stop: int) -> list[str]:
    rows: list[str] = []
    for part in kept:
        rows.extend(part)
    return rows[start:stop]
