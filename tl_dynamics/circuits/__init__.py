"""QK and OV circuits of attention heads, kept factored: read-outs, copying and composition.

- ``qk_circuit``, ``ov_circuit``: one head's circuit, a TransformerLens ``FactoredMatrix``
  with provenance; its ``topk`` streams full-vocabulary top-k read-outs; rotary layers take a
  relative ``offset``.
- ``offset_summary``: a rotary head's QK circuit across offsets.
- ``copying_scores``, ``qk_positivity_scores``: eigenvalue positivity of every head.
- ``composition_scores``: Q/K/V composition of all head pairs against a random baseline.
- ``token_composition``: token-level circuits through earlier heads.
- ``prompt_circuit``: a head's QK and OV tables on one prompt's tokens.
- ``compute(model, prompt=None, *, layers=None, heads=None)``, ``report_section``: the
  one-call overview (the analysis contract: ``layers`` and ``heads`` select heads in every
  selected layer) and the report page section.

Circuits read weights only: there is no ``attach``, since nothing is collected during a
forward pass (a prompt only supplies the tokens of ``prompt_circuit`` and ``compute``).
Rotary rotations come from the adapter (``ModelAdapter.rotation``).

What the circuits include, and what they leave out (each result repeats it in ``notes``):

- Scores are as the model computes them: the layer's score scale, and ``b_Q``/``b_K``/``b_V``
  unless ``biases=False``; grouped K/V heads are mapped to their query heads. Soft-caps and
  ALiBi biases are not part of the bilinear circuit; q/k normalisation (``qk_norm``: Gemma 3,
  OLMo 2) makes the QK circuit differ from the model's scores, and the result says so.
- Multi-head latent attention (DeepSeek-V2/V3): ``W_Q``, ``W_K``, ``W_V`` are the low-rank
  factors' products with the latent norms' gains folded in; the norms' per-token scales are left
  out (the score at unit latent RMS), and ``qk_circuit(..., part=...)`` splits the score into its
  per-head non-rotary part and its rotary part, whose key every head shares (docs/math.md §1.7).
- LayerNorm is not applied to the embedding rows. In compatibility mode (and with
  ``HookedTransformer.from_pretrained``'s ``fold_ln``) its weights are folded into ``W_Q``,
  ``W_K``, ``W_V``, so only its centring and per-row scaling are left out; on a raw bridge or a
  model built from a config the weight and bias are left out too.
- Composition scores are weight-only Frobenius scores reported against a random baseline of the
  same shapes. Where a pair is within 3 baseline standard deviations, the score
  cannot tell composition from chance, and ``summary()`` says so. It can miss a real circuit:
  on an induction model the K-composition of the previous-token heads into the induction head
  can sit at the random baseline (on the shipped ``induction-2l``, two of its three
  previous-token heads do) while the token-level K-circuit (``token_composition``) picks the
  matching key for every token.
"""

from tl_dynamics.circuits._build import ov_circuit, qk_circuit
from tl_dynamics.circuits._composition import composition_scores
from tl_dynamics.circuits._offsets import offset_summary
from tl_dynamics.circuits._prompt import prompt_circuit
from tl_dynamics.circuits._report import CircuitsOverview, compute, report_section
from tl_dynamics.circuits._spectrum import copying_scores, qk_positivity_scores
from tl_dynamics.circuits._virtual import token_composition

__all__ = [
    "CircuitsOverview",
    "composition_scores",
    "compute",
    "copying_scores",
    "offset_summary",
    "ov_circuit",
    "prompt_circuit",
    "qk_circuit",
    "qk_positivity_scores",
    "report_section",
    "token_composition",
]
