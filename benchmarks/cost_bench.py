"""Benchmark: what each analysis costs next to a plain forward pass, at real size (issue 15).

Model: a GPT-2-small shape (Hugging Face ``GPT2Config``: 12 layers, 12 heads, d_model 768, vocab
50,257; ``n_positions`` 1,024, or 4,096 for ``--long``), random weights, saved to a local folder
and booted with ``TransformerBridge.boot_transformers``. Every row runs in this one process,
interleaved with the plain forward it is compared with (medians over ``--repeats``), so load from
other processes hits them alike. Memory is the peak resident set size sampled every 2 ms during
the call (CUDA: ``torch.cuda.max_memory_allocated``), minus what was resident before it:
"extra" is that peak minus the plain forward's own peak.

    python benchmarks/cost_bench.py                 # attach rows (4 x 256, 1 x 1,024) + compute rows
    python benchmarks/cost_bench.py --only attach   # or: compute, long, ops
    python benchmarks/cost_bench.py --only ops      # ops and syncs per layer (issue 21)
    python benchmarks/cost_bench.py --device cuda   # the same on a GPU
    python benchmarks/cost_bench.py --only compute --profile odds_ratio.compute   # profile one row
    python benchmarks/cost_bench.py --only attach --profile "all three attached at once"
    python benchmarks/cost_bench.py --only long --repeats 1   # 1 x 4,096 (minutes on a CPU)
    python benchmarks/cost_bench.py --shape llama-1b --device cuda  # attach rows, 1 x 2,048, 8 x 512
    python benchmarks/cost_bench.py --shape llama-8b --tiny --repeats 1  # CPU smoke (shapes.py)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# this checkout's tl_dynamics, not an installed one (an editable install of another checkout
# would be measured instead)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import torch  # noqa: E402

from tl_dynamics import contextual_mlp, odds_ratio, testing, trajectories  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402

import shapes  # noqa: E402  (benchmarks/shapes.py: the Llama shapes of issue 22)

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257)


def build_model(root: Path, n_positions: int, device: str, n_head: int = 12):
    import transformers

    folder = (
        root / f"gpt2-small-random-{n_positions}"
        if n_head == 12
        else root / f"gpt2-small-random-{n_positions}-h{n_head}"
    )
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            **{**GPT2_SMALL, "n_head": n_head},
            n_positions=n_positions,
            bos_token_id=0,
            eos_token_id=0,
        )
        transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
        testing.tokenizer().save_pretrained(folder)
    return testing.bridge_class().boot_transformers(str(folder), device=device).eval()


def _trim() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``), where there is one."""
    import ctypes
    import ctypes.util

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


class Peak:
    """Peak memory during a block, above what was in use when it started (bytes)."""

    def __init__(self, device: str):
        self.device = device
        self.extra = 0

    def __enter__(self) -> "Peak":
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        _trim()  # give freed heap back first, so the peak is this call's own
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.start
            return
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.start


CLOCK = "wall"  # or "cpu": the main thread's CPU time (with --threads 1 all of the work)


def measure(fn: Callable[[], Any], device: str) -> float:
    """The time of one call, in the steady state a run over a corpus is in: no memory sampler
    beside it and no ``malloc_trim`` before it (a trimmed heap page-faults every temporary in
    afresh: 0.1-0.3 s more per call at 1 x 1,024 tokens on the CPU, most of it for the rows that
    keep more temporaries)."""
    clock = time.thread_time if CLOCK == "cpu" else time.perf_counter
    with torch.no_grad():
        start = clock()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = clock() - start
    del out
    return elapsed


def peak_memory(fn: Callable[[], Any], device: str) -> int:
    """The peak memory of one call above what was in use before it (bytes), heap trimmed first
    so the peak is the call's own."""
    with torch.no_grad(), Peak(device) as peak:
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    del out
    return peak.extra


def run_rows(
    title: str,
    rows: dict[str, Callable[[], Any]],
    repeats: int,
    device: str,
    warm: dict[str, Callable[[], Any]] | None = None,
) -> None:
    """Median time of every row over ``repeats`` interleaved rounds, after one warm-up call of
    each, then each row's peak memory from one more call. With ``warm`` (the same analyses on a
    short input, for rows too slow to run twice) the warm-up runs those, and time and memory
    come from the same calls (heap trimmed before each, as ``peak_memory`` does)."""
    for fn in (warm or rows).values():  # warm-up
        measure(fn, device)
    times: dict[str, list[float]] = {name: [] for name in rows}
    mems: dict[str, list[int]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            if warm is None:
                times[name].append(measure(fn, device))
            else:  # rows too slow to run once more: time and memory from the same call
                clock = time.thread_time if CLOCK == "cpu" else time.perf_counter
                start = clock()
                mems[name].append(peak_memory(fn, device))
                times[name].append(clock() - start)
    if warm is None:
        mems = {name: [peak_memory(fn, device)] for name, fn in rows.items()}  # after the times
    base_t = statistics.median(times["plain forward"])
    base_m = max(statistics.median(mems["plain forward"]), 1 << 20)
    plain = times["plain forward"]
    print(f"\n## {title}  (load average {os.getloadavg()[0]:.2f}, clock {CLOCK})")
    print(
        "| run | median s | x plain | paired x plain (quartiles) | min / min | peak MB above "
        "start | extra vs forward's peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in rows:
        t, m = statistics.median(times[name]), statistics.median(mems[name])
        extra = (m - base_m) / base_m
        paired = _quartiles([a / b for a, b in zip(times[name], plain)])
        print(
            f"| {name} | {t:.3f} | {t / base_t:.2f}x | {paired} | "
            f"{min(times[name]) / min(plain):.2f}x | {m / 2**20:.0f} | {extra:+.0%} |"
        )


def _quartiles(ratios: list[float]) -> str:
    """``median (q1-q3)`` of each round's ratio to the plain forward of the same round. On the
    2-core VM of benchmarks/README.md the plain forward's own CPU time moved from 0.76 to 1.25 s
    over 10 rounds with nothing else running (SmolLM2, 1 x 256), so one row's median beside
    another's says little; a ratio within a round cancels what the round shares."""
    if len(ratios) < 4:
        return f"{statistics.median(ratios):.2f}x"
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return f"{med:.2f}x ({q1:.2f}-{q3:.2f})"


def profile_row(rows: dict[str, Callable[[], Any]], name: str | None, title: str) -> None:
    """Print a torch profiler table (self CPU time) of one row, if ``name`` is one of ``rows``."""
    if name not in rows:
        return
    from torch.profiler import ProfilerActivity, profile

    rows[name]()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        rows[name]()
    print(f"\n### profile: {name} ({title})")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def attach_rows(model: Any, adapter: ModelAdapter, tokens: torch.Tensor) -> dict[str, Callable]:
    odds = lambda: odds_ratio.attach(adapter)  # noqa: E731
    mlp = lambda: contextual_mlp.attach(adapter)  # noqa: E731
    traj = lambda: trajectories.attach(adapter, lens=False)  # noqa: E731
    view = lambda: trajectories.attach(adapter)  # noqa: E731
    attached = _attached(model, tokens)
    return {
        "plain forward": lambda: model(tokens),
        "run_with_cache": lambda: model.run_with_cache(tokens),
        "odds_ratio.attach, all heads": attached(odds),
        "contextual_mlp.attach, all layers and heads": attached(mlp),
        "trajectories.attach(lens=False)": attached(traj),
        "all three attached at once": attached(odds, mlp, traj),
        # issue 48: the defaults, the trajectories' lens read where the view reads it
        "all three attached, defaults (lens='view')": attached(odds, mlp, view),
    }


def _attached(
    model: Any, tokens: torch.Tensor, results: bool = True
) -> Callable[..., Callable[[], Any]]:
    """A row that runs ``model(tokens)`` with the given analyses attached and, with ``results``,
    asks each collector for its ``result()`` (counted: for the contextual MLP that builds row
    0's MLPs of every layer and head)."""

    def attached(*makers: Callable[[], Any]) -> Callable[[], Any]:
        def fn() -> Any:
            from contextlib import ExitStack

            with ExitStack() as stack:
                collectors = [stack.enter_context(make()) for make in makers]
                model(tokens)
            return [c.result() for c in collectors] if results else collectors

        return fn

    return attached


def long_rows(model: Any, adapter: ModelAdapter, tokens: torch.Tensor) -> dict[str, Callable]:
    """The long-context rows: each analysis attached alone and all three; the contextual MLP
    collects (its ``result()``, 144 MLPs whose outgoing weights alone are ``144 x pos x d_model``
    floats, 1.8 GB at 4,096 tokens, is the size of what was asked for, not a cost of attaching,
    and has a row of its own)."""
    odds = lambda: odds_ratio.attach(adapter)  # noqa: E731
    mlp = lambda: contextual_mlp.attach(adapter)  # noqa: E731
    traj = lambda: trajectories.attach(adapter, lens=False)  # noqa: E731
    with_result, collect = _attached(model, tokens), _attached(model, tokens, results=False)

    def all_three() -> Any:  # odds-ratio and trajectory results (small), MLPs collected
        out = collect(odds, mlp, traj)()
        return [out[0].result(), out[1], out[2].result()]

    return {
        "plain forward": lambda: model(tokens),
        "odds_ratio.attach, all heads": with_result(odds),
        "contextual_mlp.attach, all layers and heads (collected)": collect(mlp),
        "contextual_mlp.attach + result() (row 0: 144 MLPs)": with_result(mlp),
        "trajectories.attach(lens=False)": with_result(traj),
        "all three attached at once (MLPs collected)": all_three,
    }


def op_rows(root: Path, device: str) -> None:
    """Torch ops (kernel launches on a GPU) and host syncs each analysis adds per layer,
    ``result()`` included, counted with ``tl_dynamics.collect._count.count_ops`` (repeatable on any
    machine; issue 21)."""
    from tl_dynamics.collect._count import count_ops

    print("\n## ops and syncs per layer (added to the plain forward's own), result() included")
    print(
        "| heads | batch x tokens | forward ops/layer | odds_ratio | contextual_mlp | "
        "trajectories(lens=False) | all three | syncs per forward (all three) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n_head in (12, 24):
        model = build_model(root, 1024, device, n_head)
        adapter = ModelAdapter(model)
        makers = {
            "odds_ratio": partial(odds_ratio.attach, adapter),
            "contextual_mlp": partial(contextual_mlp.attach, adapter),
            "trajectories": partial(trajectories.attach, adapter, lens=False),
        }
        for shape in ((4, 256), (1, 256), (1, 1024)):
            tokens = torch.randint(0, 50257, shape).to(device)
            attached = _attached(model, tokens)
            cells, syncs, base = [], 0, 0
            for name, ms in (
                [("forward", [])]
                + [(k, [v]) for k, v in makers.items()]
                + [("all", list(makers.values()))]
            ):
                fn = attached(*ms) if ms else partial(model, tokens)
                with torch.no_grad():
                    fn()  # warm
                    with count_ops(launch_bound=True) as c:
                        fn()
                if name == "forward":
                    base = c.ops
                    cells.append(f"{c.ops / adapter.n_layers:.1f}")
                else:
                    cells.append(f"{(c.ops - base) / adapter.n_layers:.1f}")
                syncs = c.syncs
            print(f"| {n_head} | {shape[0]} x {shape[1]} | " + " | ".join(cells) + f" | {syncs} |")


def compute_rows(model: Any, adapter: ModelAdapter, tokens: torch.Tensor) -> dict[str, Callable]:
    batch = adapter.tokenize(tokens)
    n_points = 2 * adapter.n_layers + 1

    def lens_floor() -> Any:  # forward + one unembedding per point: the exact-rank floor
        logits = model(tokens)
        resid = torch.randn(n_points, *tokens.shape, adapter.d_model, device=tokens.device)
        for point in resid:
            adapter.logit_lens(point).argmax(-1)
        return logits

    return {
        "plain forward": lambda: model(tokens),
        "odds_ratio.compute": lambda: odds_ratio.compute(adapter, batch),
        "trajectories.compute(lens=False)": lambda: trajectories.compute(
            adapter, batch, lens=False
        ),
        "forward + one unembedding per point (lens floor)": lens_floor,
        "trajectories.compute(lens=True)": lambda: trajectories.compute(adapter, batch, lens=True),
        "contextual_mlp.compute, layer 5, all heads": lambda: contextual_mlp.compute(
            adapter, batch, layers=5
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["attach", "compute", "long", "ops"], action="append")
    parser.add_argument("--profile", help="print a torch profiler table for the row of this name")
    parser.add_argument(
        "--long-rows",
        action="append",
        help="with --only long: keep the rows whose name contains this (and the "
        "plain forward); a 4,096-token forward is about a minute on one CPU "
        "thread",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the main thread's CPU time, robust to load from other "
        "processes (use with --threads 1, where it is all of the work)",
    )
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    parser.add_argument(
        "--shape",
        choices=shapes.NAMES,
        default="gpt2-small",
        help="model shape (benchmarks/shapes.py); other than gpt2-small: the "
        "attach rows at the shape's own token shapes, in its dtype",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="with --shape: 2 layers, d_model 256, short inputs (a smoke test)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = args.clock
    only = set(args.only or ["attach", "compute"])
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    if args.shape != "gpt2-small" or args.tiny:
        model = shapes.build(args.shape, args.root, args.device, tiny=args.tiny)
        print(f"shape {args.shape}{' (tiny)' if args.tiny else ''}: {shapes.describe(model)}")
        for batch, n_pos in shapes.attach_tokens(args.shape, args.tiny):
            tokens = torch.randint(
                0, shapes.vocab(args.shape, args.tiny), (batch, n_pos), generator=gen
            ).to(args.device)
            if args.shape == "llama-8b":  # the long rows, MLPs collected: at 4,096 tokens
                # run_with_cache's scores and patterns (2 x 34 GB in bf16) and row 0's 1,024
                # contextual MLPs (68 GB) are beyond 80 GB next to the 16 GB of weights
                rows = {
                    name: fn
                    for name, fn in long_rows(model, ModelAdapter(model), tokens).items()
                    if "result()" not in name
                }
            else:
                rows = attach_rows(model, ModelAdapter(model), tokens)
            run_rows(
                f"{args.shape}, attach, batch {batch} x {n_pos}", rows, args.repeats, args.device
            )
        if args.device.startswith("cuda"):  # weights and the largest row together
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"\npeak CUDA memory allocated in this process: {peak:.1f} GiB")
        return
    if "ops" in only:
        op_rows(Path(args.root), args.device)
    if only & {"attach", "compute"}:
        model = build_model(Path(args.root), 1024, args.device)
        adapter = ModelAdapter(model)
        if "attach" in only:
            for shape in ((4, 256), (1, 1024)):
                tokens = torch.randint(0, 50257, shape, generator=gen).to(args.device)
                rows = attach_rows(model, adapter, tokens)
                title = f"attach, batch {shape[0]} x {shape[1]}"
                if args.profile:
                    profile_row(rows, args.profile, title)
                    continue
                run_rows(title, rows, args.repeats, args.device)
        if "compute" in only:
            tokens = torch.randint(0, 50257, (1, 1024), generator=gen).to(args.device)
            rows = compute_rows(model, adapter, tokens)
            if args.profile:
                profile_row(rows, args.profile, "compute, 1 x 1,024")
            else:
                run_rows("compute, 1 x 1,024", rows, max(1, args.repeats // 2), args.device)
    if "long" in only:
        model = build_model(Path(args.root), 4096, args.device)
        adapter = ModelAdapter(model)
        tokens = torch.randint(0, 50257, (1, 4096), generator=gen).to(args.device)
        rows = long_rows(model, adapter, tokens)
        if args.long_rows:
            rows = {
                name: fn
                for name, fn in rows.items()
                if name == "plain forward" or any(w in name for w in args.long_rows)
            }
        # warm-up: the plain forward at full length (the first 4,096-token call peaked at
        # 10 GB RSS, later ones at 2.2 GB), the analyses' first calls on 64 tokens
        warm = long_rows(model, adapter, tokens[:, :64])
        warm = {name: fn for name, fn in warm.items() if name in rows}
        warm["plain forward"] = rows["plain forward"]
        if args.profile:
            profile_row(rows, args.profile, "long context, 1 x 4,096")
        else:
            run_rows(
                "long context: attach, 1 x 4,096", rows, max(1, args.repeats), args.device, warm
            )


if __name__ == "__main__":
    main()
