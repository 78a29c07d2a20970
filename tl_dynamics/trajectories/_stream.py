"""Streaming: statistics over thousands of prompts in padded batches, memory bounded by a batch;
``attach`` around the user's own forward passes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._points import Config, StandardizeArg
from tl_dynamics.trajectories._stats import TrajectoryStats, reduce_batch
from tl_dynamics.trajectories._trajectory import Trajectory, build, join
from tl_dynamics.trajectories._walk import Walker, lens_note, stats_meta


class Accumulator:
    """Adds each forward pass's statistics (``stats()``, what ``stream`` returns); with
    ``keep_tokens`` (``attach``) it also keeps every pass's per-token arrays, and ``result()``
    is the ``Trajectory`` of all passes, the type ``compute`` returns."""

    def __init__(self, adapter: ModelAdapter, cfg: Config, batch: Batch | None = None,
                 keep_tokens: bool = False):
        self.adapter, self.cfg, self.keep_tokens = adapter, cfg, keep_tokens
        self.walker = Walker(adapter, cfg, self._add, batch)
        self.total: TrajectoryStats | None = None
        self.parts: list[Trajectory] = []

    def set_batch(self, batch: Batch | None) -> None:
        """Give the batch of the next forward pass (padding mask and next-token targets)."""
        self.walker.set_batch(batch)

    def _add(self, raw: dict[str, Tensor], batch: Batch | None) -> None:
        if self.keep_tokens:
            traj = build(self.adapter, self.cfg, raw, batch)
            self.parts.append(traj)
            part = traj.stats
        else:
            valid = raw["norm"].new_ones(raw["norm"].shape[0], raw["norm"].shape[2]).bool() \
                if batch is None else batch.key_valid.cpu()
            note = lens_note(self.adapter, self.cfg.lens, batch)
            part = reduce_batch(raw, valid, stats_meta(self.adapter, self.cfg, note))
        self.total = part if self.total is None else self.total.merge(part)

    def stats(self, *, allow_empty: bool = False) -> TrajectoryStats:
        """The statistics so far. Before any forward pass this raises (inside ``attach`` it
        is a forgotten model call) unless ``allow_empty``: then it is an empty
        ``TrajectoryStats`` (no prompts) that merges with any run of the same settings as the
        identity (``stream`` over an empty shard gives it)."""
        if self.total is None:
            if not allow_empty:
                raise TLDynamicsError("no forward pass has run inside attach(): run the model "
                                      "on some prompts first")
            note = lens_note(self.adapter, self.cfg.lens, self.walker.batch)
            return TrajectoryStats(meta=stats_meta(self.adapter, self.cfg, note))
        return self.total

    def result(self) -> Trajectory:
        """Every pass's trajectories as one ``Trajectory`` (prompts stacked, positions padded to
        the longest pass), with ``stats()`` as its ``stats``."""
        if not self.keep_tokens:
            raise TLDynamicsError("this collector keeps statistics only (stream): use stats()")
        total = self.stats()
        return join(self.parts, total)


def _config(adapter: ModelAdapter, layers: int | Sequence[int] | None, eps: Sequence[float],
            flattened: bool, lens: bool, standardize: StandardizeArg, skip_first: bool) -> Config:
    selected = None if layers is None else tuple(adapter.check_layers(layers))
    return Config(eps=tuple(eps), layers=selected, flattened=flattened, lens=lens,
                  standardize=standardize, skip_first=skip_first)


@contextmanager
def attach(model: Any, *, layers: int | Sequence[int] | None = None, batch: Batch | None = None,
           eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID, flattened: bool = False,
           lens: bool = True, standardize: StandardizeArg = None,
           skip_first: bool = False) -> Iterator[Accumulator]:
    """Accumulate trajectory statistics during the user's own forward passes.

    The collector's ``result()`` is a ``Trajectory``, what ``compute`` gives, for every pass
    run inside (prompts stacked, positions padded to the longest pass; it keeps a few numbers
    per token and point), and ``stats()`` their ``TrajectoryStats``; for many prompts use
    ``stream``, whose memory is bounded by one batch. ``layers`` and the other settings are as
    in ``compute``. Without ``batch`` every position counts as real, token ids and strings are
    unknown (-1, "") and next-token statistics are skipped; call ``acc.set_batch(batch)``
    before each padded call to give its mask and tokens.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> model = testing.tiny_model("gpt2")                     # doctest: +SKIP
        >>> with trajectories.attach(model) as acc:                # doctest: +SKIP
        ...     _ = model(model.to_tokens("x = 1"))
        >>> acc.stats().cluster_counts(0.1).shape                  # doctest: +SKIP
        (3,)
    """
    adapter = ModelAdapter.of(model)
    acc = Accumulator(adapter, _config(adapter, layers, eps, flattened, lens, standardize,
                                       skip_first), batch, keep_tokens=True)
    with acc.walker.attached():
        yield acc


def _batches(adapter: ModelAdapter, prompts: Iterable[Any], batch_size: int,
             padding_side: str) -> Iterator[Batch]:
    chunk: list[Any] = []
    for prompt in prompts:
        if isinstance(prompt, Batch):
            if chunk:
                yield adapter.tokenize(chunk, padding_side)
                chunk = []
            yield prompt
            continue
        chunk.append(prompt)
        if len(chunk) == batch_size:
            yield adapter.tokenize(chunk, padding_side)
            chunk = []
    if chunk:
        yield adapter.tokenize(chunk, padding_side)


def stream(model: Any, prompts: Iterable[str | Batch], batch_size: int = 16, *,
           layers: int | Sequence[int] | None = None,
           eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID, flattened: bool = False,
           lens: bool = True, standardize: StandardizeArg = None, skip_first: bool = False,
           padding_side: str = "right", progress: bool = True,
           total: int | None = None) -> TrajectoryStats:
    """Trajectory statistics over many prompts, in padded batches of ``batch_size``.

    Peak memory is one batch's activations plus fixed-size accumulators. Two runs over a
    split of the same batches merge exactly: ``stream(m, a).merge(stream(m, b))`` equals
    ``stream(m, a + b)`` when ``len(a)`` is a multiple of ``batch_size``.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> stats = trajectories.stream(testing.tiny_model("gpt2"), ["a = 1", "b = 2"] * 8,
        ...                             batch_size=4, progress=False)   # doctest: +SKIP
        >>> stats.n_prompts                                              # doctest: +SKIP
        16
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise TLDynamicsError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(prompts, (str, Tensor)):
        raise TLDynamicsError("stream takes an iterable of prompts (strings or Batch objects); "
                              "for one prompt use trajectories.compute")
    adapter = ModelAdapter.of(model)
    acc = Accumulator(adapter, _config(adapter, layers, eps, flattened, lens, standardize,
                                       skip_first))
    if total is None and hasattr(prompts, "__len__"):
        total = len(prompts)  # type: ignore[arg-type]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="trajectories", unit="prompt")
    try:
        with acc.walker.attached():
            for batch in _batches(adapter, prompts, batch_size, padding_side):
                acc.set_batch(batch)
                adapter.forward(batch)
                if bar is not None:
                    bar.update(batch.tokens.shape[0])
    finally:
        if bar is not None:
            bar.close()
    return acc.stats(allow_empty=True)


def merge(runs: Sequence[TrajectoryStats]) -> TrajectoryStats:
    """Merge several runs (e.g. from different processes) into one, exactly."""
    if not runs:
        raise TLDynamicsError("merge needs at least one TrajectoryStats")
    out = runs[0]
    for run in runs[1:]:
        out = out.merge(run)
    return out
