"""A report (with its atlas section) on a tiny random model of every exact architecture.

Issue 23, item 6: for each row of ``test_architectures.MUST_BE_EXACT`` a tiny random model is
built exactly as the matrix builds it, and ``report.build_report`` runs on one short prompt. No
section may fail; every section shows, or says "Not shown for this model" with a reason naming
the layer type it does not model (``LAYER_TYPES``). The atlas
(``tl_dynamics.atlas``, "What each head does") shows a row per head or declines naming the layer
type; the trajectories are shown on every one.
"""

import re

import pytest

from test_architectures import MUST_BE_EXACT, VARIANTS, boot_tiny
from tl_dynamics import report

# The layer types an analysis may decline, as its message names them (docs/math.md §1.6-1.9):
# latent attention, learned sinks, gated attention (BitNet's sub-norm included), q/k normalised
# after rotary (HunYuan), q/k/v clamped after their projections (clip_qkv), router-chosen
# query and output experts (JetMoE, §1.10), values RMS-normalised per head and keys and values
# reused from an earlier layer (Gemma 4, docs/math.md §1.6).
LAYER_TYPES = (
    "multi-head latent attention",
    "learned attention sinks",
    "gated attention",
    "normalises q and k after rotary",
    "clamps q, k and v",
    "router-chosen attention experts",
    "RMS-normalises each head",
    "keys and values",
)
# Hybrids with Mamba-2 layers run Hugging Face's pure-torch Mamba-2 path on the CPU (no CUDA
# kernels): one report takes 25 s (Bamba) and 55 s (Falcon-H1) on a tiny model, too slow for
# every CI run. Jamba (Mamba) and LFM2 (convolutions) cover the hybrids here.
TOO_SLOW = {
    "BambaForCausalLM": "Mamba-2 torch path: 25 s per report",
    "FalconH1ForCausalLM": "Mamba-2 torch path: 55 s per report",
}
ROWS = sorted(MUST_BE_EXACT - set(TOO_SLOW))


def _section(html: str, title: str) -> str:
    """The body of the section titled ``title`` (not its table-of-contents entry)."""
    return html.rsplit(title, 1)[1].split("</section>", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_report_and_atlas_show_or_name_the_layer_type(row):
    name, overrides = VARIANTS.get(row, (row, {}))
    page = report.build_report(boot_tiny(name, **overrides), "a b c a b c")
    html = page.to_html()
    assert page.failed_sections == [], page.failed_sections
    notes = re.findall(r"Not shown for this model: ([^<]*)", html)
    assert all(any(kind in note for kind in LAYER_TYPES) for note in notes), notes
    if "What each head does" in html:  # the atlas shown: one table row per head
        atlas = _section(html, "What each head does")
        assert "Not shown for this model" not in atlas and atlas.count("<tr>") >= 2, atlas[:300]
    else:  # declined as a whole, naming the layer type (checked above)
        assert notes
    trajectories = _section(html, "Depth-wise trajectories")
    assert "Not shown for this model" not in trajectories and "<svg" in trajectories
