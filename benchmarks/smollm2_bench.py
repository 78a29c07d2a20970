"""Benchmark: the three analyses attached with their defaults on a real model (issue 48).

Model: SmolLM2-135M-Instruct (30 layers, 9 query and 3 key/value heads, d_model 576, vocabulary
49,152), the folder ``make smollm2`` builds; its path comes from the environment variable
``TL_DYNAMICS_SMOLLM2`` (the Makefile exports it). Input: 1 x 256 random token ids (``--tokens``).
Every row runs in this one process, interleaved with the plain forward it is divided by
(``cost_bench.run_rows``: medians over ``--repeats`` rounds after a warm-up, then each row's
peak memory from one more call), timed by the main thread's CPU time on one torch thread.

    TL_DYNAMICS_SMOLLM2=.models/smollm2-135m python benchmarks/smollm2_bench.py --repeats 5
    python benchmarks/smollm2_bench.py --full       # also the full lens (minutes)
    python benchmarks/smollm2_bench.py --profile "all three attached, defaults"
    python benchmarks/smollm2_bench.py --parts      # what each piece of the work costs
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tl_dynamics
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import cost_bench  # noqa: E402  (benchmarks/cost_bench.py: run_rows, _attached, profile_row)
import tl_dynamics  # noqa: E402
from tl_dynamics import contextual_mlp, odds_ratio, trajectories  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402


def rows(model, adapter: ModelAdapter, tokens: torch.Tensor, full: bool) -> dict:
    odds = lambda: odds_ratio.attach(adapter)  # noqa: E731
    mlp = lambda: contextual_mlp.attach(adapter)  # noqa: E731
    traj = lambda: trajectories.attach(adapter)  # noqa: E731  (lens="view")
    no_lens = lambda: trajectories.attach(adapter, lens=False)  # noqa: E731
    attached = cost_bench._attached(model, tokens)
    out = {
        "plain forward": lambda: model(tokens),
        "odds_ratio.attach": attached(odds),
        "contextual_mlp.attach + result()": attached(mlp),
        "trajectories.attach (lens='view', the default)": attached(traj),
        "trajectories.attach(lens=False)": attached(no_lens),
        "all three attached, defaults": attached(odds, mlp, traj),
        "all three attached, lens=False": attached(odds, mlp, no_lens),
    }
    if full:
        full_lens = lambda: trajectories.attach(adapter, lens="full")  # noqa: E731
        out["trajectories.attach(lens='full')"] = attached(full_lens)
        out["all three attached, lens='full'"] = attached(odds, mlp, full_lens)
    return out


def parts(model, adapter: ModelAdapter, tokens: torch.Tensor, repeats: int) -> None:
    """CPU time of each piece of work the attached pass adds, each timed alone on this pass's
    own states (median of ``repeats`` after a warm-up), beside the plain forward: where the
    ratio goes, and which pieces are the statistics' own arithmetic (the effective rank's
    float64 spectra, the lens view's vocabulary products)."""
    import statistics

    from tl_dynamics import sphere
    from tl_dynamics.trajectories import _cloud, _collect, _lens, _points

    def timed(fn) -> float:
        times = []
        with torch.no_grad():  # as cost_bench.measure
            fn()
            for _ in range(repeats):
                start = time.thread_time()
                fn()
                times.append(time.thread_time() - start)
        return statistics.median(times)

    _, cache = model.run_with_cache(tokens)
    n_layers = adapter.n_layers
    zs = [cache[adapter.hook_name("resid_pre", layer)] for layer in range(n_layers)]
    zs.append(cache[adapter.hook_name("resid_post", n_layers - 1)])
    del cache
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    targets = _points.next_tokens(tokens, valid)
    cfg = _collect._config(adapter, None, sphere.TRAJECTORY_EPS_GRID, False, "view", None, False)
    b, n = tokens.shape
    z = _points._Points(zs, max(1, _points.CPU_POINT_BUDGET_BYTES // (8 * b * n * zs[0].shape[-1])))
    res, unit = _points._elementwise(z, valid)
    u = torch.stack([unit[i : i + 1][0] for i in range(len(zs))]).flatten(0, 1)
    ud = u.double()
    side = ud if n <= ud.shape[-1] else ud.transpose(1, 2)  # the smaller Gram, as rank_and_pair_sum
    gram = _cloud._lower_gram(side)
    odds = cost_bench._attached(model, tokens)(lambda: odds_ratio.attach(adapter))
    forward = timed(lambda: model(tokens))
    odds_pass = timed(odds)
    pieces = {
        "plain forward": forward,
        "trajectories: every point's statistics (point_statistics)": timed(
            lambda: _points.point_statistics(adapter, cfg, zs, valid, targets)
        ),
        "  per-token statistics (_elementwise)": timed(lambda: _points._elementwise(z, valid)),
        "  the lens view (point_lens, 'view')": timed(
            lambda: _lens.point_lens(adapter, "view", z, valid, targets)
        ),
        "  cosines, float32": timed(lambda: sphere.cosines(u)),
        "  unit vectors to float64": timed(lambda: u.double()),
        "  float64 Grams (lower triangle)": timed(lambda: _cloud._lower_gram(side)),
        "  float64 spectra (eigvalsh, one thread)": timed(
            lambda: _cloud._eigvalsh_one_thread(gram)
        ),
        "odds_ratio: attached pass and result(), less the forward": odds_pass - forward,
    }
    print(f"\n## where the attached pass's own work goes ({b} x {n}, CPU s, one thread)")
    print("| piece | CPU s | x plain forward |")
    print("|---|---|---|")
    for name, t in pieces.items():
        print(f"| {name} | {t:.3f} | {t / forward:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="also the rows with lens='full'")
    parser.add_argument("--profile", help="print a torch profiler table for the row of this name")
    parser.add_argument("--parts", action="store_true", help="time each piece of the work alone")
    args = parser.parse_args()
    folder = os.environ.get("TL_DYNAMICS_SMOLLM2")
    if not folder or not Path(folder, "config.json").is_file():
        raise SystemExit(
            "TL_DYNAMICS_SMOLLM2 names no SmolLM2 folder (got "
            f"{folder!r}): build it with `make smollm2`, which exports the variable"
        )
    torch.set_num_threads(1)
    cost_bench.CLOCK = "cpu"
    model = tl_dynamics.load_model(folder)
    adapter = ModelAdapter.of(model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, int(model.cfg.d_vocab), (args.batch, args.tokens), generator=gen)
    print(
        f"SmolLM2-135M ({folder}), {args.batch} x {args.tokens} tokens, torch "
        f"{torch.__version__}, 1 thread, {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if args.parts:
        parts(model, adapter, tokens, args.repeats)
        return
    table = rows(model, adapter, tokens, args.full)
    if args.profile:
        cost_bench.profile_row(table, args.profile, f"{args.batch} x {args.tokens}")
        return
    if args.full:  # the full lens is minutes a call: time and memory from one call each
        cost_bench.run_rows("SmolLM2-135M, attach", table, 1, "cpu", warm=table)
    else:
        cost_bench.run_rows("SmolLM2-135M, attach", table, args.repeats, "cpu")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
