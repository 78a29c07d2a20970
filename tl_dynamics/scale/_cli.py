"""``tl-dynamics stats`` and ``tl-dynamics report --stats`` (hooked into ``tl_dynamics.cli``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from tl_dynamics import devices, sphere
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._distributed import rank_device
from tl_dynamics.scale._format import ANALYSES, load_stats
from tl_dynamics.scale._page import stats_page
from tl_dynamics.scale._run import run_stats


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise TLDynamicsError(f"{what} {text!r}: expected non-negative integers separated by "
                              'spaces or commas, e.g. "0 3 11"')
    return [int(p) for p in parts]


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(p) for p in re.split(r"[\s,]+", text.strip()) if p]
    except ValueError:
        values = []
    if not values:
        raise TLDynamicsError(f"{what} {text!r}: expected numbers separated by commas, e.g. "
                              '"0.05,0.1"')
    return values


def stats_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tl-dynamics stats",
        description="Dataset-level statistics of a corpus (odds-ratio heads, trajectories), "
                    "written to one statistics file (docs/stats-format.md). Under torchrun each "
                    "rank takes a shard and rank 0 writes the same bytes.")
    p.add_argument("--model", default="code-2l", help="model name or folder (as for report)")
    p.add_argument("--prompts", required=True,
                   help="corpus: a text file (one prompt per line) or JSON lines (.jsonl) with a "
                        "'text' field")
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    p.add_argument("--analyses", default=",".join(ANALYSES),
                   help=f"comma-separated, from {', '.join(ANALYSES)} (default both)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", default=None, help='layers, e.g. "0,3" (default all)')
    p.add_argument("--heads", default=None, help='head indices in every layer, e.g. "0 2"')
    p.add_argument("--eps", default=",".join(f"{e:g}" for e in sphere.TRAJECTORY_EPS_GRID),
                   help="cluster thresholds (cos > 1 - eps)")
    p.add_argument("--no-lens", action="store_true", help="skip the next-token statistics")
    p.add_argument("--padding-side", default="right", choices=("left", "right"))
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint next to --out (OUT.partial)")
    p.add_argument("--checkpoint-every", type=int, default=8, help="batches between checkpoints")
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop (checkpointed) after this many new batches; finish with --resume")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--no-progress", action="store_true")
    devices.add_options(p)  # under torchrun: auto/cuda = cuda:LOCAL_RANK (NCCL), cuda:N shared (gloo)
    return p


def cli_main(argv: list[str]) -> int:
    """``tl-dynamics stats ...``."""
    args = stats_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = Path(args.out)
        if out.is_dir():
            raise TLDynamicsError(f"--out {args.out!r} is a directory: give a file path, e.g. "
                                  f"{out / 'stats.safetensors'}")
        rank_device(args.device, "--device")  # checked before the model loads
        devices.resolve_dtype(args.dtype, "--dtype")
        stats = run_stats(args.model, args.prompts, out,
                          analyses=[a.strip() for a in args.analyses.split(",") if a.strip()],
                          batch_size=args.batch_size, layers=_ints(args.layers, "--layers"),
                          heads=_ints(args.heads, "--heads"), eps=_floats(args.eps, "--eps"),
                          lens=not args.no_lens, padding_side=args.padding_side,
                          resume=args.resume, checkpoint_every=args.checkpoint_every,
                          max_batches=args.max_batches, progress=not args.no_progress,
                          threads=args.threads, device=args.device, dtype=args.dtype)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the run
        state = f"wrote {out}" if out.is_file() else f"stopped early (checkpoint {out}.partial)"
        print(f"{state}: {stats.n_prompts} prompts in {time.perf_counter() - start:.1f} s")
    return 0


def report_main(argv: list[str]) -> int:
    """``tl-dynamics report --stats FILE [--out page.html]``: the dataset page."""
    p = argparse.ArgumentParser(prog="tl-dynamics report --stats",
                                description="Render a statistics file as an offline HTML page.")
    p.add_argument("--stats", required=True, help="statistics file from `tl-dynamics stats`")
    p.add_argument("--out", default="stats.html", help="output HTML file (default stats.html)")
    args = p.parse_args(argv)
    try:
        stats = load_stats(args.stats)
        path = stats_page(stats).write(args.out)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) for {stats!r}")
    return 0
