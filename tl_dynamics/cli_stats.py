"""``tl-dynamics stats`` and ``tl-dynamics report --stats`` (hooked into ``tl_dynamics.cli``).

The arguments and the corpus file are checked before torch is imported; Ctrl-C or SIGTERM during
a run says what the checkpoint (``OUT.partial``) keeps and the command that resumes it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from tl_dynamics import (
    _args,
    _interrupt,
    _loading,
    _model_config,
    _model_names,
    _registries,
    devices,
    files,
)
from tl_dynamics.errors import TLDynamicsError

STATS_SUFFIX = ".safetensors"


def _ints(text: str | None, what: str) -> list[int] | None:
    return None if text is None else _args.token_ids(text, what)


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(p) for p in re.split(r"[\s,]+", text.strip()) if p]
    except ValueError:
        values = []
    if not all(math.isfinite(v) and v > 0 for v in values):
        values = []
    if not values:
        raise TLDynamicsError(
            f'{what} {text!r}: expected positive numbers separated by commas, e.g. "0.05,0.1"'
        )
    return values


def _analyses(text: str) -> list[str]:
    valid = _registries.stats_analyses()
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in valid]
    if unknown or not names:
        raise TLDynamicsError(
            f"--analyses {text!r}: unknown {unknown or 'empty'}; valid: {', '.join(valid)}"
        )
    return names


def stats_parser() -> argparse.ArgumentParser:
    """The ``tl-dynamics stats`` options (choices and defaults from the registries the run
    uses: ``DatasetStats.ANALYSES``, ``DatasetStats.ON_LONG``, ``sphere.TRAJECTORY_EPS_GRID``)."""
    analyses = _registries.stats_analyses()
    p = argparse.ArgumentParser(
        prog="tl-dynamics stats",
        description="Dataset-level statistics of a corpus (odds-ratio heads, trajectories), "
        "written to one statistics file (docs/stats-format.md). Under torchrun each "
        "rank takes a shard and rank 0 writes the same bytes. Ctrl-C keeps the last "
        "checkpoint (OUT.partial) and prints the command that resumes.",
    )
    p.add_argument(
        "--model",
        default=_model_names.DEFAULT_MODEL,
        help=f"model name or folder, as for report (shipped: "
        f"{', '.join(_model_names.shipped_names())}; default {_model_names.DEFAULT_MODEL})",
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="corpus: a text file (one prompt per line) or JSON lines (.jsonl) with a 'text' field",
    )
    p.add_argument("--out", required=True, help=f"statistics file to write (a {STATS_SUFFIX} file)")
    p.add_argument(
        "--analyses",
        default=",".join(analyses),
        help=f"comma-separated, from {', '.join(analyses)} (default all)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", default=None, help='layers, e.g. "0,3" (default all)')
    p.add_argument("--heads", default=None, help='head indices in every layer, e.g. "0 2"')
    p.add_argument(
        "--eps",
        default=",".join(f"{e:g}" for e in _registries.eps_grid()),
        help="cluster thresholds (cos > 1 - eps; default %(default)s)",
    )
    p.add_argument("--no-lens", action="store_true", help="skip the next-token statistics")
    p.add_argument("--padding-side", default="right", choices=("left", "right"))
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint next to --out (OUT.partial); says so when there is none",
    )
    p.add_argument("--checkpoint-every", type=int, default=8, help="batches between checkpoints")
    p.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="stop (checkpointed) after this many new batches; finish with --resume",
    )
    p.add_argument(
        "--threads",
        default="1",
        help="torch threads per process: a positive integer up to the core count",
    )
    p.add_argument(
        "--on-bad-lines",
        "--on-long",  # its first name, kept
        dest="on_long",
        default="error",
        choices=_registries.bad_line_policies(),
        help="a corpus line the model cannot take whole (a prompt longer than the model's "
        "context, or a line that is not UTF-8): stop with its file and line (error, the "
        "default), leave it out (skip), or keep the tokens that fit (truncate); both are "
        "counted in the file. --on-long is the same switch",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run on a Ray cluster (extra tl-dynamics[ray]): 'local' starts one here, 'auto' "
        "joins the running one, or ray://HOST:PORT; workers read the corpus and compute, "
        "the driver merges (same bytes)",
    )
    p.add_argument("--workers", type=int, default=2, help="Ray actors, one model each")
    p.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        help="with --ray: GPUs per actor, e.g. 0.5 for two per GPU (default 1 with "
        "--device cuda, else 0)",
    )
    devices.add_options(
        p
    )  # under torchrun: auto/cuda = cuda:LOCAL_RANK (NCCL), cuda:N shared (gloo)
    return p


def _checkpoints(out: Path) -> list[Path]:
    """``OUT.partial`` and, under torchrun, ``OUT.partial-rankR-ofN``."""
    try:
        return sorted(out.parent.glob(out.name + files.PARTIAL_SUFFIX + "*"))
    except OSError:
        return []


def _kept(out: Path) -> tuple[str, bool]:
    """What a stopped run leaves: the sentence, and whether a checkpoint is there to resume."""
    found = _checkpoints(out)
    if not found:
        return f"no checkpoint was reached, so nothing was written ({out} is as it was)", False
    try:
        from tl_dynamics.scale import load_stats

        n = sum(load_stats(path, allow_partial=True).n_prompts for path in found)
        what = f"the statistics of its first {n} prompts"
    except (TLDynamicsError, OSError):
        what = "the last checkpoint"
    where = str(found[0]) if len(found) == 1 else f"{len(found)} files {out}.partial-rank*"
    return f"{where} keeps {what} ({out} is not written)", True


def cli_main(argv: list[str]) -> int:
    """``tl-dynamics stats ...``."""
    args = stats_parser().parse_args(argv)
    start = time.perf_counter()
    stats = None
    try:
        out = files.check_output(
            args.out, example="stats.safetensors", inputs=[("--prompts", args.prompts)]
        )
        _args.check_suffix(args.out, (STATS_SUFFIX,))
        _args.check_corpus(args.prompts)
        threads = _args.threads_arg(args.threads)
        batch_size = _args.positive_arg(args.batch_size, "--batch-size")
        checkpoint_every = _args.positive_arg(args.checkpoint_every, "--checkpoint-every")
        if args.max_batches is not None and args.max_batches < 0:
            raise TLDynamicsError(f"--max-batches {args.max_batches}: give 0 or more")
        common = _common(args)
        _args.check_placement_text(args.device, args.dtype)
        _loading.check_model(args.model)
        _model_config.check_selection(  # before torch
            args.model, common["layers"], head_indices=common["heads"]
        )
        if args.resume and not _checkpoints(out) and os.environ.get("RANK", "0") == "0":
            print(
                f"tl-dynamics: note: --resume: there is no checkpoint {out}{files.PARTIAL_SUFFIX} "
                "to continue, so the run starts from the first prompt",
                file=sys.stderr,
            )
        if args.ray is not None:
            stats = _on_ray(args, out, threads, batch_size, checkpoint_every, common)
        else:
            if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:  # torchrun: run_stats checks
                devices.resolve_device(args.device, "--device")  # before the model loads
            stats = _run(args, out, threads, batch_size, checkpoint_every, common)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        kept, resumable = _kept(Path(args.out).expanduser())
        again = (
            f"resume with: {_interrupt.command(['stats', *argv], add=['--resume'])}"
            if resumable
            else f"start again with: {_interrupt.command(['stats', *argv], drop=['--resume'])}"
        )
        return _interrupt.stopped(exc, f"{time.perf_counter() - start:.1f} s in, {kept}; {again}")
    if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the run
        if out.is_file():
            state = f"wrote {out}"
        else:
            resume = _interrupt.command(["stats", *argv], add=["--resume"])
            state = f"stopped early (checkpoint {out}.partial; finish with: {resume})"
        left = ", ".join(f"{k} {n}" for k, n in sorted(stats.skipped.items()) if n)
        print(
            f"{state}: {stats.n_prompts} prompts in {time.perf_counter() - start:.1f} s"
            + (f" (corpus lines not used whole: {left})" if left else "")
        )
    return 0


def _common(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "analyses": _analyses(args.analyses),
        "layers": _ints(args.layers, "--layers"),
        "heads": _ints(args.heads, "--heads"),
        "eps": _floats(args.eps, "--eps"),
        "lens": not args.no_lens,
        "padding_side": args.padding_side,
        "progress": not args.no_progress,
        "on_long": args.on_long,
    }


def _on_ray(
    args: argparse.Namespace,
    out: Any,
    threads: Any,
    batch_size: int,
    every: int,
    common: dict[str, Any],
) -> Any:
    """``--ray``: ``ray_stats`` on the cluster named (joined here, or started when ``local``)."""
    if args.max_batches is not None:
        raise TLDynamicsError("--max-batches is not available with --ray (stop and --resume)")
    workers = _args.positive_arg(args.workers, "--workers")
    device = None if args.device == "auto" else args.device
    if device not in (None, "cpu", "cuda"):
        raise TLDynamicsError(
            f"--device {args.device!r} with --ray: valid are auto, cpu and cuda (Ray gives "
            "each worker its own GPU)"
        )
    from tl_dynamics.scale import ray_stats

    return ray_stats(
        args.model,
        args.prompts,
        out,
        model_name=args.model,
        num_workers=workers,
        batch_size=batch_size,
        threads=threads,
        resume=args.resume,
        checkpoint_every=every,
        device=device,
        dtype=None if args.dtype == "auto" else args.dtype,
        num_gpus=args.gpus_per_worker,
        keep_workers=True,  # they end with this process (or with the cluster it started)
        ray_address=args.ray,  # joined or started here, shut down at the end however it ends
        **common,
    )


def _run(
    args: argparse.Namespace,
    out: Any,
    threads: Any,
    batch_size: int,
    every: int,
    common: dict[str, Any],
) -> Any:
    from tl_dynamics.scale import run_stats

    return run_stats(
        args.model,
        args.prompts,
        out,
        batch_size=batch_size,
        resume=args.resume,
        checkpoint_every=every,
        max_batches=args.max_batches,
        threads=threads,
        device=args.device,
        dtype=args.dtype,
        **common,
    )


def add_page_options(group: Any) -> None:
    """``--stats`` and ``--allow-partial``: the page of a statistics file (on
    ``tl-dynamics report --stats``'s own parser, and shown in ``tl-dynamics report --help``)."""
    group.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="render this statistics file from `tl-dynamics stats` instead (its page; --out "
        "default stats.html)",
    )
    group.add_argument(
        "--allow-partial",
        action="store_true",
        help="with --stats: render an unfinished run's checkpoint (OUT.partial) too",
    )


def report_main(argv: list[str]) -> int:
    """``tl-dynamics report --stats FILE [--out page.html]``: the dataset page."""
    p = argparse.ArgumentParser(
        prog="tl-dynamics report --stats",
        description="Render a statistics file as an offline HTML page.",
    )
    add_page_options(p)
    p.add_argument("--out", default="stats.html", help="output HTML file (default stats.html)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        if not args.stats:
            raise TLDynamicsError("--stats is empty: give a statistics file from tl-dynamics stats")
        out = files.check_output(args.out, example="stats.html", inputs=[("--stats", args.stats)])
        _args.check_suffix(args.out, (".html", ".htm"))
        if (why := files.not_a_file(args.stats)) is not None:  # named for what it is
            raise TLDynamicsError(f"statistics file {args.stats!r} {why}")
        from tl_dynamics.scale import load_stats, stats_page

        stats = load_stats(args.stats, allow_partial=args.allow_partial)
        if stats.n_prompts == 0:
            raise TLDynamicsError(
                f"statistics file {args.stats!r} holds 0 prompts (its corpus had none it could "
                "use): there is nothing to render; rerun tl-dynamics stats on a corpus with prompts"
            )
        path = stats_page(stats).write(out)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        again = _interrupt.command(["report", *argv])
        return _interrupt.stopped(
            exc,
            f"{time.perf_counter() - start:.1f} s in: nothing was written ({args.out} is as "
            f"it was); run it again with: {again}",
        )
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) for {stats!r}")
    return 0
