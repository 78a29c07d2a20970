"""Dataset scale benchmark (issue 16): throughput of 2 workers vs 1, memory per worker, file size.

    .venv/bin/python benchmarks/scale_bench.py throughput [--prompts 1000]
    .venv/bin/python benchmarks/scale_bench.py memory [--sizes 100,1000,10000]
    .venv/bin/python benchmarks/scale_bench.py filesize

``throughput`` runs ``torchrun --nproc-per-node W`` (W = 1, 2; gloo, one torch thread per
worker) over the same corpus with the shipped ``code-2l`` and times, on rank 0, the statistics
run itself (after every rank has loaded the model; including the gather, the exact merge and
the write). ``memory`` runs one worker per corpus size in a fresh process and reports its peak
resident memory. ``filesize`` writes the statistics of a random GPT-2-small-shaped model
(12 layers x 12 heads, d_model 768). Each prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "code-2l"


def corpus(n: int, path: Path) -> Path:
    """``n`` code-like prompts of varied length (deterministic; the lengths cycle, so a longer
    corpus does not have longer prompts)."""
    lines = []
    for i in range(n):
        k = i % 997
        body = " + ".join(f"x{j} * {k % (j + 3)}" for j in range(2 + k % 9))
        lines.append(json.dumps({"text": f"def f{k}(x0, x1):\n    return {body}  # {i % 7}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def load() -> float:
    return os.getloadavg()[0]


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: load, synchronise, time ``run_stats``."""
    import torch
    import torch.distributed as dist

    from tl_dynamics import models, scale

    torch.set_num_threads(1)
    model = models.resolve(MODEL).model
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    stats = scale.run_stats(
        model, args.prompts, args.out, batch_size=16, progress=False, model_name=MODEL
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if os.environ.get("RANK", "0") == "0":
        print(
            json.dumps(
                {
                    "prompts": stats.n_prompts,
                    "wall_s": round(wall, 2),
                    "rank0_cpu_s": round(cpu, 2),
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                }
            )
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def _torchrun(nproc: int, prompts: Path, out: Path) -> dict:
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(29600 + nproc),
        __file__,
        "_worker",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def throughput(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prompts = corpus(args.prompts, Path(tmp) / "corpus.jsonl")
        results = {}
        for nproc in (1, 2):
            before = load()
            r = _torchrun(nproc, prompts, Path(tmp) / f"w{nproc}.safetensors")
            r.update(
                workers=nproc,
                threads_per_worker=1,
                load_before=round(before, 2),
                load_after=round(load(), 2),
                prompts_per_s=round(r["prompts"] / r["wall_s"], 1),
            )
            results[nproc] = r
            print(json.dumps(r), flush=True)
        one, two = (Path(tmp) / f"w{n}.safetensors" for n in (1, 2))
        same = one.read_bytes() == two.read_bytes()
        print(
            json.dumps(
                {
                    "speedup_2_vs_1": round(results[1]["wall_s"] / results[2]["wall_s"], 2),
                    "byte_identical": same,
                    "differing": [] if same else differing(one, two),
                }
            )
        )


def differing(a: Path, b: Path) -> list[str]:
    """The statistics that differ between two files."""
    import numpy as np

    from tl_dynamics import scale

    x, y = scale.load_stats(a), scale.load_stats(b)
    out = [
        f"trajectories.sums.{k}"
        for k in x.trajectories.sums
        if x.trajectories.sums[k] != y.trajectories.sums[k]
    ]
    out += [
        f"trajectories.ints.{k}"
        for k in x.trajectories.ints
        if not np.array_equal(x.trajectories.ints[k], y.trajectories.ints[k])
    ]
    keys = x.odds_ratio.sum_keys + (
        "sink_mass",
        "sink_first",
        "sink_by_prior",
        "sink_prior_adv",
        "sink_loglik_adv",
    )
    diff = x.odds_ratio.exact.value() != y.odds_ratio.exact.value()
    out += [f"odds_ratio.{keys[i]}" for i in sorted(set(np.argwhere(diff)[:, 1].tolist()))]
    return out


def memory(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            prompts = corpus(n, Path(tmp) / f"c{n}.jsonl")
            before = load()
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "_worker",
                    "--prompts",
                    str(prompts),
                    "--out",
                    str(Path(tmp) / f"m{n}.safetensors"),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r.update(load_before=round(before, 2), load_after=round(load(), 2))
            print(json.dumps(r), flush=True)


def filesize(args: argparse.Namespace) -> None:
    import torch
    import transformers

    from tl_dynamics import scale, testing
    from tl_dynamics.compat import bridge_class

    torch.set_num_threads(1)
    tok = testing.tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.GPT2Config(
            vocab_size=len(tok),
            n_layer=12,
            n_head=12,
            n_embd=768,
            n_positions=1024,
            bos_token_id=0,
            eos_token_id=0,
        )
        torch.manual_seed(0)
        folder = Path(tmp) / "gpt2-small-shaped"
        transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        model = bridge_class().boot_transformers(str(folder), device="cpu")
        out = Path(tmp) / "stats.safetensors"
        prompts = [f"def f{i}(x):\n    return x * {i} + {i % 5}" for i in range(args.prompts)]
        stats = scale.run_stats(
            model, prompts, out, batch_size=8, progress=False, model_name="gpt2-small-shaped"
        )
        print(
            json.dumps(
                {
                    "model": "GPT-2-small-shaped (12 x 12 heads, d_model 768)",
                    "prompts": stats.n_prompts,
                    "file_mb": round(out.stat().st_size / 1e6, 3),
                    "limbs": {k: v.limbs.shape[0] for k, v in stats.trajectories.sums.items()},
                }
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("throughput", "memory", "filesize", "_worker"))
    p.add_argument("--prompts", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--sizes", default="100,1000,10000")
    args = p.parse_args()
    if args.mode == "_worker":
        worker(args)
        return
    if args.mode in ("throughput", "filesize"):
        args.prompts = int(args.prompts or (1000 if args.mode == "throughput" else 32))
    {"throughput": throughput, "memory": memory, "filesize": filesize}[args.mode](args)


if __name__ == "__main__":
    main()
