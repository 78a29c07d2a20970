"""Every GPU figure of issue 22's targets, written as one markdown file (benchmarks/README.md,
"GPU targets (issue 22)"). Each part runs in its own process, so one that fails (out of memory,
say) is recorded as failed and the others still run:

- ``attach-gpt2``: ``cost_bench.py --only attach`` on the GPT-2-small shape, float32, 4 x 256 and
  1 x 1,024 (targets: each analysis attached <= 1.3x a plain forward, all three <= 1.5x);
- ``attach-1b``: ``cost_bench.py --shape llama-1b``, bfloat16, 1 x 2,048 and 8 x 512 (<= 1.2x);
- ``attach-8b``: ``cost_bench.py --shape llama-8b``, bfloat16, 1 x 4,096 (fits in 80 GB, <= 1.3x);
- ``report-8b``: the ``tl-dynamics report`` command's work on the 8B shape at 2,048 tokens, in
  one process from its start: the weights drawn on the device (never written to disk), then
  ``report.build_report`` and ``page.write`` (<= 120 s, page <= 30 MB);
- ``heads-1b``: ``atlas.compute`` (what ``tl-dynamics heads`` runs) on the 1B shape, drawn on the
  device (<= 3x one run_with_cache plus one forward per ablated head, both measured here on the
  atlas's own probe tokens);
- ``stats-gpt2``: ``run_stats`` on the GPT-2-small shape, 1,000 prompts x 256 tokens, both
  analyses (>= 70% of the plain forward's prompts per second over the same batches), and the
  ``tl-dynamics stats --device cuda`` command on the same corpus.

    python benchmarks/gpu_bench.py --device cuda --out gpu-results.md            # all parts
    python benchmarks/gpu_bench.py --device cuda --only report-8b --only heads-1b  # some parts
    python benchmarks/gpu_bench.py --device cpu --tiny --repeats 1                 # CPU smoke

``--tiny`` (or ``TL_DYNAMICS_GPU_SCALE=tiny`` in the environment: ``make gpu-dry-run``) runs every
part on the shapes' 2-layer, d_model-256 versions with short inputs (128 tokens for the report,
40 prompts x 64 tokens for the statistics): a check that the driver works, not a measurement.
Only the GPT-2-small shape is written to a folder under ``--root`` (for the ``stats`` command);
the Llama shapes are drawn on the device (``shapes.build``). Each part prints one summary line,
``ROW | part | measured | target | verdict |``, that ``benchmarks/gpu_check.sh`` gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # the report part counts from its process start
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("attach-gpt2", "attach-1b", "attach-8b", "report-8b", "heads-1b", "stats-gpt2")
TARGETS = {
    "attach-gpt2": "each analysis attached <= 1.3x a plain forward, all three <= 1.5x",
    "attach-1b": "all three attached <= 1.2x a plain forward",
    "attach-8b": "all three attached fit in 80 GB at <= 1.3x a plain forward",
    "report-8b": "<= 120 s, page <= 30 MB",
    "heads-1b": "<= 3x (one run_with_cache + one forward per ablated head)",
    "stats-gpt2": ">= 70% of the plain forward's prompts per second",
}


def _env() -> dict[str, str]:
    """The checkout's tl_dynamics first, offline."""
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(
        os.environ,
        PYTHONPATH=path,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def _run(argv: list[str], timeout: float) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            argv, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        code, text = (
            proc.returncode,
            proc.stdout + ("" if proc.returncode == 0 else "\n" + proc.stderr[-4000:]),
        )
    except subprocess.TimeoutExpired as exc:
        code, text = 124, f"timed out after {timeout:.0f} s\n{(exc.stdout or b'')[-2000:]!r}"
    return code, text, time.perf_counter() - start


def _cost_bench(args: argparse.Namespace, shape: str) -> tuple[int, str, float]:
    argv = [
        sys.executable,
        str(HERE / "cost_bench.py"),
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--root",
        args.root,
    ]
    if shape == "gpt2-small" and not args.tiny:
        argv += ["--only", "attach"]
    else:
        argv += ["--shape", shape] + (["--tiny"] if args.tiny else [])
    return _run(argv, args.timeout)


def _prompt_ids(n: int, vocab: int) -> str:
    import random

    rng = random.Random(0)
    return " ".join(str(rng.randrange(1, vocab)) for _ in range(n))


ROWS: list[str] = []  # this run's summary lines (main appends them to --rows)


def _row(part: str, measured: str, target: str, ok: bool, code: int, text: str = "") -> None:
    """One summary line of a part: what it measured against its target, or why it has no
    figure (out of time, out of memory, failed)."""
    if code == 124:
        verdict = "TIMEOUT"
    elif "OutOfMemoryError" in text or "out of memory" in text:
        verdict = "OUT OF MEMORY"
    elif code != 0:
        verdict = f"FAILED (exit {code})"
    else:
        verdict = "meets" if ok else "MISSES"
    line = f"ROW | {part} | {measured} | {target} | {verdict} |"
    ROWS.append(line)
    print(line, file=sys.stderr, flush=True)


def _child(name: str, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(HERE / "gpu_bench.py"), name, "--device", args.device]
    argv += ["--root", args.root, "--threads", str(args.threads)]
    return argv + (["--tiny"] if args.tiny else [])


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return {}
    return {}


def _sync(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def attach_rows(part: str, code: int, text: str) -> None:
    """The summary line of an ``attach-*`` part, read off cost_bench's tables: the ratios
    (``x plain``) of each token shape, and the peak CUDA memory where it prints one."""
    tables: list[tuple[str, dict[str, float]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            tables.append((line[3:].split("  (")[0], {}))
        elif line.startswith("| ") and tables and line.split("|")[3].strip().endswith("x"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            tables[-1][1][cells[0]] = float(cells[2].rstrip("x"))
    peak = re.search(r"peak CUDA memory allocated in this process: ([0-9.]+) GiB", text)
    measured, ok = [], bool(tables)
    for title, ratios in tables:
        three = next((v for k, v in ratios.items() if k.startswith("all three")), float("nan"))
        each = [v for k, v in ratios.items() if ".attach" in k and "result()" not in k]
        shape = title.split("batch ")[-1]
        if part == "attach-gpt2":
            ok &= three <= 1.5 and all(v <= 1.3 for v in each)
            measured.append(
                f"{shape}: each {'/'.join(f'{v:.2f}' for v in each)}x, all {three:.2f}x"
            )
        else:
            ok &= three <= (1.2 if part == "attach-1b" else 1.3)
            measured.append(f"{shape}: all three {three:.2f}x")
    if peak:
        measured.append(f"peak {float(peak.group(1)):.1f} GiB")
        ok &= part != "attach-8b" or float(peak.group(1)) * 2**30 <= 80e9
    _row(part, "; ".join(measured) or "no table", TARGETS[part], ok, code, text)


def part_report(args: argparse.Namespace) -> str:
    code, text, wall = _run(_child("_report", args), args.timeout)
    numbers = _last_json(text)
    total, size = numbers.get("total_s", float("nan")), numbers.get("page_mb", float("nan"))
    ok = code == 0 and total <= 120 and size <= 30
    _row(
        "report-8b",
        f"{total:.1f} s from the script's start (draw {numbers.get('draw_s', float('nan')):.1f} s, "
        f"report {numbers.get('report_s', float('nan')):.1f} s), page {size:.1f} MB",
        TARGETS["report-8b"],
        ok,
        code,
        text,
    )
    return (
        f"`report.build_report` on the llama-8b{'-tiny' if args.tiny else ''} shape, "
        f"{numbers.get('tokens', '?')} prompt ids, device {args.device}: exit {code}, "
        f"**{total:.1f} s** from the script's start (imports, weights drawn on the device, build, "
        f"write), page **{size:.1f} MB** ({'meets' if ok else 'MISSES'} the target)\n\n"
        f"```\n{text.strip()[-3000:]}\n```\n"
    )


def report_child(args: argparse.Namespace, started: float) -> None:
    """(A child process.) What ``tl-dynamics report`` does, on the 8B shape drawn on the
    device: build the page, write it; prints one JSON line of timings."""
    import shapes
    from tl_dynamics import report

    start = time.perf_counter()
    model = shapes.build("llama-8b", args.root, args.device, tiny=args.tiny)
    _sync(args)
    drawn = time.perf_counter()
    n_pos = 128 if args.tiny else 2048
    ids = [int(i) for i in _prompt_ids(n_pos, 500).split()]
    page = report.build_report(
        model, ids, "llama-8b shape, random weights", progress=lambda m: print(m, file=sys.stderr)
    )
    out = page.write(Path(args.root) / "report-8b.html")
    done = time.perf_counter()
    print(
        json.dumps(
            {
                "tokens": n_pos,
                "draw_s": drawn - start,
                "report_s": done - drawn,
                "total_s": done - started,
                "page_mb": Path(out).stat().st_size / 1e6,
                "failed_sections": list(getattr(page, "failed_sections", [])),
            }
        )
    )


def part_heads(args: argparse.Namespace) -> str:
    code, text, wall = _run(_child("_heads_reference", args), args.timeout)
    numbers = _last_json(text)
    reference = numbers.get("reference_s", float("nan"))
    atlas_s = numbers.get("atlas_s", float("nan"))
    ratio = atlas_s / reference
    _row("heads-1b", f"{ratio:.2f}x ({atlas_s:.2f} s)", TARGETS["heads-1b"], ratio <= 3, code, text)
    return (
        f"llama-1b{'-tiny' if args.tiny else ''} shape drawn on {args.device} (exit {code}, "
        f"{wall:.1f} s wall): `atlas.compute` **{atlas_s:.2f} s**; "
        f"one run_with_cache {numbers.get('cache_s', float('nan')):.3f} s + "
        f"{numbers.get('heads', '?')} ablated heads x one forward "
        f"{numbers.get('forward_s', float('nan')):.4f} s = {reference:.2f} s; ratio "
        f"**{ratio:.2f}x** (target <= 3x: {'meets' if ratio <= 3 else 'MISSES'}); probe tokens "
        f"{numbers.get('tokens')}\n\n```\n{text.strip()[-2500:]}\n```\n"
    )


def heads_reference(args: argparse.Namespace) -> None:
    """(A child process.) The atlas on the 1B shape next to one run_with_cache plus one forward
    per ablated head on the atlas's own natural probe tokens; prints one JSON line."""
    import torch

    import shapes
    from tl_dynamics import atlas

    model = shapes.build("llama-1b", args.root, args.device, tiny=args.tiny)
    sync = lambda: _sync(args)  # noqa: E731
    atlas.compute(model, n_seq=2, seq_len=8)  # warm-up
    sync()
    start = time.perf_counter()
    result = atlas.compute(model)
    sync()
    atlas_s = time.perf_counter() - start
    shape = result.probes["natural_tokens"]
    tokens = torch.randint(1, 500, shape, generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(args.device)

    def timed(fn, repeats: int = 5) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            with torch.no_grad():
                fn()
        sync()
        return (time.perf_counter() - start) / repeats

    cache_s = timed(lambda: model.run_with_cache(tokens))
    forward_s = timed(lambda: model(tokens))
    heads = len(result.layers) * len(result.heads)
    print(
        json.dumps(
            {
                "atlas_s": atlas_s,
                "cache_s": cache_s,
                "forward_s": forward_s,
                "heads": heads,
                "reference_s": cache_s + heads * forward_s,
                "tokens": list(shape),
            }
        )
    )


def corpus(n_prompts: int, n_tokens: int) -> list[str]:
    """``n_prompts`` distinct texts of about ``n_tokens`` tokens of the test tokenizer each."""
    from tl_dynamics import models, testing

    tok = testing.tokenizer()
    ids = tok(models.CODE_PROMPT * (4 + n_tokens // 8))["input_ids"]
    out = []
    for i in range(n_prompts):
        start = (7 * i) % max(1, len(ids) - n_tokens)
        out.append(f"# {i}\n" + tok.decode(ids[start : start + n_tokens - 4]))
    return out


def part_stats(args: argparse.Namespace) -> str:
    code, text, _ = _run(_child("_stats", args), args.timeout)
    numbers = _last_json(text)
    share, cli = numbers.get("share", float("nan")), numbers.get("cli_code", "?")
    _row(
        "stats-gpt2",
        f"{share:.0%} of the forward's prompts/s; `tl-dynamics stats` exit {cli}",
        TARGETS["stats-gpt2"],
        share >= 0.7 and cli == 0,
        code,
        text,
    )
    return f"exit {code}\n\n{text.strip()[-4000:]}\n"


def stats_child(args: argparse.Namespace) -> None:
    """(A child process.) ``run_stats`` against a plain forward over the same batches, and the
    ``tl-dynamics stats`` command on the same corpus."""
    import torch

    import shapes
    from tl_dynamics import load_model, scale
    from tl_dynamics.adapter import ModelAdapter

    n_prompts, n_tokens, batch = (40, 64, 8) if args.tiny else (1000, 256, 16)
    folder = shapes.folder("gpt2-small", args.root, args.tiny)
    model = load_model(str(folder), device=args.device)
    adapter = ModelAdapter(model)
    texts = corpus(n_prompts, n_tokens)
    lengths = [len(adapter.tokenize(t).tokens[0]) for t in texts[:50]]
    sync = lambda: _sync(args)  # noqa: E731

    def forward_all() -> None:
        with torch.no_grad():
            for i in range(0, len(texts), batch):
                adapter.forward(adapter.tokenize(texts[i : i + batch]))

    def stats_all() -> None:
        scale.run_stats(model, texts, batch_size=batch, progress=False, threads=None)

    rates = {}
    for name, fn in (("plain forward", forward_all), ("run_stats (both analyses)", stats_all)):
        scale.run_stats(
            model, texts[:batch], batch_size=batch, progress=False, threads=None
        ) if name.startswith("run") else forward_all()  # warm-up
        sync()
        start = time.perf_counter()
        fn()
        sync()
        rates[name] = len(texts) / (time.perf_counter() - start)
    share = rates["run_stats (both analyses)"] / rates["plain forward"]
    corpus_file = Path(args.root) / "stats-corpus.jsonl"
    corpus_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cli_code, cli_text, cli_wall = _run(
        [
            sys.executable,
            "-m",
            "tl_dynamics",
            "stats",
            "--model",
            str(folder),
            "--prompts",
            str(corpus_file),
            "--out",
            str(Path(args.root) / "stats.safetensors"),
            "--batch-size",
            str(batch),
            "--device",
            args.device,
            "--no-progress",
            "--threads",
            str(args.threads),
        ],
        args.timeout,
    )
    print(
        f"{n_prompts} prompts of about {sum(lengths) / len(lengths):.0f} tokens, batches of "
        f"{batch}, device {args.device}\n"
    )
    print("| run | prompts/s |\n|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    print(
        f"\nrun_stats at **{share:.0%}** of the plain forward's rate (target >= 70%: "
        f"{'meets' if share >= 0.7 else 'MISSES'}). The command on the same corpus (JSON lines): exit {cli_code}, {cli_wall:.1f} s wall with start and load: "
        f"{cli_text.strip().splitlines()[-1] if cli_text.strip() else ''}"
    )
    print(json.dumps({"share": share, "rates": rates, "cli_code": cli_code, "cli_s": cli_wall}))


def _gen_device(args: argparse.Namespace) -> str:
    return args.device if args.device.startswith("cuda") else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "child",
        nargs="?",
        choices=["_heads_reference", "_stats", "_report"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", action="append", choices=PARTS)
    parser.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("TL_DYNAMICS_GPU_SCALE") == "tiny",
        help="2-layer shapes, short inputs (smoke; also TL_DYNAMICS_GPU_SCALE=tiny)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per part")
    parser.add_argument("--out", default=None, help="markdown file (default: print only)")
    parser.add_argument("--rows", default=None, help="append each part's summary line here")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    if args.child == "_heads_reference":
        return heads_reference(args)
    if args.child == "_stats":
        return stats_child(args)
    if args.child == "_report":
        return report_child(args, STARTED)
    Path(args.root).mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    lines = [
        f"# GPU targets (issue 22){' — TINY SMOKE RUN, not a measurement' if args.tiny else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {args.device} "
        f"({gpu}), torch {torch.__version__}",
        "",
    ]
    for part in args.only or PARTS:
        print(f"running {part} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        if part.startswith("attach-"):
            shape = {"attach-gpt2": "gpt2-small", "attach-1b": "llama-1b", "attach-8b": "llama-8b"}[
                part
            ]
            code, text, _ = _cost_bench(args, shape)
            attach_rows(part, code, text)
            body = f"exit {code}\n{text.strip()}\n"
        else:
            body = {"report-8b": part_report, "heads-1b": part_heads, "stats-gpt2": part_stats}[
                part
            ](args)
        lines += [
            f"## {part} (target: {TARGETS[part]})",
            "",
            body,
            f"_part took {time.perf_counter() - start:.0f} s_",
            "",
        ]
        print(lines[-4][:2000], file=sys.stderr, flush=True)
    if ROWS:
        lines += ["## Summary", "", "| part | measured | target | verdict |", "|---|---|---|---|"]
        lines += [row[len("ROW ") :] for row in ROWS]
        if args.rows:
            with open(args.rows, "a") as rows:
                rows.write("".join(row + "\n" for row in ROWS))
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
