"""``tl-dynamics`` (also ``python -m tl_dynamics``): the command line.

Arguments first, imports later: everything that can be checked without torch (the output path,
the prompt, layers and heads as numbers, sections, threads, device and dtype as words, the model
name, a hub name that cannot load offline, layers, heads and token ids against the sizes the
model's config file states: ``_model_config``) is checked in milliseconds; then torch and
TransformerLens are imported and the model loads; then what needs the model (layers, heads,
token ids, the context length) is checked before any analysis runs.
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

HTML = (".html", ".htm")


def _architectures() -> str:
    return ", ".join(_model_names.tiny_architectures())


class _Versions(argparse.Action):
    """``--version``: the versions of the stack, read from the installed packages' metadata
    (``tl_dynamics.show_versions()`` also asks torch for the device: it imports torch)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        from tl_dynamics import compat

        compat.show_versions(device=False)
        parser.exit()


def _wrap(text: str) -> str:
    return textwrap.fill(text, 78, break_on_hyphens=False, break_long_words=False)


def _parser() -> argparse.ArgumentParser:
    from tl_dynamics import cli_stats, compat

    parser = argparse.ArgumentParser(prog="tl-dynamics", description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--version",
        action=_Versions,
        nargs=0,
        help="print the versions of tl-dynamics, Python, torch, transformers and "
        "TransformerLens, then exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        help="write a standalone offline HTML report (--stats FILE: the page of a statistics file)",
        description="Write one standalone offline HTML page about a model on a prompt; or, "
        "with --stats FILE, the page of a statistics file from `tl-dynamics stats`.",
        usage="tl-dynamics report [--model M] [--prompt TEXT] [--out report.html] [...]\n"
        "       tl-dynamics report --stats FILE [--out stats.html] [--allow-partial]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_wrap(
            f"tiny-random architectures on this TransformerLens "
            f"({compat.tl_version()}): {_architectures()}"
        ),
    )
    shipped = ", ".join(_model_names.shipped_names())
    report.add_argument(
        "--model",
        default=None,
        help=f"shipped model name ({shipped}; default {_model_names.DEFAULT_MODEL}; see "
        "`tl-dynamics models`), a Hugging Face or TransformerLens checkpoint folder, "
        "'tiny-random[:arch]' (architectures below), or a hub name (online)",
    )
    prompt = report.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        default=None,
        action="append",
        help="text to analyse; repeat it for several prompts, every section using them all or "
        "saying which it reads (default: the model's own)",
    )
    prompt.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="read the prompts from FILE, a UTF-8 text file with one prompt per line (blank "
        "lines skipped)",
    )
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
        help="analysis sections to include, comma-separated, from: "
        f"{', '.join(_registries.section_names())}; 'none' for the attention section only "
        "(default: all)",
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
    cli_stats.add_page_options(
        report.add_argument_group(
            "the page of a statistics file (tl-dynamics report --stats FILE [--out stats.html])"
        )
    )
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
    empty, not a directory, not under a file, not a file of the ``--model`` folder, named as
    an HTML page (or with no suffix), and in a folder that exists or can be created and is
    writable."""
    path = files.check_output(out, example="report.html", inputs=files.model_inputs(model))
    _args.check_suffix(out, HTML)
    return path


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
    """``--sections``: names of ``tl_dynamics.report.SECTIONS`` (read without importing it)."""
    valid = list(_registries.section_names())
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


def _prompt(args: argparse.Namespace) -> str | tuple[str, ...] | list[int] | None:
    """The prompt(s) asked for: one text, several (a tuple, from ``--prompt`` repeated or
    ``--prompts FILE``), token ids, or None (the model's default)."""
    if args.prompt_env is not None:
        if args.prompt_env not in os.environ:
            raise TLDynamicsError(f"--prompt-env {args.prompt_env}: no such environment variable")
        text = os.environ[args.prompt_env]
        return text if text else None  # `make report` without PROMPT: the model's default
    if args.prompt_ids is not None:
        return parse_ints(args.prompt_ids, "--prompt-ids")
    return _args.prompt_texts(args.prompt, args.prompts, "the model's default prompt")


def _models() -> int:
    print("Shipped models (tl-dynamics report --model NAME):")
    for name, description in _model_names.shipped_names().items():
        state = "installed" if _model_names.is_installed(name) else "optional, NOT installed"
        print(f"  {name:14s} [{state}] {description}")
    print(
        "Also: a Hugging Face model folder, a TransformerLens checkpoint folder, a hub name "
        "(online), or tiny-random[:ARCH] with ARCH one of:"
    )
    print(f"  {_architectures()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``tl-dynamics`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status
    (2 for a refused input, 130/143 when stopped by Ctrl-C/SIGTERM)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    with _interrupt.signals():
        try:
            return _dispatch(argv)
        except KeyboardInterrupt as exc:  # before a command's own account (imports, parsing)
            return _interrupt.stopped(exc, "nothing was written")


def _dispatch(argv: list[str]) -> int:
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

        run = cli_stats.cli_main if argv[0] == "stats" else cli_stats.report_main
        return run(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "models":
        return _models()
    return _report_command(args, argv)


def _report_command(args: argparse.Namespace, argv: list[str]) -> int:
    start = time.perf_counter()
    state = {
        "doing": "before the model loaded",
        "kept": f"nothing was written ({args.out} is as it was)",
    }
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
        _args.check_placement_text(args.device, args.dtype)
        figures = check_figures(args.figures) if args.figures is not None else None
        name = _loading.check_model(args.model)
        ids = prompt if isinstance(prompt, list) else None
        _model_config.check_selection(name, layers, heads, token_ids=ids)  # before torch
        path, label, failed = _report(
            name, prompt, out, layers, heads, sections, threads, (args.device, args.dtype),
            figures, state,
        )  # fmt: skip
    except TLDynamicsError as exc:
        print(f"tl-dynamics: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return _interrupt.stopped(
            exc,
            f"{time.perf_counter() - start:.1f} s in, {state['doing']}: {state['kept']}; "
            f"run it again with: {_interrupt.command(argv)}",
        )
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
    where: tuple[str, str] = ("auto", "auto"),
    figures: Path | None = None,
    state: dict[str, str] | None = None,
) -> tuple[Path, str, list[str]]:
    state = {} if state is None else state

    def progress(msg: str) -> None:
        if msg.startswith(("section ", "loading ")) and not msg.endswith(" s"):
            state["doing"] = f"while {msg.removesuffix(' ...')}"
        print(msg, file=sys.stderr)

    progress(f"loading {name or _model_names.DEFAULT_MODEL} ...")
    loaded, adapter, prompt = _loading.loaded_and_checked(
        name or _model_names.DEFAULT_MODEL, where, prompt, layers, heads
    )
    from tl_dynamics import report

    chosen = (
        report.SECTIONS
        if sections is None
        else tuple(analysis for analysis in report.SECTIONS if analysis.name in sections)
    )
    page = report.build_report(
        adapter,
        prompt,
        loaded.label,
        sections=chosen,
        progress=progress,
        layers=layers,
        heads=heads,
        threads=threads,
    )
    state["doing"] = f"while writing {out}"
    path = page.write(out)
    state["kept"] = f"{path} is written, the figures in {figures} are not all written"
    if figures is not None:
        state["doing"] = f"while writing figures to {figures}"
        progress(f"writing figures to {figures} ...")
        written = page.save_figures(figures)
        progress(
            f"wrote {sum(f.suffix == '.png' for f in written)} PNG and "
            f"{sum(f.suffix == '.svg' for f in written)} SVG files to {figures}"
        )
    return path, loaded.label, list(getattr(page, "failed_sections", []))
