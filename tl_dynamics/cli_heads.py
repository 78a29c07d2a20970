"""``tl-dynamics heads --model M`` (hooked into ``tl_dynamics.cli``): the atlas as a console
table, and an HTML page with ``--out``."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from typing import Any

from tl_dynamics import _args, _interrupt, _loading, _model_config, _model_names, devices, files
from tl_dynamics.errors import TLDynamicsError

TABLE_COLUMNS = [
    "layer",
    "head_index",
    "role",
    "score",
    "baseline",
    "delta_loss",
    "delta_loss_low",
    "delta_loss_high",
    "delta_loss_atp",
    "delta_loss_prior",
    "delta_loss_likelihood",
    "roles",
]


def cli_parser() -> argparse.ArgumentParser:
    """The ``tl-dynamics heads`` options."""
    parser = argparse.ArgumentParser(
        prog="tl-dynamics heads",
        description="What every head does: roles from pattern and "
        "mechanism against a weight-shuffled control, and the loss change when each head is "
        "mean-ablated or its pattern is replaced by the prior-only / likelihood-only one.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"shipped model name ({', '.join(_model_names.shipped_names())}; default "
        f"{_model_names.DEFAULT_MODEL}), a model folder, 'tiny-random[:arch]', or a hub name "
        "(online)",
    )
    parser.add_argument(
        "--prompt",
        default=None,
        action="append",
        help="natural probe text for sinks, locality and the causal losses; repeat it for "
        "several (a role read on them needs at least 8; default: the repeated random token "
        "sequences, which need no tokenizer)",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="read the natural probes from FILE, one prompt per line (blank lines skipped)",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="length of each random sequence")
    parser.add_argument("--n-seq", type=int, default=None, help="number of repeated probes")
    parser.add_argument(
        "--layers",
        default=None,
        help='layers whose heads are measured, e.g. "0,1" (default all), as atlas.compute takes',
    )
    parser.add_argument(
        "--heads",
        default=None,
        help='heads measured: indices in every measured layer, e.g. "1,3", or heads as '
        '`tl-dynamics report` names them, e.g. "L1H3,L1H1" (default all)',
    )
    parser.add_argument("--no-causal", action="store_true", help="skip the interventions")
    parser.add_argument("--out", default=None, help="also write an offline HTML page here")
    devices.add_options(parser)
    return parser


# What each number of the table is (printed under it, and on the --out page).
COLUMN_NOTES = (
    "score, baseline: the top role's score and the same score on the weight-shuffled control",
    "delta_loss = loss with the head mean-ablated - clean loss (next-token cross-entropy, nats "
    "per token, on the probes; > 0: the model needs the head), with its 95% interval over the "
    "probes (delta_loss_low, delta_loss_high); NaN where the head was not ablated exactly",
    "delta_loss_atp = the same estimated for every head by attribution patching (one forward "
    "and one backward pass); the heads it ranks first, and every head named with --heads, are "
    "ablated exactly",
    "delta_loss_prior, delta_loss_likelihood = loss with the head's pattern replaced by its "
    "prior-only / likelihood-only counterfactual - clean loss (nats per token)",
)


def cli_main(argv: list[str] | None = None) -> int:
    """Run ``tl-dynamics heads`` with ``argv`` (its arguments); returns the exit status.

    Example:
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()) as printed:
        ...     status = cli_main(["--model", "induction-2l", "--no-causal", "--device", "cpu"])
        >>> status, "induction" in printed.getvalue()
        (0, True)
    """
    args = cli_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = None
        if args.out is not None:
            out = files.check_output(
                args.out, example="heads.html", inputs=files.model_inputs(args.model)
            )
            _args.check_suffix(args.out, (".html", ".htm"))
        n_seq = _args.positive_arg(args.n_seq, "--n-seq")
        seq_len = _args.positive_arg(args.seq_len, "--seq-len")
        prompt = _args.prompt_texts(args.prompt, args.prompts, "the repeated random token probes")
        layers, heads, pairs = selection(args.layers, args.heads)
        _args.check_placement_text(args.device, args.dtype)
        name = _loading.check_model(args.model)
        _model_config.check_selection(  # before torch
            name, layers, sorted(pairs) if pairs else None, heads if not pairs else None
        )
        loaded, adapter, _ = _loading.loaded_and_checked(
            name,
            (args.device, args.dtype),
            prompt,
            layers=layers,
            heads=sorted(pairs) if pairs else None,
            head_indices=heads if not pairs else None,
            default_prompt=False,  # the repeated random-token probes
        )
        from tl_dynamics import atlas, viz

        sizes = {k: v for k, v in (("n_seq", n_seq), ("seq_len", seq_len)) if v is not None}
        # L<l>H<h> names: exactly those heads are measured and ablated, not their layers' grid
        result = atlas.compute(
            adapter,
            list(prompt) if isinstance(prompt, tuple) else prompt,
            layers=layers if pairs is None else None,
            heads=heads if pairs is None else sorted(pairs),
            causal=not args.no_causal,
            **sizes,
        )
        notes = list(COLUMN_NOTES) if not args.no_causal else list(COLUMN_NOTES[:1])
        off = off_distribution(result, int(loaded.model.cfg.d_vocab), prompt is None)
        notes += [off] if off else []
        path = None
        if out is not None:
            page = viz.Page(f"Head atlas: {loaded.label}")
            page.add_section(
                "What each head does", [viz.text("; ".join(notes) + "."), result.show()]
            )
            path = page.write(out)
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        written = "" if args.out is None else f" ({args.out} is as it was)"
        return _interrupt.stopped(
            exc,
            f"{time.perf_counter() - start:.1f} s in: nothing was written{written}; run it "
            f"again with: {_interrupt.command(['heads', *(argv or [])])}",
        )
    frame = result.to_dataframe()
    print(
        f"Head atlas of {loaded.label} ({time.perf_counter() - start:.1f} s; a role needs its "
        f"score at least {result.margin} above the weight-shuffled control)"
    )
    columns = [c for c in TABLE_COLUMNS if not (args.no_causal and c.startswith("delta_loss"))]
    # pandas documents a one-argument function for float_format; its types say str only
    print(frame[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))  # pyright: ignore[reportArgumentType]
    for note in [*notes, *result.notes]:
        print(f"note: {note}")
    if path is not None:
        print(f"wrote {path}")
    return 0


def off_distribution(result: Any, d_vocab: int, default_probe: bool) -> str | None:
    """A note when the probes' clean loss is no better than a uniform guess over the vocabulary
    (ln d_vocab): the causal columns then measure the model off its own distribution.

    >>> class R: clean_loss = 12.0
    >>> "measured off this model's distribution" in off_distribution(R(), 4096, True)
    True
    """
    clean = float(getattr(result, "clean_loss", float("nan")))
    uniform = math.log(d_vocab)
    if not clean >= uniform:  # NaN (no causal run) included
        return None
    probe = "the repeated random-token probes" if default_probe else "the given prompt"
    hint = (
        "; give --prompt with text like its training data"
        if default_probe
        else "; give text like its training data"
    )
    return (
        f"the causal columns are measured off this model's distribution: its clean loss on "
        f"{probe} is {clean:.1f} nats per token, no better than a uniform guess over its "
        f"{d_vocab} tokens ({uniform:.1f} = ln {d_vocab}){hint}"
    )


def selection(
    layers_text: str | None, heads_text: str | None
) -> tuple[list[int] | None, list[int] | None, set[tuple[int, int]] | None]:
    """``--layers`` and ``--heads`` as ``atlas.compute`` takes them, and the exact heads named
    when ``--heads`` names them as ``L<layer>H<head>`` (their layers, and their head indices in
    those layers; the table keeps only the pairs named).

    >>> selection("0,1", "2"), selection(None, "L1H3,L1H1")
    (([0, 1], [2], None), ([1], [1, 3], {(1, 1), (1, 3)}))
    """
    layers = _args.token_ids(layers_text, "--layers") if layers_text is not None else None
    if heads_text is None:
        return layers, None, None
    parts = [p for p in re.split(r"[\s,]+", heads_text.strip()) if p]
    if parts and all(p.isascii() and p.isdigit() for p in parts):
        return layers, [int(p) for p in parts], None
    pairs = set(_args.head_pairs(heads_text))  # as `tl-dynamics report --heads` reads them
    if layers is not None and any(layer not in layers for layer, _ in pairs):
        raise TLDynamicsError(
            f"--heads {heads_text!r} names heads outside --layers {layers_text!r}: add their "
            "layers or drop them"
        )
    chosen = sorted({layer for layer, _ in pairs}) if layers is None else layers
    return chosen, sorted({head for _, head in pairs}), pairs
