"""Entry points and the collector: ``compute`` (one batch), ``attach`` (during your own forward
passes), ``stream`` (thousands of prompts, memory bounded by a batch) and
``TrajectoryCollector`` (what ``attach`` yields; the adapter drives it).

During a forward pass the collector only keeps each residual point (a reference to the state the
model computed); when the pass ends, every point's statistics are computed at once, batched over
points (``point_statistics``), and stay on the device until they are read."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.adapter import Batch, LayerState, ModelAdapter, Prompt
from tl_dynamics.collect import Collector, to_host
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._lens import LensArg, lens_mode
from tl_dynamics.trajectories._meta import lens_applies, lens_note, stats_meta
from tl_dynamics.trajectories._points import (
    Config,
    StandardizeArg,
    check_config,
    next_tokens,
    point_roles,
    point_statistics,
)
from tl_dynamics.trajectories._reduce import reduce_batch
from tl_dynamics.trajectories._stats import TrajectoryStats
from tl_dynamics.trajectories._trajectory import Trajectory, build, join


class TrajectoryCollector(Collector):
    """Adds each forward pass's statistics (``stats()``, what ``stream`` returns); with
    ``keep_tokens`` (``attach``) it also keeps every pass's per-token arrays, and ``result()``
    is the ``Trajectory`` of all passes, the type ``compute`` returns.

    The tokens and padding mask of a pass are the pass's own (``ModelAdapter.forward``'s
    ``Batch``, or the token ids and ``attention_mask`` the model was called with). A pass run
    on something else (embeddings) counts every position as real, with unknown tokens.
    """

    def __init__(self, adapter: ModelAdapter, cfg: Config, keep_tokens: bool = False):
        check_config(adapter, cfg)
        self.adapter, self.cfg, self.keep_tokens = adapter, cfg, keep_tokens
        self.points = tuple(point_roles(adapter, cfg.flattened, cfg.layers))
        self._zs: list[Tensor] = []
        self._batch: Batch | None = None
        self._pending: list[tuple[dict[str, Tensor], Batch | None]] = []  # not read yet
        self.total: TrajectoryStats | None = None
        self.parts: list[Trajectory] = []

    def start_pass(self, batch: Batch | None) -> None:
        self._zs, self._batch = [], batch

    def on_layer(self, state: LayerState) -> None:
        for role, layer in self.points:
            if layer == state.layer and role in state.points:
                self._zs.append(state.points[role])

    def end_pass(self) -> None:
        zs, self._zs = self._zs, []
        if len(zs) != len(self.points):
            raise TLDynamicsError(
                f"the forward pass delivered {len(zs)} of {len(self.points)} residual points"
            )
        batch = self._batch
        n = tuple(zs[0].shape[:2])
        if batch is not None and tuple(batch.tokens.shape) != n:
            raise TLDynamicsError(
                f"the forward pass runs tokens of shape {n} but the batch "
                f"given has {tuple(batch.tokens.shape)}"
            )
        if batch is None:
            key_valid, targets = torch.ones(n, dtype=torch.bool, device=zs[0].device), None
        else:
            key_valid = batch.key_valid.to(zs[0].device)
            targets = None
            if self.cfg.lens and lens_applies(self.adapter):
                targets = next_tokens(batch.tokens.to(zs[0].device), key_valid)
        raw = point_statistics(self.adapter, self.cfg, zs, key_valid, targets)
        self._pending.append((raw, batch))
        if not self.keep_tokens:  # streaming: fold it in now, memory bounded by one batch
            self._drain()

    def _drain(self) -> None:
        """Read the pending passes off the device and add them up."""
        pending, self._pending = self._pending, []
        for raw, batch in pending:
            if batch is not None:  # read with the summaries: they and their mask on the CPU
                raw = {**raw, "_tokens": batch.tokens, "_key_valid": batch.key_valid}
            raw = to_host(raw)
            if batch is not None:
                batch = Batch(raw.pop("_tokens"), raw.pop("_key_valid"), batch.padding_side)
            if self.keep_tokens:
                traj = build(self.adapter, self.cfg, raw, batch)
                self.parts.append(traj)
                part = traj.stats
            else:
                valid = (
                    raw["norm"].new_ones(raw["norm"].shape[0], raw["norm"].shape[2]).bool()
                    if batch is None
                    else batch.key_valid
                )
                note = lens_note(self.adapter, self.cfg.lens, batch)
                part = reduce_batch(raw, valid, stats_meta(self.adapter, self.cfg, note))
            self.total = part if self.total is None else self.total.merge(part)

    def stats(self, *, allow_empty: bool = False) -> TrajectoryStats:
        """The statistics so far. Before any forward pass this raises (inside ``attach`` it
        is a forgotten model call) unless ``allow_empty``: then it is an empty
        ``TrajectoryStats`` (no prompts) that merges with any run of the same settings as the
        identity (``stream`` over an empty shard gives it)."""
        self._drain()
        if self.total is None:
            if not allow_empty:
                raise Collector.no_passes("trajectories")
            note = lens_note(self.adapter, self.cfg.lens, None)
            return TrajectoryStats(meta=stats_meta(self.adapter, self.cfg, note))
        return self.total

    def result(self) -> Trajectory:
        """Every pass's trajectories as one ``Trajectory`` (prompts stacked, positions padded to
        the longest pass), with ``stats()`` as its ``stats``."""
        if not self.keep_tokens:
            raise TLDynamicsError("this collector keeps statistics only (stream): use stats()")
        total = self.stats()
        if len(self.parts) == 1:  # one pass: its own trajectory, nothing to pad or stack
            return replace(self.parts[0], stats=total)
        return join(self.parts, total)


def _config(
    adapter: ModelAdapter,
    layers: int | Sequence[int] | None,
    eps: Sequence[float],
    flattened: bool,
    lens: LensArg,
    standardize: StandardizeArg,
    skip_first: bool,
) -> Config:
    selected = None if layers is None else tuple(adapter.check_layers(layers))
    return Config(
        eps=tuple(eps),
        layers=selected,
        flattened=flattened,
        lens=lens_mode(lens),
        standardize=standardize,
        skip_first=skip_first,
    )


@contextmanager
def attach(
    model: Any,
    *,
    layers: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    flattened: bool = False,
    lens: LensArg = "view",
    standardize: StandardizeArg = None,
    skip_first: bool = False,
) -> Iterator[TrajectoryCollector]:
    """Accumulate trajectories during the user's own forward passes.

    The collector's ``result()`` is a ``Trajectory``, what ``compute`` gives, for every pass
    run inside (prompts stacked, positions padded to the longest pass; it keeps a few numbers
    per token and point), and ``stats()`` their ``TrajectoryStats``; for many prompts use
    ``stream``, whose memory is bounded by one batch. ``layers`` and the other settings are as
    in ``compute``. Each pass's tokens and padding are its own: call the model with token ids
    (and ``attention_mask=`` for padded batches) or use ``ModelAdapter.forward``.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: a layer index, a list of them, or None (all layers).
        eps: cluster thresholds (link tokens with ``cos > 1 - eps``).
        flattened: interleave the mid-block points.
        lens: the next-token statistics (decoders only: the logit lens's rank of the next
            token and top tokens, the approach to its embedding and unembedding): ``"view"``
            at the cells the view shows (the last 8 positions of each prompt at up to 8
            points; ``_lens.VIEW_POSITIONS``, ``VIEW_POINTS``: about 64 unembedded states per
            prompt), ``"full"`` (or True) at every point and token (one unembedding per point
            and token: ``n_points`` times the model's own head; the rank statistics and the
            settling point need it), False not at all.
        standardize: None, ``"prompt"`` or ``TrajectoryStats.standardizer()``'s result.
        skip_first: leave each prompt's first real token out of the particle statistics.

    Returns:
        A context manager yielding the collector (``result()``: a ``Trajectory``; ``stats()``: a
        ``TrajectoryStats``).

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> model = testing.tiny_model("gpt2")
        >>> with trajectories.attach(model) as collector:
        ...     _ = model(model.to_tokens("x = 1"))
        >>> collector.stats().cluster_counts(0.1).shape
        (3,)
        >>> type(collector.result()).__name__, collector.result().n_points
        ('Trajectory', 3)
    """
    adapter = ModelAdapter.of(model)
    collector = TrajectoryCollector(
        adapter,
        _config(adapter, layers, eps, flattened, lens, standardize, skip_first),
        keep_tokens=True,
    )
    with adapter.collecting(collector):
        yield collector


def batches(
    adapter: ModelAdapter, prompts: Iterable[Any], batch_size: int, padding_side: str
) -> Iterator[Batch]:
    """``prompts`` (strings or ``Batch`` objects) in padded batches of ``batch_size``."""
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


def stream(
    model: Any,
    prompts: Iterable[str | Batch],
    batch_size: int = 16,
    *,
    layers: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    flattened: bool = False,
    lens: LensArg = True,
    standardize: StandardizeArg = None,
    skip_first: bool = False,
    padding_side: str = "right",
    progress: bool = True,
    total: int | None = None,
) -> TrajectoryStats:
    """Trajectory statistics over many prompts, in padded batches of ``batch_size``.

    Peak memory is one batch's activations plus fixed-size accumulators. Two runs over a
    split of the same batches merge exactly: ``stream(m, a).merge(stream(m, b))`` equals
    ``stream(m, a + b)`` when ``len(a)`` is a multiple of ``batch_size``.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: an iterable of texts or ``Batch`` objects (a ``Batch`` runs as it is).
        batch_size: texts per padded batch.
        layers: a layer index, a list of them, or None (all layers).
        eps: cluster thresholds (link tokens with ``cos > 1 - eps``).
        flattened: interleave the mid-block points.
        lens: the logit lens at every point and token (``True`` or ``"full"``: one unembedding
            per point, ``n_points`` times the model's head; the rank statistics need it), or
            False (decoders only).
        standardize: None, ``"prompt"`` or ``TrajectoryStats.standardizer()``'s result.
        skip_first: leave each prompt's first real token out of the particle statistics.
        padding_side: where texts are padded.
        progress: show a progress bar.
        total: number of prompts for the progress bar (default ``len(prompts)`` when known).

    Returns:
        A ``TrajectoryStats`` (empty, the merge identity, when ``prompts`` is empty).

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> stats = trajectories.stream(testing.tiny_model("gpt2"), ["a = 1", "b = 2"] * 8,
        ...                             batch_size=4, progress=False)
        >>> stats.n_prompts
        16
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise TLDynamicsError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(prompts, (str, Tensor)):
        raise TLDynamicsError(
            "stream takes an iterable of prompts (strings or Batch objects); "
            "for one prompt use trajectories.compute"
        )
    adapter = ModelAdapter.of(model)
    collector = TrajectoryCollector(
        adapter, _config(adapter, layers, eps, flattened, lens, standardize, skip_first)
    )
    if total is None and hasattr(prompts, "__len__"):
        total = len(prompts)  # type: ignore[arg-type]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="trajectories", unit="prompt")
    try:
        with adapter.collecting(collector):
            for batch in batches(adapter, prompts, batch_size, padding_side):
                adapter.forward(batch)
                if bar is not None:
                    bar.update(batch.tokens.shape[0])
    finally:
        if bar is not None:
            bar.close()
    return collector.stats(allow_empty=True)


def merge(runs: Sequence[TrajectoryStats]) -> TrajectoryStats:
    """Merge several runs (e.g. from different processes) into one, exactly."""
    if not runs:
        raise TLDynamicsError("merge needs at least one TrajectoryStats")
    out = runs[0]
    for run in runs[1:]:
        out = out.merge(run)
    return out


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    flattened: bool = False,
    lens: LensArg = "view",
    standardize: StandardizeArg = None,
    skip_first: bool = False,
    padding_side: str = "right",
) -> Trajectory:
    """Trajectories of every token of ``prompt`` (one forward pass).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts (padded on ``padding_side``), tokens, or a ``Batch``.
        layers: a layer index, a list of them, or None (all layers): the blocks whose input
            is a trajectory point (in depth order); the last block's output is always the
            final point.
        eps: cluster thresholds (link tokens with ``cos > 1 - eps``).
        flattened: interleave the mid-block points (not available on parallel-block models).
        lens: the next-token statistics (decoders only: the logit lens's rank of the next
            token and top tokens, the approach to its embedding and unembedding): ``"view"``
            at the cells the view shows (the last 8 positions of each prompt at up to 8
            points; ``_lens.VIEW_POSITIONS``, ``VIEW_POINTS``: about 64 unembedded states per
            prompt), ``"full"`` (or True) at every point and token (one unembedding per point
            and token: ``n_points`` times the model's own head; the rank statistics and the
            settling point need it), False not at all.
        standardize: None, ``"prompt"`` (per-prompt per-dimension z-scores) or
            ``TrajectoryStats.standardizer()``'s result, applied before the particle statistics
            only.
        skip_first: leave each prompt's first real token out of the particle statistics.
        padding_side: where a list of texts is padded.

    Returns:
        A ``Trajectory``: per-token arrays ``[batch, point, pos]`` and per-prompt particle
        statistics, with this batch's ``TrajectoryStats``.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
        >>> traj.rank.shape[1] == traj.n_points
        True
    """
    adapter = ModelAdapter.of(model)
    batch = adapter.tokenize(prompt, padding_side)
    collector = TrajectoryCollector(
        adapter,
        _config(adapter, layers, eps, flattened, lens, standardize, skip_first),
        keep_tokens=True,
    )
    with adapter.collecting(collector):
        adapter.forward(batch)
    return collector.result()
