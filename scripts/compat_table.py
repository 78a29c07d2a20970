"""Print the exactness matrix as a markdown table for the installed TransformerLens.

Each cell is the largest error of the adapter's recomputation against the host's own cached
activations (pattern, z, head-output sum; scores where the hook holds logits) over a single
prompt and left- and right-padded batches; the last column is the largest error against the
Hugging Face model itself (eager attention, same weights: ``testing.hf_truth_errors``), pattern
and summed head outputs in raw mode, pattern only in compatibility mode (its output weights are
centred). Run it in each environment and merge the columns:
    python scripts/compat_table.py
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tl_dynamics import testing  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402
from tl_dynamics.compat import tl_version  # noqa: E402

CASES = [(testing.PROMPTS[0], "right"), (testing.PROMPTS, "right"), (testing.PROMPTS, "left")]


def worst(model) -> str:
    adapter = ModelAdapter(model)
    errs = []
    for prompt, side in CASES:
        if adapter.is_encoder and adapter.info.host == "hooked" and isinstance(prompt, tuple):
            continue  # bidirectional HookedTransformer does not mask pads: refused, not compared
        e = testing.reconstruction_errors(adapter, prompt, side)
        errs += [e[k] for k in ("pattern", "z", "out", "scores") if e[k] == e[k]]  # NaN: no reference
    flag = "" if adapter.specs[0].scores_hook == "logits" else " (scores hook = pattern)"
    if adapter.hook_name("out", 0) is None:
        flag += " (no output hook before the post-norm)"
    return f"{max(errs):.1e}{flag}"


def hf_worst(model, twin) -> str:
    adapter = ModelAdapter(model)
    errs = []
    for prompt, side in CASES:
        e = testing.hf_truth_errors(adapter, twin, prompt, side)
        errs += [v for v in e.values() if v == v]  # NaN: not comparable (compat output)
    return f"{max(errs):.1e}"


def main() -> None:
    version = tl_version()
    print(f"| model | host (TransformerLens {version}) | max error | vs Hugging Face |")
    print("|---|---|---|---|")
    for arch in testing.HF_ARCHS:
        twin = None
        for compat in (False, True):
            try:
                model = testing.tiny_bridge(arch, compat=compat)
                cell = worst(model)
                twin = twin or testing.hf_twin(model)
                hf_cell = hf_worst(model, twin)
            except Exception as exc:  # a visible row, never a silent pass
                cell = hf_cell = f"FAILED: {type(exc).__name__}: {exc}"[:120]
            print(f"| {arch} | TransformerBridge{' compat' if compat else ''} | {cell} | {hf_cell} |")
    for variant in testing.NATIVE_VARIANTS:
        try:
            cell = worst(testing.tiny_native(variant))
        except Exception as exc:
            cell = f"FAILED: {type(exc).__name__}: {exc}"[:120]
        print(f"| {variant} | TransformerBridge native | {cell} | – |")
    if testing.has_hooked_transformer():
        for variant in testing.HOOKED_VARIANTS:
            print(f"| {variant} | HookedTransformer | {worst(testing.tiny_hooked(variant))} | – |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
