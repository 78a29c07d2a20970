"""Streaming trajectory statistics through a GPT-2-small-shaped random model.

    .venv/bin/python benchmarks/trajectories_bench.py                 # timing + memory table
    .venv/bin/python benchmarks/trajectories_bench.py --time-prompts 200 --mem-prompts 100 1000
    .venv/bin/python benchmarks/trajectories_bench.py --kernel       # tl_dynamics.sphere alone

The model: Hugging Face GPT2Config with 12 layers, 12 heads, d_model 768, n_ctx 64 and random
weights, booted through ``TransformerBridge.boot_transformers`` from a local folder (vocabulary:
the offline test tokenizer's 512 tokens by default, ``--vocab 50257`` for GPT-2's). Prompts are
random token sequences of ``--pos`` tokens; every other batch is right-padded by a random amount
so the masks are exercised. All statistics on: logit lens, flattened trajectory (mid-block
points), four cluster thresholds, effective rank, per-dimension moments.

Timing: per prompt, ``trajectories.stream`` against plain ``ModelAdapter.forward`` over the
same batches, best of ``--repeat`` interleaved rounds; process CPU time (one thread) is the
figure to trust on a shared machine, wall time is shown beside it. Memory: peak resident set size of a fresh worker
process streaming N prompts (so 100 vs 1,000 shows whether memory grows with the dataset).

Kernel (``--kernel``): ``tl_dynamics.sphere.cluster_labels`` at the four default thresholds and
``merge_events`` on clustered random clouds (d_model 768, 10% padding), best of 5, one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(vocab: int):
    import transformers

    from tl_dynamics import testing

    folder = Path(tempfile.mkdtemp(prefix="tld_traj_bench_")) / "gpt2-small-shaped"
    tok = testing.tokenizer()
    cfg = transformers.GPT2Config(
        n_layer=12,
        n_head=12,
        n_embd=768,
        n_positions=64,
        vocab_size=max(vocab, len(tok)),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    model = testing.bridge_class().boot_transformers(str(folder), device="cpu").eval()
    from tl_dynamics.adapter import ModelAdapter

    return ModelAdapter(model)


def batches(ad, n_prompts: int, pos: int, batch_size: int, vocab: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for start in range(0, n_prompts, batch_size):
        b = min(batch_size, n_prompts - start)
        tokens = torch.randint(1, min(vocab, 512), (b, pos), generator=gen)
        mask = torch.ones(b, pos, dtype=torch.long)
        if (start // batch_size) % 2:
            lengths = torch.randint(pos // 2, pos + 1, (b,), generator=gen)
            mask = (torch.arange(pos)[None] < lengths[:, None]).long()
        out.append(ad.tokenize(tokens, attention_mask=mask))
    return out


def stream_all(ad, bs, flattened=True, lens=True):
    from tl_dynamics import trajectories

    return trajectories.stream(ad, bs, flattened=flattened, lens=lens, progress=False)


def kernel() -> None:
    from tl_dynamics import sphere

    gen = torch.Generator().manual_seed(0)
    print(
        "| batch x tokens | cluster_labels, 4 eps (ms) | merge_events (ms) | clusters at eps 0.25 |"
    )
    print("|---|---|---|---|")
    for b, n, k in [(25, 32, 6), (25, 128, 20), (8, 512, 40)]:
        centres = torch.randn(k, 768, generator=gen)
        x = centres[torch.randint(0, k, (b, n), generator=gen)] + 0.6 * torch.randn(
            b, n, 768, generator=gen
        )
        mask = torch.rand(b, n, generator=gen) > 0.1
        cos = sphere.cosines(sphere.unit(x) * mask[..., None])

        def best(fn):
            out = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                out = min(out, time.perf_counter() - t0)
            return out

        labels = [sphere.cluster_labels(cos, e, mask) for e in sphere.TRAJECTORY_EPS_GRID]
        t_lab = best(
            lambda cos=cos, mask=mask: [
                sphere.cluster_labels(cos, e, mask) for e in sphere.TRAJECTORY_EPS_GRID
            ]
        )
        t_ev = best(lambda labels=labels: sphere.merge_events(labels[-2], labels[-1]))
        print(
            f"| {b} x {n} | {1e3 * t_lab:.2f} | {1e3 * t_ev:.3f} | "
            f"{sphere.count_clusters(labels[-1]).float().mean():.1f} |",
            flush=True,
        )


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    ad = build(args.vocab)
    bs = batches(ad, args.worker, args.pos, args.batch_size, args.vocab)
    t0 = time.perf_counter()
    stats = stream_all(ad, bs)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(dict(prompts=stats.n_prompts, seconds=seconds, peak_mb=peak_mb)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-prompts", type=int, default=200)
    ap.add_argument("--mem-prompts", type=int, nargs="*", default=[100, 1000])
    ap.add_argument("--pos", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--kernel", action="store_true", help="time tl_dynamics.sphere only")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.kernel:
        torch.set_num_threads(1)
        kernel()
        return
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), GPT-2-small "
        f"shape (12 layers, 12 heads, d_model 768), vocab {args.vocab}, {args.pos} tokens/prompt, "
        f"batch {args.batch_size}"
    )
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    if args.time_prompts:
        ad = build(args.vocab)
        bs = batches(ad, args.time_prompts, args.pos, args.batch_size, args.vocab)
        stream_all(ad, bs[:1])  # warm-up
        variants = {
            "all statistics, 13 points": dict(flattened=False),
            "all statistics + mid-block points (25 points)": dict(flattened=True),
            "25 points, logit lens off": dict(flattened=True, lens=False),
        }
        names = ["plain forward", *variants]
        wall = {name: float("inf") for name in names}
        cpu = {name: float("inf") for name in names}

        def timed(name, fn):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - w0)
            cpu[name] = min(cpu[name], time.process_time() - c0)

        for _ in range(args.repeat):  # interleaved, so load changes hit every variant alike
            timed("plain forward", lambda: [ad.forward(b) for b in bs])
            for name, kw in variants.items():
                timed(name, lambda kw=kw: stream_all(ad, bs, **kw))
        n = args.time_prompts
        print(
            f"| {n} prompts, best of {args.repeat} | CPU ms / prompt | CPU vs plain | "
            "wall ms / prompt | wall vs plain |"
        )
        print("|---|---|---|---|---|")
        for name in names:
            print(
                f"| {name} | {1e3 * cpu[name] / n:.1f} | {cpu[name] / cpu['plain forward']:.2f}x | "
                f"{1e3 * wall[name] / n:.1f} | {wall[name] / wall['plain forward']:.2f}x |"
            )
        print(flush=True)
    if args.mem_prompts:
        print("| prompts streamed | seconds | peak RSS (MB, fresh process) |")
        print("|---|---|---|")
        for n in args.mem_prompts:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(n),
                "--pos",
                str(args.pos),
                "--batch-size",
                str(args.batch_size),
                "--vocab",
                str(args.vocab),
                "--threads",
                str(args.threads),
            ]
            res = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            print(f"| {res['prompts']} | {res['seconds']:.1f} | {res['peak_mb']:.0f} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
