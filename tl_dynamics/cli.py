"""``tl-dynamics`` (also ``python -m tl_dynamics``): the command line.

Every input is checked before the model loads: the output path, the prompt, the layers and heads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from tl_dynamics import _args, devices, files
from tl_dynamics.errors import TLDynamicsError


def _architectures() -> str:
    from tl_dynamics import models

    return ", ".join(models.tiny_architectures())


class _Versions(argparse.Action):
    """``--version``: ``tl_dynamics.show_versions()`` (read only when asked: it imports torch)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        from tl_dynamics import compat

        compat.show_versions()
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    from tl_dynamics import compat

    parser = argparse.ArgumentParser(prog="tl-dynamics", description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--version",
        action=_Versions,
        nargs=0,
        help="print the versions of tl-dynamics, Python, torch, transformers and "
        "TransformerLens, and the device torch sees, then exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        help="write a standalone offline HTML report",
        description="Write one standalone offline HTML page about a model on a prompt.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.fill(
            f"tiny-random architectures on this TransformerLens "
            f"({compat.tl_version()}): {_architectures()}",
            78,
            break_on_hyphens=False,
            break_long_words=False,
        ),
    )
    report.add_argument(
        "--model",
        default=None,
        help="shipped model name (see `tl-dynamics models`; default code-2l), a "
        "Hugging Face or TransformerLens checkpoint folder, "
        "'tiny-random[:arch]' (architectures below), or a hub name (online)",
    )
    prompt = report.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text to analyse (default: the model's own)")
    prompt.add_argument(
        "--prompt-ids",
        default=None,
        help='token ids separated by spaces or commas, e.g. "300 5 17" (for models '
        "without a tokenizer)",
    )
    prompt.add_argument(
        "--prompt-env",
        default=None,
        metavar="NAME",
        help="read the prompt text from environment variable NAME (`make report` "
        "uses this, so the shell never interprets the prompt)",
    )
    report.add_argument(
        "--out", default="report.html", help="output HTML file (default report.html)"
    )
    report.add_argument(
        "--layers",
        default=None,
        help='layers shown in the attention section, e.g. "0,3,11" (default all)',
    )
    report.add_argument(
        "--heads",
        default=None,
        help='heads whose full patterns are kept, e.g. "L3H4,L5H1" or "3.4 5.1" '
        "(default: the heads the statistics single out)",
    )
    report.add_argument(
        "--sections",
        default=None,
        help="analysis sections to include, comma-separated, from: atlas, circuits, "
        "odds_ratio, contextual_mlp, trajectories, particles; 'none' for the "
        "attention section only (default: all)",
    )
    report.add_argument(
        "--figures",
        default=None,
        metavar="DIR",
        help="also write every figure of the page into DIR as PNG (headless "
        "chromium) and, for heat maps, attention maps and line plots, SVG",
    )
    report.add_argument(
        "--threads",
        default="auto",
        help="torch intra-op threads while building: a positive integer, or "
        "'auto' (default: one per core, or 1 when the machine is busy)",
    )
    devices.add_options(report)
    sub.add_parser(
        "models",
        help="list the shipped models, what is installed, and the tiny random architectures",
    )
    sub.add_parser(
        "heads",
        help="what every head does, as a table (--out: an HTML page); "
        "`tl-dynamics heads --help` lists its options",
    )
    sub.add_parser(
        "stats",
        help="dataset-level statistics of a corpus to one file (torchrun for "
        "many processes); `tl-dynamics report --stats FILE` renders it",
    )
    return parser


def check_out(out: str, model: str | None = None) -> Path:
    """The output file, checked before any work (``tl_dynamics.files.check_output``): not
    empty, not a directory, not under a file, not a file of the ``--model`` folder, and in a
    folder that exists or can be created and is writable."""
    return files.check_output(out, example="report.html", inputs=files.model_inputs(model))


def check_figures(folder: str) -> Path:
    """The ``--figures`` folder, checked before any work: not a file, and creatable/writable."""
    path = Path(folder).expanduser()
    if not folder.strip() or path.exists() and not path.is_dir():
        raise TLDynamicsError(f"--figures {folder!r}: give a folder for the PNG and SVG files")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise TLDynamicsError(f"--figures {folder!r}: {parent} is not a writable folder")
    return path


def parse_ints(text: str, what: str) -> list[int]:
    return _args.token_ids(text, what)


def parse_heads(text: str) -> list[tuple[int, int]]:
    return _args.head_pairs(text)


def parse_sections(text: str) -> list[str]:
    from tl_dynamics import report

    valid = [analysis.name for analysis in report.SECTIONS]
    names = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise TLDynamicsError(
            f"--sections {text!r}: unknown {unknown or 'empty'}; valid: "
            f"{', '.join(valid)}, or 'none'"
        )
    return names


def _prompt(args: argparse.Namespace) -> str | list[int] | None:
    if args.prompt_env is not None:
        if args.prompt_env not in os.environ:
            raise TLDynamicsError(f"--prompt-env {args.prompt_env}: no such environment variable")
        text = os.environ[args.prompt_env]
        return text if text else None  # `make report` without PROMPT: the model's default
    if args.prompt_ids is not None:
        return parse_ints(args.prompt_ids, "--prompt-ids")
    if args.prompt is not None and not args.prompt.strip():
        raise TLDynamicsError(
            "--prompt is empty: give some text, or leave --prompt out for the "
            "model's default prompt"
        )
    return args.prompt


def _models() -> int:
    from tl_dynamics import models

    print("Shipped models (tl-dynamics report --model NAME):")
    for name, description in models.shipped_names().items():
        state = "installed" if models.is_installed(name) else "optional, NOT installed"
        print(f"  {name:14s} [{state}] {description}")
    print(
        "Also: a Hugging Face model folder, a TransformerLens checkpoint folder, a hub name "
        "(online), or tiny-random[:ARCH] with ARCH one of:"
    )
    print(f"  {_architectures()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["heads"]:  # its own parser, in tl_dynamics.cli_heads
        from tl_dynamics import cli_heads

        return cli_heads.cli_main(argv[1:])
    if argv[:1] == ["stats"] or (
        argv[:1] == ["report"]
        and any(  # dataset scale: tl_dynamics.cli_stats
            a == "--stats" or a.startswith("--stats=") for a in argv
        )
    ):
        from tl_dynamics import cli_stats

        main = cli_stats.cli_main if argv[0] == "stats" else cli_stats.report_main
        return main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "models":
        return _models()
    start = time.perf_counter()
    try:
        out = check_out(args.out, args.model)
        prompt = _prompt(args)
        layers = parse_ints(args.layers, "--layers") if args.layers is not None else None
        heads = parse_heads(args.heads) if args.heads is not None else None
        if layers is not None and heads and any(layer not in layers for layer, _ in heads):
            raise TLDynamicsError(
                f"--heads {args.heads!r} names heads outside --layers "
                f"{args.layers!r}: add their layers or drop them"
            )
        sections = parse_sections(args.sections) if args.sections is not None else None
        threads = parse_threads(args.threads)
        where = devices.placement(args.device, args.dtype, cli=True)
        figures = check_figures(args.figures) if args.figures is not None else None
        path, label, failed = _report(
            args.model, prompt, out, layers, heads, sections, threads, where, figures
        )
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    if failed:  # the page is written (it shows what failed) but the run did not succeed
        print(
            f"tl-dynamics: error: wrote {path}, but its sections {', '.join(failed)} failed "
            "(see the messages above and on the page)",
            file=sys.stderr,
        )
        return 1
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) for {label} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


def parse_threads(text: str) -> int | str:
    return _args.threads_arg(text, allow_auto=True)


def _report(
    name: str | None,
    prompt: Any,
    out: Path,
    layers: list[int] | None,
    heads: list[tuple[int, int]] | None,
    sections: list[str] | None,
    threads: int | str = "auto",
    where: devices.Placement | None = None,
    figures: Path | None = None,
) -> tuple[Path, str, list[str]]:
    from tl_dynamics import models, report

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    progress(f"loading {name or models.DEFAULT_MODEL} ...")
    loaded = models.resolve(name, where)
    if prompt is None:
        prompt = loaded.default_prompt
    if isinstance(prompt, str) and not loaded.has_tokenizer:
        raise TLDynamicsError(
            f"{loaded.label} has no tokenizer: give the prompt as token ids, "
            'e.g. --prompt-ids "300 5 17"'
        )
    if isinstance(prompt, list):  # before any section runs: no page of failed sections
        _args.check_vocab(prompt, int(loaded.model.cfg.d_vocab))
    chosen = (
        report.SECTIONS
        if sections is None
        else tuple(analysis for analysis in report.SECTIONS if analysis.name in sections)
    )
    page = report.build_report(
        loaded.model,
        prompt,
        loaded.label,
        sections=chosen,
        progress=progress,
        layers=layers,
        heads=heads,
        threads=threads,
    )
    path = page.write(out)
    if figures is not None:
        progress(f"writing figures to {figures} ...")
        written = page.save_figures(figures)
        progress(
            f"wrote {sum(f.suffix == '.png' for f in written)} PNG and "
            f"{sum(f.suffix == '.svg' for f in written)} SVG files to {figures}"
        )
    return path, loaded.label, list(getattr(page, "failed_sections", []))
