"""Ray benchmark (issue 34): the driver's memory and the throughput of ``ray_stats``.

    python benchmarks/ray_bench.py memory [--sizes 100000,1000000] [--model tiny-random:gpt2]
    python benchmarks/ray_bench.py throughput [--prompts 10000] [--model code-2l]

Every measurement runs in a fresh process (so peak memory is its own). ``memory`` runs, per
corpus size, ``ray_stats`` on a local Ray cluster (``ray.init(num_cpus=W+1)``: W actors and a
CPU for Ray Data's reading) with W = 2 workers over a synthetic corpus cut into ``--files``
JSON-lines files, and reports the driver's peak resident memory (VmHWM) and its resident
memory before the run (after Ray, torch and the library are imported). ``throughput`` times
``run_stats`` in one process (one torch thread) and ``ray_stats`` with 2 workers (one torch
thread each) over the same corpus; the actors load the model before the clock starts (a
warm-up run on a 2-batch file, ``keep_workers=True``, which also starts Ray Data's reader), and ``run_stats`` is timed after its model
is loaded. Both compute the same bytes (checked). Each prints one JSON line per measurement.
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

ROOT = Path(__file__).resolve().parents[1]


def corpus(n: int, folder: Path, n_files: int, terms: int = 9) -> list[Path]:
    """``n`` code-like prompts of varied length in ``n_files`` JSON-lines files (deterministic;
    the lengths cycle, so a longer corpus does not have longer prompts)."""
    paths = [folder / f"part{f:03d}.jsonl" for f in range(n_files)]
    per = -(-n // n_files)
    for f, path in enumerate(paths):
        with path.open("w") as out:
            for i in range(f * per, min(n, (f + 1) * per)):
                k = i % 997
                body = " + ".join(f"x{j} * {k % (j + 3)}" for j in range(2 + k % terms))
                text = f"def f{k}(x0, x1):\n    return {body}  # {i % 7}"
                out.write(json.dumps({"text": text}) + "\n")
    return paths


def _status(key: str) -> float:
    """``VmRSS``/``VmHWM`` of this process in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    """One measurement in this process: ``--engine ray`` or ``single``."""
    import torch

    from tl_dynamics import load_model, scale

    torch.set_num_threads(1)
    paths = [Path(p) for p in args.paths.split(",")]
    out = Path(args.out)
    result: dict = {"engine": args.engine, "model": args.model}
    if args.engine == "single":
        model = load_model(args.model)
        prompts = paths[0]  # the files concatenated: run_stats streams one file
        before = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        stats = scale.run_stats(
            model, prompts, out, batch_size=16, progress=False, model_name=args.model
        )
    else:
        import ray

        ray.init(
            num_cpus=args.workers + 1,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        common = dict(model_name=args.model, num_workers=args.workers, batch_size=16)
        common.update(progress=False, keep_workers=True, num_cpus=1.0)
        warm = out.with_name("warm.jsonl")  # the actors load the model, Ray Data's reader
        warm.write_text('{"text": "def f(): pass"}\n' * 32)  # process starts: before the clock
        scale.ray_stats(args.model, [warm], **common)
        before = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        stats = scale.ray_stats(args.model, paths, out, **common)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    result.update(
        prompts=stats.n_prompts,
        wall_s=round(wall, 2),
        prompts_per_s=round(stats.n_prompts / wall, 1),
        driver_cpu_s=round(cpu, 2),
        rss_before_mb=round(before, 1),
        peak_rss_mb=round(_status("VmHWM"), 1),
        load=round(os.getloadavg()[0], 2),
    )
    print(json.dumps(result), flush=True)
    if args.engine == "ray":
        import ray

        ray.shutdown()
        sys.stderr.flush()
        os._exit(0)  # Ray Data's executor thread may outlive shutdown and trip at exit


def _measure(engine: str, paths: list[Path], out: Path, model: str, workers: int) -> dict:
    cmd = [sys.executable, __file__, "child", "--engine", engine, "--model", model]
    cmd += ["--workers", str(workers), "--out", str(out), "--paths", ",".join(map(str, paths))]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("memory", "throughput", "child"))
    p.add_argument("--sizes", default="100000,1000000", help="memory: corpus sizes")
    p.add_argument("--prompts", type=int, default=10000, help="throughput: corpus size")
    p.add_argument("--model", default=None, help="default: tiny-random:gpt2 / code-2l")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--files", type=int, default=8, help="JSON-lines files the corpus is cut in")
    p.add_argument("--single", action="store_true", help="memory: also time run_stats")
    p.add_argument("--engine", default="ray")
    p.add_argument("--paths", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.mode == "child":
        child(args)
        return
    model = args.model or ("tiny-random:gpt2" if args.mode == "memory" else "code-2l")
    sizes = [int(s) for s in args.sizes.split(",")] if args.mode == "memory" else [args.prompts]
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            # the tiny models' context is 64 tokens: shorter prompts for them
            paths = corpus(n, Path(tmp), args.files, 9 if "code" in model else 3)
            ray_out, one_out = Path(tmp) / "ray.safetensors", Path(tmp) / "one.safetensors"
            row = _measure("ray", paths, ray_out, model, args.workers)
            print(json.dumps(row), flush=True)
            if args.mode == "throughput" or args.single:
                whole = Path(tmp) / "all.jsonl"
                whole.write_bytes(b"".join(p.read_bytes() for p in paths))
                one = _measure("single", [whole], one_out, model, 1)
                one["same_bytes"] = one_out.read_bytes() == ray_out.read_bytes()
                print(json.dumps(one), flush=True)
                speedup = one["wall_s"] / row["wall_s"]
                print(json.dumps({"prompts": n, "speedup_ray_vs_one": round(speedup, 2)}))


if __name__ == "__main__":
    main()
