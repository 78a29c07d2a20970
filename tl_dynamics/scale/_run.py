"""``run_stats``: stream a corpus through a model in padded batches, with checkpoints.

The corpus is cut into batches of ``batch_size`` prompts in file order; batch ``i`` is the same
set of prompts, padded the same way, whoever computes it. Its statistics are exact sums, so the
result is the same bits for one process, ``torchrun`` with any number of ranks (rank ``r`` takes
the batches ``i % world_size == r``), Ray Data, or a run resumed from its checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from tl_dynamics import files, sphere
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.collect import torch_threads
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._corpus import (
    PromptCheck,
    Prompts,
    batches,
    count_prompts,
    iter_prompts,
    token_counter,
)
from tl_dynamics.scale._format import ANALYSES, DatasetStats, save_stats, to_bytes
from tl_dynamics.scale._provenance import batch_hash, fingerprint_changes, prompt_hash
from tl_dynamics.scale._read import read_stats_file
from tl_dynamics.scale._shard import ShardRunner, make_settings, run_shard

__all__ = [
    "ShardRunner",
    "batches",
    "count_prompts",
    "iter_prompts",
    "make_settings",
    "run_shard",
    "run_stats",
    "stats_bytes",
]


def _model_name(model: Any, model_name: str | None, where: Any = None) -> tuple[Any, str]:
    if isinstance(model, str):
        from tl_dynamics import models

        return models.resolve(model, where).model, model_name or model
    return model, model_name or ModelAdapter.of(model).info.architecture


def read_checkpoint(path: Path, settings: dict[str, Any], name: str) -> tuple[DatasetStats, int]:
    """A checkpoint's statistics and its next batch index, refused if made with another model
    name or other settings, or written before checkpoints recorded their fingerprints."""
    what = f"checkpoint {str(path)!r}"
    stats, position = read_stats_file(path, what, allow_partial=True)
    if position is None:
        raise TLDynamicsError(
            f"{what} is a finished statistics file, not a checkpoint: rename it (without "
            ".partial) to keep it, or delete it to start over"
        )
    if stats.fingerprints is None or stats.batches_hash is None:
        raise TLDynamicsError(
            f"{what} is of format version {stats.version}, written before checkpoints recorded "
            "the fingerprints of the model, tokenizer and batches, so nothing shows it was "
            "computed from this model and corpus; delete it to start over"
        )
    diff = [f"model ({stats.model!r} vs {name!r})"] if stats.model != name else []
    diff += [f"settings ({stats.settings} vs {settings})"] if stats.settings != settings else []
    if diff:
        raise TLDynamicsError(
            f"{what} was made by a different run: it differs in {', '.join(diff)}; resume "
            "with the settings it was made with, or delete it to start over with these"
        )
    return stats, position["next_batch"]


def check_fingerprints(base: DatasetStats, now: dict[str, str], checkpoint: Path) -> None:
    """The checkpoint's model, configuration and tokenizer must be this run's: refused, naming
    which changed, otherwise (the weights in a folder overwritten since, a re-download)."""
    changed = fingerprint_changes(base.fingerprints, now)
    if changed:
        raise TLDynamicsError(
            f"checkpoint {str(checkpoint)!r} was computed from another model than this run "
            f"loads: {', '.join(changed)} changed since; resuming would mix two models' "
            "statistics. Load the model it was made from, or delete the checkpoint to start over"
        )


def new_bar(progress: bool, total: int | None, initial: int = 0) -> Any:
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="stats", unit="prompt", dynamic_ncols=True)


def run_stats(
    model: Any,
    prompts: Prompts,
    out: str | os.PathLike | None = None,
    *,
    analyses: Sequence[str] = ANALYSES,
    batch_size: int = 16,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    eps: Sequence[float] = sphere.TRAJECTORY_EPS_GRID,
    lens: bool = True,
    padding_side: str = "right",
    resume: bool = False,
    checkpoint_every: int = 8,
    max_batches: int | None = None,
    progress: bool = True,
    threads: int | None = 1,
    model_name: str | None = None,
    on_long: str = "error",
    device: Any = None,
    dtype: Any = None,
) -> DatasetStats:
    """Dataset-level statistics of a corpus, written to ``out`` (a ``.safetensors`` file).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) each rank streams its shard of the batches and rank 0
    merges and writes; the bytes equal a one-process run. With ``out`` set, partial statistics are
    checkpointed to ``out + ".partial"``; ``resume=True`` continues from there and ends with the
    same bytes as an uninterrupted run. ``out`` is checked before any work: not a directory, not
    the corpus, and no checkpoint of an earlier run next to it unless ``resume``.

    Args:
        model: A model name (as ``tl-dynamics report --model``), a model or an adapter.
        prompts: A corpus file (one prompt per line) or a list of strings.
        out: The statistics file to write (None: only return the statistics).
        analyses: Which of ``DatasetStats.ANALYSES`` to compute.
        batch_size: Prompts per forward pass.
        layers: Layers of the analyses (None: all).
        heads: Heads of the odds-ratio statistics (None: all).
        eps: The trajectories' cluster thresholds.
        lens: Also read the trajectories through the logit lens.
        padding_side: Where shorter prompts of a batch are padded.
        resume: Continue from ``out``'s checkpoint.
        checkpoint_every: Batches between checkpoints.
        max_batches: Stop after that many new batches (checkpointed, ``out`` not written): long
            runs can be cut into jobs.
        progress: Show a progress bar.
        threads: torch's threads for the run (bits can depend on it; keep it the same).
        model_name: The name recorded in the file (default: the model's own name).
        on_long: A prompt longer than the model's context, or a line that is not UTF-8:
            ``"error"`` (name its file and line), ``"skip"`` or ``"truncate"`` (counted in the
            file).
        device: Where to place a model given by name (None: ``auto``) or move a given model
            (``tl_dynamics.devices``); under torchrun ``auto``/``cuda`` mean ``cuda:LOCAL_RANK``.
        dtype: Cast the model (None: as it is).

    Returns:
        The ``DatasetStats`` (the partial statistics when ``max_batches`` stopped the run).

    Example:
        >>> from tl_dynamics import scale, testing
        >>> stats = scale.run_stats(testing.cached_model("gpt2"), ["a = 1", "def f(): pass"],
        ...                         progress=False, model_name="tiny-gpt2")
        >>> stats.n_prompts, stats.analyses
        (2, ('odds_ratio', 'trajectories'))
    """
    from tl_dynamics import devices
    from tl_dynamics.scale import _distributed

    request = "auto" if device is None else device
    where = devices.Placement(_distributed.rank_device(request), devices.resolve_dtype(dtype))
    settings = make_settings(analyses, batch_size, padding_side, layers, heads, eps, lens, on_long)
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 0
    ):
        raise TLDynamicsError(f"max_batches must be a non-negative integer, got {max_batches!r}")
    check_run_settings(checkpoint_every, threads)
    if out is not None:  # before any work: never over an input or a checkpoint not asked for
        source = prompts if isinstance(prompts, (str, os.PathLike)) else None
        files.check_output(out, example="stats.safetensors", inputs=[("--prompts", source)])
        _refuse_stale_checkpoints(Path(out), resume)
        if source is not None and any(files.same_file(source, p) for p in _checkpoints(Path(out))):
            raise TLDynamicsError(f"--prompts {str(source)!r} is a checkpoint of --out")
    with torch_threads(threads):
        model, name = _model_name(model, model_name, where)  # before the process group
    with _distributed.session(request) as dist, torch_threads(threads):
        if device is not None or dtype is not None or dist.world > 1:
            model = _distributed.to_device(model, dist, where.dtype)
        out_path = None if out is None else Path(out)
        checkpoint = None if out_path is None else dist.checkpoint_path(out_path)
        if checkpoint is not None:
            files.remove_stale_temporaries(checkpoint)  # a killed checkpoint write's leftovers
        runner, bar = ShardRunner(model, name, settings, threads), None
        try:  # the runner keeps a collector attached: closed whatever happens
            check = PromptCheck(on_long, runner.adapter.n_ctx, token_counter(runner.adapter))
            base, start = None, 0
            if resume and checkpoint is not None and checkpoint.is_file():
                base, start = read_checkpoint(checkpoint, settings, name)
                check_fingerprints(base, runner.fingerprints, checkpoint)
                _check_resumed_prompts(
                    base, prompts, batch_size, start, dist, checkpoint, on_long, check
                )
            items = (
                item
                for item in batches(prompts, batch_size, check)
                if item[0] >= start and item[0] % dist.world == dist.rank
            )
            total = count_prompts(prompts) if progress and dist.rank == 0 else None
            bar = new_bar(
                progress and dist.rank == 0,
                None if total is None else -(-total // dist.world),
                0 if base is None else base.n_prompts,
            )
            part, complete = run_shard(
                runner,
                items,
                base=base,
                checkpoint=checkpoint,
                checkpoint_every=checkpoint_every,
                max_batches=max_batches,
                bar=bar,
            )
        finally:
            runner.close()
            if bar is not None:
                bar.close()
        if not dist.all_true(complete):
            return part
        merged = dist.merge_on_rank0(part)
        if merged is not None and out_path is not None:
            save_stats(merged, out_path)
        dist.barrier()
        if checkpoint is not None and checkpoint.is_file():
            checkpoint.unlink()
        return part if merged is None else merged


def check_run_settings(checkpoint_every: Any, threads: Any) -> None:
    """The settings ``run_stats`` and ``ray_stats`` share: ``checkpoint_every`` at least 1,
    ``threads`` as ``check_threads`` takes it."""
    if (
        isinstance(checkpoint_every, bool)
        or not isinstance(checkpoint_every, int)
        or checkpoint_every < 1
    ):
        raise TLDynamicsError(f"checkpoint_every must be at least 1, got {checkpoint_every!r}")
    check_threads(threads)


def check_threads(threads: Any) -> None:
    """``threads``: None (torch's setting) or a positive integer."""
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise TLDynamicsError(
            f"threads must be a positive integer (or None for torch's own setting), got {threads!r}"
        )


def _checkpoints(out: Path) -> list[Path]:
    """``OUT.partial`` and ``OUT.partial-rankR-ofN`` files next to ``out``."""
    if not out.parent.is_dir():
        return []
    prefix = out.name + files.PARTIAL_SUFFIX
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))


def _refuse_stale_checkpoints(out: Path, resume: bool) -> None:
    if resume:
        return
    stale = _checkpoints(out)
    if stale:
        raise TLDynamicsError(
            f"--out {str(out)!r}: a checkpoint of an unfinished run exists "
            f"({stale[0]}); pass --resume to continue it, or delete it to "
            "start over"
        )


def _check_resumed_prompts(
    base: DatasetStats,
    prompts: Prompts,
    batch_size: int,
    start: int,
    dist: Any,
    checkpoint: Path,
    on_long: str,
    check: PromptCheck,
) -> None:
    """The checkpoint's prompts must be this corpus's first ``start`` batches (this rank's
    share): same count, same prompts, in the same batches and order; refused by name otherwise."""
    quiet = PromptCheck(on_long, check.n_ctx, check.n_tokens)
    n, digest, ordered = 0, 0, 0
    for index, texts, _ in batches(prompts, batch_size, quiet):
        if index >= start:
            break
        if index % dist.world == dist.rank:
            n, digest = n + len(texts), prompt_hash(texts, digest)
            ordered = batch_hash(texts, ordered)
    where = (
        f"--prompts {str(prompts)!r}"
        if isinstance(prompts, (str, os.PathLike))
        else "the prompts given"
    )
    check_resumed_corpus(base, (n, digest, ordered), start, where, checkpoint)


def check_resumed_corpus(
    base: DatasetStats, seen: tuple[int, int, int], start: int, where: str, checkpoint: Any
) -> None:
    """``seen`` (count, ``prompts_hash``, ``batches_hash`` of the first ``start`` batches of
    ``where``) must be the checkpoint's: other prompts, or the same prompts in another order
    (which changes the bits), are refused by name."""
    n, digest, ordered = seen
    if (n, digest) != (base.n_prompts, base.prompts_hash):
        raise TLDynamicsError(
            f"checkpoint {str(checkpoint)!r} was made from different prompts: it holds "
            f"{base.n_prompts} prompts (hash {base.prompts_hash:064x}), but the first {start} "
            f"batches of {where} are {n} prompts (hash {digest:064x}); resume with the same "
            "corpus, or delete the checkpoint to start over"
        )
    if ordered != base.batches_hash:
        raise TLDynamicsError(
            f"checkpoint {str(checkpoint)!r} was made from the same {n} prompts in another "
            f"order: the first {start} batches of {where} hold them in other batches or another "
            "order within a batch (batches hash "
            f"{ordered:064x}, the checkpoint's {(base.batches_hash or 0):064x}), which changes "
            "the statistics; resume with the corpus as it was, or delete the checkpoint to "
            "start over"
        )


def stats_bytes(stats: DatasetStats) -> bytes:
    """The bytes ``save_stats`` would write (to compare runs without files)."""
    return to_bytes(stats)
