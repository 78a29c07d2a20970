"""Cached ``generate`` inside ``attach()`` against the same generate without it (issue 40).

Greedy generation of ``--new`` tokens (default 32) after a ``--prompt``-token prompt with the KV
cache (``use_past_kv_cache=True``), timed without attach and with each analysis attached (the
steps kept, then stitched and collected once, ``adapter/_generate.py``), in one process,
interleaved rounds, best of ``--repeat`` (process CPU time and wall time). Hosts whose cached
steps are exact: TransformerLens 3.x's ``HookedTransformer`` (a real cache) and a natively booted
4.x bridge (which reruns the sequence at each step). Shapes: ``small`` (12 layers, 12 heads,
d_model 768, the 512-id test vocabulary, random weights) and ``tiny`` (the zoo's 2-layer
code-2l).

    .venv-tl3/bin/python benchmarks/generate_bench.py --shape small
    .venv/bin/python benchmarks/generate_bench.py --shape small
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tl_dynamics import contextual_mlp, odds_ratio, testing, trajectories, zoo  # noqa: E402

SMALL = dict(n_layers=12, d_model=768, n_heads=12, d_head=64, d_mlp=3072, n_ctx=1024)
ANALYSES = {
    "odds_ratio": odds_ratio.attach,
    "contextual_mlp": contextual_mlp.attach,
    "trajectories": trajectories.attach,
}


def build(shape: str):
    if shape == "tiny":
        return zoo.load("code-2l")
    if testing.has_hooked_transformer():
        return testing.tiny_hooked("gpt2-like", **SMALL)
    from transformer_lens.config import TransformerBridgeConfig

    from tl_dynamics.compat import bridge_class

    cfg = TransformerBridgeConfig(
        architecture="TransformerLensNative",
        d_vocab=len(testing.tokenizer()),
        act_fn="gelu",
        normalization_type="LN",
        **SMALL,
    )
    torch.manual_seed(0)
    model = bridge_class().boot_native(cfg, tokenizer=testing.tokenizer(), model_name="small")
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.02)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["small", "tiny"], default="small")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build(args.shape)
    vocab = int(model.cfg.d_vocab)
    prompt = torch.randint(1, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def run(attach=None) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad(), nullcontext() if attach is None else attach(model) as collector:
            model.generate(
                prompt,
                max_new_tokens=args.new,
                use_past_kv_cache=True,
                do_sample=False,
                stop_at_eos=False,
                verbose=False,
            )
        if collector is not None:
            collector.result()
        return time.perf_counter() - wall, time.process_time() - cpu

    for attach in [None, *ANALYSES.values()]:  # warm: adapters read, caches filled
        run(attach)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):
        for name, attach in [("plain", None), *ANALYSES.items()]:
            wall, cpu = run(attach)
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], wall), min(old[1], cpu))
    host = type(model).__name__
    print(f"{host}, shape {args.shape}, prompt {args.prompt}, {args.new} new tokens, cached")
    print("| generate | CPU s | CPU vs plain | wall s | wall vs plain |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu) in best.items():
        print(
            f"| {name} | {cpu:.3f} | {cpu / best['plain'][1]:.2f}x | {wall:.3f} | "
            f"{wall / best['plain'][0]:.2f}x |"
        )


if __name__ == "__main__":
    main()
