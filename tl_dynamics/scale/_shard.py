"""One shard of a statistics run: the recorded settings and the runner that streams batches.

``make_settings`` checks and records what changes the numbers; ``ShardRunner`` streams batches
through one model with the chosen analyses on, and ``run_shard`` drives it with checkpoints.
``run_stats`` (``tl_dynamics.scale._run``) and the Ray Data stage (``_ray``) both use them, so
every way of running gives the same bits.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable, Sequence

from tl_dynamics import odds_ratio, trajectories
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._corpus import ON_LONG
from tl_dynamics.scale._format import ANALYSES, DatasetStats, save_stats
from tl_dynamics.scale._provenance import batch_hash, prompt_hash


# ---------------------------------------------------------------------- settings
def make_settings(
    analyses: Sequence[str],
    batch_size: int,
    padding_side: str,
    layers: Any,
    heads: Any,
    eps: Sequence[float],
    lens: bool,
    on_long: str = "error",
) -> dict[str, Any]:
    """The settings recorded in the file (plain JSON values, so they compare after loading)."""
    chosen = sorted(set(analyses))
    bad = [a for a in chosen if a not in ANALYSES]
    if not chosen or bad:
        raise TLDynamicsError(
            f"analyses {list(analyses)!r}: choose one or more of {list(ANALYSES)}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TLDynamicsError(f"batch_size must be a positive integer, got {batch_size!r}")
    if padding_side not in ("left", "right"):
        raise TLDynamicsError(f"padding_side {padding_side!r}: valid are 'left' and 'right'")
    if on_long not in ON_LONG:
        raise TLDynamicsError(f"on_long {on_long!r}: valid are {', '.join(ON_LONG)}")
    out: dict[str, Any] = {"batch_size": batch_size, "padding_side": padding_side}
    if on_long != "error":  # recorded only when it can change the numbers
        out["on_long"] = on_long
    if "odds_ratio" in chosen:
        out["odds_ratio"] = {"layers": layers, "heads": heads}
    if "trajectories" in chosen:
        out["trajectories"] = {"layers": layers, "eps": [float(e) for e in eps], "lens": bool(lens)}
    return json.loads(json.dumps(out, sort_keys=True))


# ---------------------------------------------------------------------- one shard
class ShardRunner:
    """Streams batches through one model with the chosen analyses on; ``result()`` is the
    ``DatasetStats`` of the batches seen. One forward pass per batch serves both analyses:
    ``trajectories.stream`` runs it, and the odds-ratio collector (``odds_ratio.attach``, open
    from ``__init__`` to ``close``) reads every layer of the same pass."""

    def __init__(
        self,
        model: Any,
        model_name: str,
        settings: dict[str, Any],
        threads: int | None = 1,
        fingerprints: dict[str, str] | None = None,
    ):
        self.adapter = ModelAdapter.of(model)
        if self.adapter.tokenizer is None:
            raise TLDynamicsError(
                f"{model_name} has no tokenizer: statistics over a text corpus need one"
            )
        self.name, self.settings, self.threads = model_name, settings, threads
        # what the numbers come from (given by a caller that computed them once per model)
        self.fingerprints = fingerprints or self.adapter.fingerprints()
        self.n_prompts, self.hash, self.bos_prompts, self.batches = 0, 0, 0, 0
        self.skipped: dict[str, int] = {}
        o, self._t = settings.get("odds_ratio"), settings.get("trajectories")
        self._attached = ExitStack()  # the odds-ratio collector stays attached until close()
        self._odds = (
            None
            if o is None
            else self._attached.enter_context(
                odds_ratio.attach(
                    self.adapter, layers=o["layers"], heads=o["heads"], threads=threads
                )
            )
        )
        self._traj = None if self._t is None else self._stream([])

    def _stream(self, batches: list[Any]) -> trajectories.TrajectoryStats:
        t = self._t
        if t is None:  # called only when the settings ask for trajectories
            raise RuntimeError("ShardRunner: no trajectories in these settings")
        return trajectories.stream(
            self.adapter,
            batches,
            layers=t["layers"],
            eps=tuple(t["eps"]),
            lens=t["lens"],
            progress=False,
        )

    def close(self) -> None:
        """Detach the odds-ratio collector (attached from ``__init__`` around every batch)."""
        self._attached.close()

    def add(self, texts: list[str], skipped: dict[str, int] | None = None) -> None:
        for key, n in (skipped or {}).items():
            if n:
                self.skipped[key] = self.skipped.get(key, 0) + n
        if not texts:  # lines left out after the last batch: counted, nothing to run
            return
        batch = self.adapter.tokenize(texts, self.settings["padding_side"])
        if self._traj is None:
            self._odds.forward(batch)  # type: ignore[union-attr]
        elif self._odds is None:
            self._traj = self._traj.merge(self._stream([batch]))
        else:  # one pass feeds both collectors (the odds-ratio one is attached throughout)
            self._traj = self._traj.merge(self._stream([batch]))
        self.n_prompts += len(texts)
        self.hash = prompt_hash(texts, self.hash)
        self.batches = batch_hash(texts, self.batches)
        self.bos_prompts += begins_with_bos(batch, self.adapter.tokenizer)

    def result(self) -> DatasetStats:
        return DatasetStats(
            self.name,
            self.settings,
            self.n_prompts,
            self.hash,
            None if self._odds is None else self._odds.result(allow_empty=True).stats,
            self._traj,
            dict(self.skipped),
            self.bos_prompts,
            dict(self.fingerprints),
            self.batches,
        )


def begins_with_bos(batch: Any, tokenizer: Any) -> int:
    """How many rows of ``batch`` (an adapter ``Batch``) begin with ``tokenizer``'s BOS token:
    their first real token is its id (one was prepended; the report's attention section reads a
    single prompt the same way). 0 for a tokenizer without one.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace as NS
        >>> batch = NS(tokens=torch.tensor([[0, 7, 5], [7, 5, 5]]),
        ...            key_valid=torch.tensor([[False, True, True], [True, True, False]]))
        >>> begins_with_bos(batch, NS(bos_token_id=7)), begins_with_bos(batch, NS())
        (2, 0)
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return 0
    first = batch.key_valid.long().argmax(-1, keepdim=True)  # the first real position per row
    return int((batch.tokens.gather(1, first.to(batch.tokens.device))[:, 0] == bos).sum())


def run_shard(
    runner: ShardRunner,
    items: Iterable[tuple[int, list[str]] | tuple[int, list[str], dict[str, int]]],
    *,
    base: DatasetStats | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 8,
    max_batches: int | None = None,
    bar: Any = None,
) -> tuple[DatasetStats, bool]:
    """Run ``items`` (``(index, prompts)``); returns the statistics (``base`` merged in) and
    whether every item was done (False when ``max_batches`` stopped it first)."""
    done, complete, last = 0, True, None

    def total() -> DatasetStats:
        part = runner.result()
        return part if base is None else base.merge(part)

    for index, texts, *skipped in items:
        if max_batches is not None and done >= max_batches:
            complete = False
            break
        runner.add(texts, skipped[0] if skipped else None)
        done, last = done + 1, index
        if bar is not None:
            bar.update(len(texts))
        if checkpoint is not None and done % checkpoint_every == 0:
            save_stats(total(), checkpoint, {"next_batch": index + 1})
    result = total()
    if checkpoint is not None and last is not None and (not complete or done % checkpoint_every):
        save_stats(result, checkpoint, {"next_batch": last + 1})
    return result, complete
