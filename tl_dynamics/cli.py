"""``tl-dynamics`` (also ``python -m tl_dynamics``): the command line."""

from __future__ import annotations

import argparse
import os
import sys
import time

from tl_dynamics.errors import TLDynamicsError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tl-dynamics", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="write a standalone offline HTML report")
    report.add_argument("--model", default=None,
                        help="shipped model name (see `tl-dynamics models`; default code-2l), a "
                             "local model folder, 'tiny-random[:arch]', or a hub name (online)")
    report.add_argument("--prompt", default=None, help="text to analyse (default: a short Python snippet)")
    report.add_argument("--out", default="report.html", help="output HTML file (default report.html)")
    sub.add_parser("models", help="list the shipped models")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tl_dynamics import models

    if args.command == "models":
        for name, description in models.shipped_names().items():
            print(f"{name:14s} {description}")
        return 0
    from tl_dynamics import report

    start = time.perf_counter()
    try:
        model, label = models.load_model(args.model)
        path = report.write_report(args.out, model, args.prompt or report.DEFAULT_PROMPT, label,
                                   progress=lambda msg: print(msg, file=sys.stderr))
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) for {label} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
