"""Ray: ``run_stats`` where the data is. Workers read and compute; the driver merges.

Needs the optional extra ``tl-dynamics[ray]`` (``ray[data]``). The user's Ray Dataset (or a
corpus file, or several, read with ``ray.data.read_binary_files``) is executed as it is, in
order (``preserve_order``); the driver sees only its blocks' references. Each block goes to an
actor (``StatsActor``, one model per actor, on its GPU when asked), which reads it, applies
``on_long`` and returns a summary of a few integers (rows kept, the positions of the rows left
out, a hash) and keeps the kept texts in the object store.

How batches stay those of ``run_stats``: the kept rows are numbered in input order across all
blocks (a block's first number is the sum of the kept rows of the blocks before it, known to
the driver from the summaries); batch ``i`` is the kept rows ``[i*B, (i+1)*B)``, whatever the
blocks' sizes. Groups of ``batches_per_task`` consecutive batches go to the actors, each task
with the references of the blocks its rows lie in (a batch cut by a block boundary is
re-assembled from both blocks' texts on the actor, never on the driver). A left-out or cut row
is counted in batch ``(kept rows before it) // B``, as ``run_stats`` counts it. Every partial
is exact (``ExactSum``), so the driver merges them as they arrive, in any order; the prefix of
finished groups is checkpointed (``OUT.partial``, the format ``run_stats`` writes) and resumed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

from tl_dynamics import files, sphere
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._format import ANALYSES, DatasetStats, save_stats
from tl_dynamics.scale._ray_driver import Driver, Plan
from tl_dynamics.scale._ray_session import cluster
from tl_dynamics.scale._ray_worker import StatsActor
from tl_dynamics.scale._run import (
    _checkpoints,
    _refuse_stale_checkpoints,
    check_fingerprints,
    check_run_settings,
    new_bar,
    read_checkpoint,
)
from tl_dynamics.scale._shard import make_settings


def _paths(dataset: Any) -> list[Any] | None:
    """The corpus files ``dataset`` names (checked: each a regular file), or None."""
    paths = None
    if isinstance(dataset, (str, os.PathLike)):
        paths = [dataset]
    elif (
        isinstance(dataset, (list, tuple))
        and dataset
        and all(isinstance(p, os.PathLike) for p in dataset)
    ):
        paths = list(dataset)
    for path in paths or []:
        problem = files.not_a_file(path)
        if problem is not None:
            raise TLDynamicsError(
                f"prompts file {str(path)!r} {problem} (give a text file, one "
                "prompt per line, or JSON lines with a 'text' field)"
            )
    return paths


def _dataset(ray: Any, dataset: Any, paths: list[Any] | None) -> Any:
    """The input as a Ray Dataset: files are read by Ray Data on the workers (as bytes, parsed
    there line by line as ``run_stats`` parses them); a list of strings becomes rows."""
    if paths is not None:
        return ray.data.read_binary_files([str(p) for p in paths], include_paths=True)
    if isinstance(dataset, (list, tuple)):
        return ray.data.from_items([{"text": t} for t in dataset])
    if not isinstance(dataset, ray.data.Dataset):
        raise TLDynamicsError(
            "ray_stats reads a Ray Dataset with a 'text' column, a corpus file, a list of "
            f"corpus files (Path objects) or a list of strings; got {type(dataset).__name__}"
        )
    return dataset


def _bundles(data: Any) -> tuple[Any, Any]:
    """The dataset's block references as Ray Data streams them, and its executor to stop at
    the end (``iter_internal_ref_bundles`` runs the same call but leaves the executor
    running); on a Ray without it, the public iterator alone."""
    run = getattr(data, "_execute_to_iterator", None)
    if run is not None:
        try:
            bundles, _, executor = run(capture_executor=False)
        except TypeError:  # another signature: the public iterator
            pass
        else:
            return bundles, executor if hasattr(executor, "shutdown") else None
    return data.iter_internal_ref_bundles(), None


def _resources(ray: Any, num_workers: int, num_cpus: float | None, num_gpus: float) -> float:
    """CPUs per actor: 1 by default, less where the actors would otherwise take every CPU of
    the cluster and leave none for Ray Data's reading tasks."""
    if num_cpus is not None:
        return num_cpus
    total = float(ray.cluster_resources().get("CPU", 0))
    return 1.0 if total >= num_workers + 1 else max(0.0, (total - 1) / num_workers)


_POOL: dict[Any, list[Any]] = {}  # kept actors: (session, how they were made) -> actors


def _actors(
    ray: Any, n: int, made: tuple[Any, ...], cpus: float, gpus: float, restarts: int
) -> tuple[list[Any], Any]:
    """``n`` actors, the kept ones first (``keep_workers``), and the key they are kept under.
    Ray restarts an actor whose process dies up to ``restarts`` times (reloading its model)
    and re-runs the tasks it was running there."""
    import pickle

    session = ray.get_runtime_context().get_job_id()
    for old in [k for k in _POOL if k[0] != session]:  # a past session's actors are gone
        del _POOL[old]
    try:
        key: Any = (session, pickle.dumps(made), cpus, gpus, restarts)
    except (pickle.PicklingError, TypeError, AttributeError):  # a lambda: never shared
        key = None
    pool = _POOL.setdefault(key, []) if key is not None else []
    actor = ray.remote(StatsActor).options(
        num_cpus=cpus, num_gpus=gpus, max_restarts=restarts, max_task_retries=restarts
    )
    pool.extend(actor.remote(*made) for _ in range(n - len(pool)))
    return pool[:n], key


def ray_stats(
    model_loader: Callable[[], Any] | str,
    dataset: Any,
    out: str | os.PathLike | None = None,
    *,
    model_name: str,
    num_workers: int = 2,
    batches_per_task: int | None = 8,
    analyses: Sequence[str] = ANALYSES,
    batch_size: int = 16,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    lens: bool = True,
    padding_side: str = "right",
    threads: int | None = 1,
    on_long: str = "error",
    resume: bool = False,
    checkpoint_every: int = 8,
    progress: bool = True,
    device: Any = None,
    dtype: Any = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    keep_workers: bool = False,
    max_restarts: int = 3,
    ray_address: str | None = None,
) -> DatasetStats:
    """``run_stats`` on a Ray cluster: the workers read the data and compute, the driver merges.

    ``num_workers`` actors each load the model once; the driver merges their exact partial
    statistics as they arrive (its memory does not grow with the corpus).

    Ray must be initialised by the caller (``ray.init(...)``), or named by ``ray_address``. The
    bytes equal those of a ``run_stats`` run over the same rows in the same order with the same
    model name and settings, however the dataset is cut into blocks (see this module's
    docstring), and however many workers died on the way: Ray restarts a worker whose process
    dies (``max_restarts`` times) and runs its batches again. Past that, the run stops with a
    ``TLDynamicsError`` naming the cause and how to resume, its finished batches checkpointed.

    Args:
        model_loader: A model name (as ``tl-dynamics report --model``) or a picklable callable
            returning the model (e.g. ``functools.partial(tl_dynamics.load_model, "code-2l")``);
            each actor loads it once.
        dataset: A Ray Dataset with a ``text`` column (read where its blocks are), a corpus
            file, a list of corpus files (``Path`` objects; read by Ray Data as one corpus, in
            order, with ``FILE:LINE`` in messages), or a list of strings.
        out: The statistics file to write (None: only return the statistics).
        model_name: The name recorded in the file (use the name a ``run_stats`` run used to get
            the same bytes).
        num_workers: Ray actors, each with its own model.
        batches_per_task: Consecutive batches per Ray task (None: 8).
        analyses: As in ``run_stats``.
        batch_size: As in ``run_stats``.
        layers: As in ``run_stats``.
        heads: As in ``run_stats``.
        eps: As in ``run_stats``.
        lens: As in ``run_stats``.
        padding_side: As in ``run_stats``.
        threads: As in ``run_stats``, per worker.
        on_long: As in ``run_stats``; a message names ``FILE:LINE`` for files and ``row I``
            (in input order) for a dataset's rows.
        resume: Continue from ``out``'s checkpoint (written by this or by ``run_stats``).
        checkpoint_every: Batches between checkpoints (rounded up to whole tasks).
        progress: Show a progress bar (prompts done) on the driver.
        device: Each actor's device (``cpu``, ``cuda``; None: the CPU, or ``cuda`` when
            ``num_gpus`` is set): Ray gives an actor its own GPU, so ``cuda`` is that one.
        dtype: Cast each actor's model (None: as it is).
        num_gpus: GPUs per actor (a fraction lets several actors share one; default 1 when
            ``device`` is CUDA, else 0).
        num_cpus: CPUs reserved per actor (default 1, less where the actors would take the
            whole cluster and leave Ray Data's reading tasks none).
        keep_workers: Keep the actors, their models loaded, for the next ``ray_stats`` call
            with the same loader, placement and resources in this Ray session (they hold
            their CPUs/GPUs until ``ray.shutdown()``); default: end them when done.
        max_restarts: Times Ray restarts each worker whose process dies (a preempted node, the
            OOM killer), reloading its model and re-running its batches; one more loss stops
            the run (checkpointed).
        ray_address: Where Ray is not initialised yet: ``"local"`` starts a cluster here,
            ``"auto"`` joins the running one, ``"ray://HOST:PORT"`` a remote one; it is shut
            down when the call ends, however it ends (SIGTERM included). A failure to start
            is one ``TLDynamicsError`` line with what to try. None: the caller's ``ray.init``.

    Returns:
        The merged ``DatasetStats``.

    Example:
        On a local Ray cluster the call starts and shuts down (``ray_address="local"``;
        starting it takes some seconds), the bytes of a single-process run:

        >>> import functools
        >>> from tl_dynamics import scale, testing
        >>> loader = functools.partial(testing.cached_model, "gpt2")
        >>> stats = scale.ray_stats(loader, ["a = 1"] * 8, model_name="tiny-gpt2", batch_size=4,
        ...                         progress=False, ray_address="local")
        >>> single = scale.run_stats(loader(), ["a = 1"] * 8, model_name="tiny-gpt2",
        ...                          batch_size=4, progress=False)
        >>> stats == single
        True
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise TLDynamicsError("ray_stats needs Ray Data: pip install 'tl-dynamics[ray]'") from None
    settings = make_settings(analyses, batch_size, padding_side, layers, heads, eps, lens, on_long)
    batches_per_task = 8 if batches_per_task is None else batches_per_task
    for value, what in ((num_workers, "num_workers"), (batches_per_task, "batches_per_task")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TLDynamicsError(f"{what} must be a positive integer, got {value!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise TLDynamicsError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    check_run_settings(checkpoint_every, threads)
    cuda = device is not None and str(device).startswith("cuda")
    gpus = (1.0 if cuda else 0.0) if num_gpus is None else num_gpus
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 0:
        raise TLDynamicsError(f"num_gpus must be a number of GPUs >= 0, got {num_gpus!r}")
    if cuda and gpus == 0:
        raise TLDynamicsError(f"device {device!r} needs num_gpus > 0 (GPUs per actor)")
    if device is None and gpus > 0:
        device = "cuda"
    out_path = None if out is None else Path(out)
    if out_path is not None:  # before any work, as run_stats
        source = dataset if isinstance(dataset, (str, os.PathLike)) else None
        files.check_output(out_path, example="stats.safetensors", inputs=[("--prompts", source)])
        _refuse_stale_checkpoints(out_path, resume)
    checkpoint = None if out_path is None else out_path.with_name(out_path.name + ".partial")
    if checkpoint is not None:
        files.remove_stale_temporaries(checkpoint)  # a killed checkpoint write's leftovers
    base, start = None, 0
    if resume and checkpoint is not None and checkpoint.is_file():
        base, start = read_checkpoint(checkpoint, settings, model_name)
    paths = _paths(dataset)
    with cluster(ray, ray_address):
        if not ray.is_initialized():
            raise TLDynamicsError(
                "ray_stats needs a Ray cluster: call ray.init(...) first, or pass ray_address"
            )
        data = _dataset(ray, dataset, paths)
        made = (model_loader, threads, device, dtype)
        cpus = _resources(ray, num_workers, num_cpus, gpus)
        actors, key = _actors(ray, num_workers, made, cpus, gpus, max_restarts)
        try:
            plan = Plan(
                model_name,
                settings,
                batch_size,
                batches_per_task,
                checkpoint_every,
                start,
                base,
                max_restarts,
            )
            merged = _drive(ray, data, actors, plan, checkpoint, progress)
        finally:
            if not keep_workers:
                for a in _POOL.pop(key, None) or actors:
                    ray.kill(a)
    if out_path is not None:
        save_stats(merged, out_path)
        for stale in _checkpoints(out_path):
            stale.unlink()
    return merged


def _drive(
    ray: Any, data: Any, actors: list[Any], plan: Plan, checkpoint: Path | None, progress: bool
) -> DatasetStats:
    """The driver's loop over the dataset's blocks, after the checkpoint's fingerprints are
    compared with the model the actors loaded."""
    driver = Driver(ray, actors, plan, checkpoint, None)
    if plan.base is not None and checkpoint is not None:
        now = driver._get(driver._submit("fingerprints"))  # the model as the actors loaded it
        check_fingerprints(plan.base, now, checkpoint)
    driver.bar = new_bar(progress, None, 0 if plan.base is None else plan.base.n_prompts)
    order = data.context.execution_options
    kept_order, order.preserve_order = order.preserve_order, True
    try:
        bundles, executor = _bundles(data)
        try:
            return driver.run(bundles)
        finally:
            if executor is not None:  # its threads would outlive the run (and ray.shutdown)
                executor.shutdown(force=True)
    finally:
        order.preserve_order = kept_order
        if driver.bar is not None:
            driver.bar.close()
