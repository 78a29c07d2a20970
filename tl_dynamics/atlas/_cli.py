"""``tl-dynamics heads --model M``: the atlas as a console table, and an HTML page with ``--out``."""

from __future__ import annotations

import argparse
import sys
import time

from tl_dynamics.errors import TLDynamicsError


def cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``heads`` command's options to ``parser``."""
    parser.add_argument("--model", default=None,
                        help="shipped model name (default code-2l), a local model folder, "
                             "'tiny-random[:arch]', or a hub name (online)")
    parser.add_argument("--prompt", default=None,
                        help="natural probe text for sinks and the causal losses (default: the "
                             "repeated random token sequences)")
    parser.add_argument("--seq-len", type=int, default=None, help="length of each random sequence")
    parser.add_argument("--n-seq", type=int, default=None, help="number of repeated probes")
    parser.add_argument("--no-causal", action="store_true", help="skip the interventions")
    parser.add_argument("--out", default=None, help="also write an offline HTML page here")


def cli_main(args: argparse.Namespace) -> int:
    """Run the ``heads`` command; returns the exit status."""
    from tl_dynamics import models, viz
    from tl_dynamics.atlas._api import compute
    from tl_dynamics.atlas._probes import N_SEQ, SEQ_LEN

    start = time.perf_counter()
    try:
        model, label = models.load_model(args.model)
        result = compute(model, args.prompt, n_seq=args.n_seq or N_SEQ,
                         seq_len=args.seq_len or SEQ_LEN, causal=not args.no_causal)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    frame = result.to_dataframe()
    columns = ["layer", "head", "role", "score", "baseline", "delta_loss", "delta_loss_prior",
               "delta_loss_likelihood", "roles"]
    print(f"Head atlas of {label} ({time.perf_counter() - start:.1f} s; a role needs its score "
          f"at least {result.margin} above the weight-shuffled control)")
    print(frame[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for note in result.notes:
        print(f"note: {note}")
    if args.out:
        page = viz.Page(f"Head atlas: {label}")
        page.add_section("What each head does", [result.show()])
        path = page.write(args.out)
        print(f"wrote {path}")
    return 0
