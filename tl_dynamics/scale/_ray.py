"""Ray Data: the same per-batch reduction as a ``map_batches`` stage, one model per actor.

Needs the optional extra ``tl-dynamics[ray]`` (``ray[data]``). The driver cuts the corpus into
the same numbered batches as ``run_stats`` (only the texts pass through it); each actor loads
the model once (``model_loader()``), turns a group of batches into partial statistics, and the
driver merges the partials exactly, so the bytes equal a one-process run's.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tl_dynamics import sphere
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import ANALYSES, DatasetStats, save_stats, to_bytes
from tl_dynamics.scale._read import from_bytes
from tl_dynamics.collect import torch_threads
from tl_dynamics.scale._corpus import batches, iter_prompts
from tl_dynamics.scale._shard import ShardRunner, make_settings


class StatsActor:
    """A Ray Data actor: one model, and for every group of batches their partial statistics."""

    def __init__(
        self, loader: Callable[[], Any], name: str, settings: dict[str, Any], threads: int | None
    ):
        self.name, self.settings, self.threads = name, settings, threads
        with torch_threads(threads):
            self.model = loader()

    def __call__(self, group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch_threads(self.threads):
            runner = ShardRunner(self.model, self.name, self.settings, self.threads)
            try:
                for texts in group["texts"]:
                    runner.add([str(t) for t in texts])
            finally:
                runner.close()
        return {
            "first": np.array([int(np.min(group["index"]))]),
            "partial": np.array([to_bytes(runner.result())], dtype=object),
        }


def _texts(dataset: Any) -> Iterator[str]:
    """A Ray Dataset's ``text`` column in order (a path or list of strings is read as a corpus)."""
    if isinstance(dataset, (str, os.PathLike, list, tuple)):
        yield from iter_prompts(dataset)
        return
    if "text" not in (dataset.schema().names or []):
        raise TLDynamicsError(
            f"the Ray dataset has columns {dataset.schema().names}; ray_stats "
            "needs a 'text' column (one prompt per row)"
        )
    for row in dataset.iter_rows():
        yield row["text"]


def ray_stats(
    model_loader: Callable[[], Any],
    dataset: Any,
    out: str | os.PathLike | None = None,
    *,
    model_name: str,
    num_workers: int = 2,
    batches_per_task: int | None = None,
    analyses: Sequence[str] = ANALYSES,
    batch_size: int = 16,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    lens: bool = True,
    padding_side: str = "right",
    threads: int | None = 1,
) -> DatasetStats:
    """``run_stats`` on Ray Data: ``num_workers`` actors, each with its own model.

    Ray must be initialised by the caller (``ray.init(...)``). The bytes equal those of a
    ``run_stats`` run with the same model name and settings.

    Args:
        model_loader: A picklable callable returning the model (e.g.
            ``functools.partial(tl_dynamics.load_model, "code-2l")``).
        dataset: A Ray Dataset with a ``text`` column, a corpus file or a list of strings.
        out: The statistics file to write (None: only return the statistics).
        model_name: The name recorded in the file (use the name a ``run_stats`` run used to get
            the same bytes).
        num_workers: Ray actors, each with its own model.
        batches_per_task: Batches per Ray task (default: about four tasks per worker).
        analyses: As in ``run_stats``.
        batch_size: As in ``run_stats``.
        layers: As in ``run_stats``.
        heads: As in ``run_stats``.
        eps: As in ``run_stats``.
        lens: As in ``run_stats``.
        padding_side: As in ``run_stats``.
        threads: As in ``run_stats``, per worker.

    Returns:
        The merged ``DatasetStats``.

    Example:
        An empty corpus needs no worker; a real one runs on a local Ray cluster (starting it
        takes some seconds) and gives the bytes of a single-process run:

        >>> import functools
        >>> from tl_dynamics import scale, testing
        >>> loader = functools.partial(testing.cached_model, "gpt2")
        >>> scale.ray_stats(loader, [], model_name="tiny-gpt2").n_prompts
        0
        >>> import ray
        >>> _ = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        >>> stats = scale.ray_stats(loader, ["a = 1"] * 8, model_name="tiny-gpt2", batch_size=4)
        >>> ray.shutdown()
        >>> single = scale.run_stats(loader(), ["a = 1"] * 8, model_name="tiny-gpt2",
        ...                          batch_size=4, progress=False)
        >>> stats == single
        True
    """
    try:
        import ray.data
    except ImportError:
        raise TLDynamicsError("ray_stats needs Ray Data: pip install 'tl-dynamics[ray]'") from None
    settings = make_settings(analyses, batch_size, padding_side, layers, heads, eps, lens)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise TLDynamicsError(f"num_workers must be a positive integer, got {num_workers!r}")
    rows = [{"index": i, "texts": texts} for i, texts in batches(_texts(dataset), batch_size)]
    if not rows:  # nothing to map: the empty statistics, computed here
        return _finish(
            StatsActor(model_loader, model_name, settings, threads)(
                {"index": np.array([0]), "texts": np.array([], dtype=object)}
            ),
            out,
        )
    per_task = batches_per_task or max(1, -(-len(rows) // (4 * num_workers)))
    partials = ray.data.from_items(rows).map_batches(
        StatsActor,
        batch_size=per_task,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_workers),
        num_cpus=1,
        fn_constructor_kwargs={
            "loader": model_loader,
            "name": model_name,
            "settings": settings,
            "threads": threads,
        },
    )
    parts = [
        from_bytes(bytes(row["partial"]), "a Ray worker's partial statistics")[0]
        for row in sorted(partials.take_all(), key=lambda r: int(r["first"]))
    ]
    merged = functools.reduce(DatasetStats.merge, parts)  # rows is not empty: one part or more
    if out is not None:
        save_stats(merged, out)
    return merged


def _finish(result: dict[str, np.ndarray], out: str | os.PathLike | None) -> DatasetStats:
    stats = from_bytes(bytes(result["partial"][0]), "partial statistics")[0]
    if out is not None:
        save_stats(stats, out)
    return stats
