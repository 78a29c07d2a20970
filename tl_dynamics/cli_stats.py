"""``tl-dynamics stats`` and ``tl-dynamics report --stats`` (hooked into ``tl_dynamics.cli``)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import Any

from tl_dynamics import _args, devices, files, sphere
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale import DatasetStats, load_stats, ray_stats, run_stats, stats_page


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


def stats_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tl-dynamics stats",
        description="Dataset-level statistics of a corpus (odds-ratio heads, trajectories), "
        "written to one statistics file (docs/stats-format.md). Under torchrun each "
        "rank takes a shard and rank 0 writes the same bytes.",
    )
    p.add_argument("--model", default="code-2l", help="model name or folder (as for report)")
    p.add_argument(
        "--prompts",
        required=True,
        help="corpus: a text file (one prompt per line) or JSON lines (.jsonl) with a 'text' field",
    )
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    p.add_argument(
        "--analyses",
        default=",".join(DatasetStats.ANALYSES),
        help=f"comma-separated, from {', '.join(DatasetStats.ANALYSES)} (default both)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", default=None, help='layers, e.g. "0,3" (default all)')
    p.add_argument("--heads", default=None, help='head indices in every layer, e.g. "0 2"')
    p.add_argument(
        "--eps",
        default=",".join(f"{e:g}" for e in sphere.TRAJECTORY_EPS_GRID),
        help="cluster thresholds (cos > 1 - eps)",
    )
    p.add_argument("--no-lens", action="store_true", help="skip the next-token statistics")
    p.add_argument("--padding-side", default="right", choices=("left", "right"))
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint next to --out (OUT.partial)",
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
        "--on-long",
        default="error",
        choices=DatasetStats.ON_LONG,
        help="a prompt longer than the model's context, or a line that is not UTF-8: "
        "stop with its file and line (error, the default), leave it out (skip), "
        "or keep the tokens that fit (truncate); both are counted in the file",
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


def cli_main(argv: list[str]) -> int:
    """``tl-dynamics stats ...``."""
    args = stats_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = files.check_output(
            args.out, example="stats.safetensors", inputs=[("--prompts", args.prompts)]
        )
        threads = _args.threads_arg(args.threads)
        batch_size = _args.positive_arg(args.batch_size, "--batch-size")
        checkpoint_every = _args.positive_arg(args.checkpoint_every, "--checkpoint-every")
        if args.max_batches is not None and args.max_batches < 0:
            raise TLDynamicsError(f"--max-batches {args.max_batches}: give 0 or more")
        devices.resolve_dtype(args.dtype, "--dtype")
        if args.ray is not None:
            stats = _on_ray(args, out, threads, batch_size, checkpoint_every)
        else:
            if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:  # torchrun: run_stats checks
                devices.resolve_device(args.device, "--device")  # before the model loads
            stats = _run(args, out, threads, batch_size, checkpoint_every)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the run
        state = f"wrote {out}" if out.is_file() else f"stopped early (checkpoint {out}.partial)"
        left = ", ".join(f"{k} {n}" for k, n in sorted(stats.skipped.items()) if n)
        print(
            f"{state}: {stats.n_prompts} prompts in {time.perf_counter() - start:.1f} s"
            + (f" (corpus lines not used whole: {left})" if left else "")
        )
    return 0


def _common(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "analyses": [a.strip() for a in args.analyses.split(",") if a.strip()],
        "layers": _ints(args.layers, "--layers"),
        "heads": _ints(args.heads, "--heads"),
        "eps": _floats(args.eps, "--eps"),
        "lens": not args.no_lens,
        "padding_side": args.padding_side,
        "progress": not args.no_progress,
        "on_long": args.on_long,
    }


def _on_ray(args: argparse.Namespace, out: Any, threads: Any, batch_size: int, every: int) -> Any:
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
        **_common(args),
    )


def _run(args: argparse.Namespace, out: Any, threads: Any, batch_size: int, every: int) -> Any:
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
        **_common(args),
    )


def report_main(argv: list[str]) -> int:
    """``tl-dynamics report --stats FILE [--out page.html]``: the dataset page."""
    p = argparse.ArgumentParser(
        prog="tl-dynamics report --stats",
        description="Render a statistics file as an offline HTML page.",
    )
    p.add_argument("--stats", required=True, help="statistics file from `tl-dynamics stats`")
    p.add_argument("--out", default="stats.html", help="output HTML file (default stats.html)")
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="render an unfinished run's checkpoint (OUT.partial) too",
    )
    args = p.parse_args(argv)
    try:
        out = files.check_output(args.out, example="stats.html", inputs=[("--stats", args.stats)])
        stats = load_stats(args.stats, allow_partial=args.allow_partial)
        path = stats_page(stats).write(out)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) for {stats!r}")
    return 0
