"""Every GPU figure of issue 22's targets, written as one markdown file (benchmarks/README.md,
"GPU targets (issue 22)"). Each part runs in its own process, so one that fails (out of memory,
say) is recorded as failed and the others still run:

- ``attach-gpt2``: ``cost_bench.py --only attach`` on the GPT-2-small shape, float32, 4 x 256 and
  1 x 1,024 (targets: each analysis attached <= 1.3x a plain forward, all three <= 1.5x);
- ``attach-1b``: ``cost_bench.py --shape llama-1b``, bfloat16, 1 x 2,048 and 8 x 512 (<= 1.2x);
- ``attach-8b``: ``cost_bench.py --shape llama-8b``, bfloat16, 1 x 4,096 (fits in 80 GB, <= 1.3x);
- ``report-8b``: ``tl-dynamics report --device cuda`` on the 8B shape at 2,048 tokens (<= 120 s
  for the command, page <= 30 MB);
- ``heads-1b``: ``tl-dynamics heads --device cuda`` on the 1B shape (<= 3x one run_with_cache
  plus one forward per ablated head, both measured here on the atlas's own probe tokens);
- ``stats-gpt2``: ``run_stats`` on the GPT-2-small shape, 1,000 prompts x 256 tokens, both
  analyses (>= 70% of the plain forward's prompts per second over the same batches), and the
  ``tl-dynamics stats --device cuda`` command on the same corpus.

    python benchmarks/gpu_bench.py --device cuda --out gpu-results.md            # all parts
    python benchmarks/gpu_bench.py --device cuda --only report-8b --only heads-1b  # some parts
    python benchmarks/gpu_bench.py --device cpu --tiny --repeats 1                 # CPU smoke

``--tiny`` runs every part on the shapes' 2-layer, d_model-256 versions with short inputs (128
tokens for the report, 40 prompts x 64 tokens for the statistics): a check that the driver
works, not a measurement. Model folders are written once under ``--root`` (the 8B shape's
bfloat16 weights are 16 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
        code, text = -1, f"timed out after {timeout:.0f} s\n{(exc.stdout or b'')[-2000:]!r}"
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


def part_report(args: argparse.Namespace) -> str:
    import shapes

    folder = shapes.folder("llama-8b", args.root, args.tiny, _gen_device(args))
    n_pos = 128 if args.tiny else 2048
    out = Path(args.root) / "report-8b.html"
    argv = [
        sys.executable,
        "-m",
        "tl_dynamics",
        "report",
        "--model",
        str(folder),
        "--device",
        args.device,
        "--prompt-ids",
        _prompt_ids(n_pos, 500),
        "--out",
        str(out),
    ]
    code, text, wall = _run(argv, args.timeout)
    size = out.stat().st_size / 1e6 if code == 0 and out.exists() else float("nan")
    ok = code == 0 and wall <= 120 and size <= 30
    return (
        f"`tl-dynamics report --model <llama-8b{'-tiny' if args.tiny else ''} folder> --device "
        f"{args.device} --prompt-ids <{n_pos} ids>`: exit {code}, **{wall:.1f} s** wall "
        f"(process start, load and build), page **{size:.1f} MB** "
        f"({'meets' if ok else 'MISSES'} the target)\n\n```\n{text.strip()[-3000:]}\n```\n"
    )


def part_heads(args: argparse.Namespace) -> str:
    import shapes

    folder = shapes.folder("llama-1b", args.root, args.tiny, _gen_device(args))
    code, text, wall = _run(
        [
            sys.executable,
            "-m",
            "tl_dynamics",
            "heads",
            "--model",
            str(folder),
            "--device",
            args.device,
        ],
        args.timeout,
    )
    ref_code, ref, _ = _run(
        [
            sys.executable,
            str(HERE / "gpu_bench.py"),
            "_heads_reference",
            "--device",
            args.device,
            "--root",
            args.root,
        ]
        + (["--tiny"] if args.tiny else []),
        args.timeout,
    )
    line = ref.strip().splitlines()[-1] if ref.strip() else "{}"
    try:
        numbers = json.loads(line)
    except ValueError:
        numbers = {}
    budget = 3 * numbers.get("reference_s", float("nan"))
    atlas_s = numbers.get("atlas_s", float("nan"))
    return (
        f"`tl-dynamics heads --model <llama-1b{'-tiny' if args.tiny else ''} folder> --device "
        f"{args.device}`: exit {code}, {wall:.1f} s wall (with process start and load).\n\n"
        f"In one process (model loaded, exit {ref_code}): `atlas.compute` **{atlas_s:.2f} s**; "
        f"one run_with_cache {numbers.get('cache_s', float('nan')):.3f} s + "
        f"{numbers.get('heads', '?')} ablated heads x one forward "
        f"{numbers.get('forward_s', float('nan')):.4f} s = "
        f"{numbers.get('reference_s', float('nan')):.2f} s; ratio "
        f"**{atlas_s / numbers.get('reference_s', float('nan')):.2f}x** (target <= 3x: "
        f"{'meets' if atlas_s <= budget else 'MISSES'}); probe tokens "
        f"{numbers.get('tokens')}\n\n```\n{text.strip()[-2500:]}\n```\n"
    )


def heads_reference(args: argparse.Namespace) -> None:
    """(A child process.) The atlas on the 1B shape next to one run_with_cache plus one forward
    per ablated head on the atlas's own natural probe tokens; prints one JSON line."""
    import torch

    import shapes
    from tl_dynamics import atlas, load_model

    model = load_model(str(shapes.folder("llama-1b", args.root, args.tiny)), device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
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
    code, text, _ = _run(
        [
            sys.executable,
            str(HERE / "gpu_bench.py"),
            "_stats",
            "--device",
            args.device,
            "--root",
            args.root,
        ]
        + (["--tiny"] if args.tiny else []),
        args.timeout,
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
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

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


def _gen_device(args: argparse.Namespace) -> str:
    return args.device if args.device.startswith("cuda") else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "child", nargs="?", choices=["_heads_reference", "_stats"], help=argparse.SUPPRESS
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", action="append", choices=PARTS)
    parser.add_argument("--tiny", action="store_true", help="2-layer shapes, short inputs (smoke)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per part")
    parser.add_argument("--out", default=None, help="markdown file (default: print only)")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    if args.child == "_heads_reference":
        return heads_reference(args)
    if args.child == "_stats":
        return stats_child(args)
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
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
