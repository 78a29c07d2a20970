"""Print the exactness matrix as a markdown table for the installed TransformerLens.

Each cell is the largest error of the adapter's recomputation against the host's own cached
activations (pattern, z, head-output sum; scores where the hook holds logits) over a single
prompt and left- and right-padded batches; the last column is the largest error against the
Hugging Face model itself (eager attention, same weights: ``testing.hf_truth_errors``), pattern
and summed head outputs in raw mode, pattern only in compatibility mode (its output weights are
centred). Run it in each environment and merge the columns:
    python scripts/compat_table.py

``--registry`` prints the generated architecture matrix instead: one row per architecture in
TransformerLens's own registry (and per flag variant) that ``tests/test_architectures.py`` builds,
with its attention layers and largest errors against the host and against Hugging Face, or the
refusal or the reason it cannot be built here:
    python scripts/compat_table.py --registry
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
        errs += [
            e[k] for k in ("pattern", "z", "out", "scores") if e[k] == e[k]
        ]  # NaN: no reference
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


def registry_rows() -> None:
    """The generated architecture matrix (see the module doc), one markdown row per entry."""
    import warnings

    import pytest

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    )
    import test_architectures as matrix  # noqa: E402 (the tests' own tiny configs)

    warnings.simplefilter("ignore")
    rows = [(name, name, {}) for name in matrix.supported_architectures()]
    rows += [(variant, *matrix.VARIANTS[variant]) for variant in sorted(matrix.VARIANTS)]
    print(f"| row | attention layers | vs host (TL {tl_version()}) | vs Hugging Face |")
    print("|---|---|---|---|")
    for row, name, overrides in rows:
        try:
            model = matrix.boot_tiny(name, **overrides)
        except pytest.skip.Exception as exc:
            print(f"| {row} | – | not built: {str(exc.msg).split(': ', 1)[-1][:90]} | – |")
            continue
        try:
            adapter = ModelAdapter(model)
            host = [testing.reconstruction_errors(adapter, p, side) for p, side in CASES]
            cell = max(
                v for e in host for k, v in e.items() if k != "scores_hook_is_pattern" and v == v
            )
            hf = (
                "– (host differs)"
                if row in matrix.HOST_NOT_HF
                else f"{max(v for p, side in CASES for v in testing.hf_truth_errors(adapter, testing.hf_twin(model), p, side).values() if v == v):.1e}"
            )
            layers = f"{', '.join(map(str, adapter.attention_layers))} of {adapter.n_layers}"
            print(f"| {row} | {layers} | {cell:.1e} | {hf} |")
        except Exception as exc:  # a refusal (or a failure) is a visible row
            text = str(exc)
            print(f"| {row} | – | refused: {text[:160]}{'…' if len(text) > 160 else ''} | – |")
        sys.stdout.flush()


def main() -> None:
    if "--registry" in sys.argv:
        registry_rows()
        return
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
            print(
                f"| {arch} | TransformerBridge{' compat' if compat else ''} | {cell} | {hf_cell} |"
            )
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
