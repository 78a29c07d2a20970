"""Benchmark the report at real size: page size, wall time, and draw time in headless Chromium.

Builds random-weight GPT-2-shaped models from configs (no hub): ``gpt2-small`` (12 layers x 12
heads, d_model 768) and ``wide-32`` (32 layers x 32 heads, d_model 256), with the offline test
tokenizer (vocabulary 512), saved as Hugging Face folders and loaded by the CLI exactly as a user's
folder would be. The prompt is Python source cut to the asked number of tokens.

Measures: the CLI's wall time (imports, loading, every section, writing), the page size, and in
Debian's headless chromium at 1280 px: the time from navigation start until the first screen is
drawn (load fired and every view in the viewport drawn), then every other view is scrolled to and
must draw; page errors, network requests and horizontal overflow are counted.

    .venv/bin/python benchmarks/report_bench.py --shape gpt2-small --tokens 512
    .venv/bin/python benchmarks/report_bench.py --shape wide-32 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768),
    "wide-32": dict(n_layer=32, n_head=32, n_embd=256),
}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
IN_VIEW_DRAWN = """() => document.readyState === 'complete' &&
  [...document.querySelectorAll('.tld-view')].filter(v => { const r = v.getBoundingClientRect();
    return r.top < innerHeight && r.bottom > 0; }).every(v => v.dataset.state === 'done'
    && v.children.length > 0)"""


def build_folder(shape: str, n_ctx: int, root: Path) -> Path:
    """A random-weight GPT-2 of ``shape`` saved as a Hugging Face folder (tokenizer included)."""
    import torch
    import transformers

    from tl_dynamics import testing

    tok = testing.tokenizer()
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_positions=n_ctx, bos_token_id=0, eos_token_id=0, **SHAPES[shape]
    )
    torch.manual_seed(0)
    folder = root / shape
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompt_of(n_tokens: int) -> str:
    """Python source cut to ``n_tokens`` tokens (the report adds a BOS token in front)."""
    from tl_dynamics import testing

    tok = testing.tokenizer()
    text = Path(testing.__file__).read_text() * 4
    ids = tok(text)["input_ids"][: n_tokens - 1]
    return tok.decode(ids)


def run_cli(folder: Path, prompt: str, out: Path, sections: str) -> tuple[float, float]:
    """The CLI's wall time and CPU time (user + system, so a loaded machine can be read)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tl_dynamics",
            "report",
            "--model",
            str(folder),
            "--prompt",
            prompt,
            "--out",
            str(out),
            "--sections",
            sections,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"report failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(proc.stderr.strip()[-1500:], file=sys.stderr)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def browse(path: Path, timeout_s: float) -> dict:
    """First-screen time, then scroll to every view; errors, requests and overflow."""
    from playwright.sync_api import sync_playwright

    out: dict = {"errors": [], "requests": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.on("pageerror", lambda e: out["errors"].append(str(e)))
        page.on("request", lambda r: out["requests"].append(r.url))
        page.goto(path.as_uri(), wait_until="load", timeout=timeout_s * 1000)
        page.wait_for_function(IN_VIEW_DRAWN, timeout=timeout_s * 1000, polling="raf")
        out["first_screen_s"] = page.evaluate("performance.now()") / 1000
        n = page.evaluate("document.querySelectorAll('.tld-view').length")
        slowest = 0.0
        for i in range(n):
            start = time.perf_counter()
            page.evaluate(f"document.querySelectorAll('.tld-view')[{i}].scrollIntoView()")
            page.wait_for_function(
                f"() => {{ const v = document.querySelectorAll('.tld-view')[{i}]; "
                "return v.dataset.state === 'done' && v.children.length > 0; }",
                timeout=timeout_s * 1000,
            )
            slowest = max(slowest, time.perf_counter() - start)
        out.update(
            views=n,
            slowest_view_s=slowest,
            overflow_px=page.evaluate("document.documentElement.scrollWidth - innerWidth"),
            states=page.evaluate(
                "[...document.querySelectorAll('.tld-view')].map(v => v.dataset.state)"
            ).count("done"),
        )
        browser.close()
    out["requests"] = [r for r in out["requests"] if r != path.as_uri()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--keep", default=None, help="folder to keep the page in")
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument(
        "--sections",
        default="atlas,circuits,odds_ratio,contextual_mlp,trajectories,particles",
        help="the CLI's --sections ('none': attention section only)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="browser timeout, seconds")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tld_report_bench_"))
    folder = build_folder(args.shape, max(1024, args.tokens), root)
    prompt = prompt_of(args.tokens)
    out = Path(args.keep or root) / f"report-{args.shape}-{args.tokens}.html"
    wall, cpu = run_cli(folder, prompt, out, args.sections)
    result = dict(
        shape=args.shape,
        tokens=args.tokens,
        sections=args.sections,
        wall_s=round(wall, 1),
        cpu_s=round(cpu, 1),
        load_average=round(os.getloadavg()[0], 1),
        page_mb=round(out.stat().st_size / 1e6, 2),
    )
    if not args.no_browser:
        result.update(browse(out, args.timeout))
    print(json.dumps(result, indent=1))
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
