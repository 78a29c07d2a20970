"""QK and OV circuits of attention heads, kept factored: read-outs, copying and composition.

- ``qk_circuit``, ``ov_circuit``, ``positional_qk_circuit``: one head's circuit as a
  ``Circuit`` (a TransformerLens ``FactoredMatrix`` with provenance); ``Circuit.topk`` streams
  full-vocabulary top-k read-outs; rotary layers take a relative ``offset``.
- ``offset_summary``: a rotary head's QK circuit across offsets.
- ``copying_scores``, ``qk_positivity_scores``: eigenvalue positivity of every head.
- ``composition_scores``: Q/K/V composition of all head pairs against a random baseline.
- ``composition_circuit``, ``token_composition``: token-level circuits through earlier heads.
- ``prompt_circuit``: a head's QK and OV tables on one prompt's tokens.
- ``compute``, ``report_section``: the one-call overview and the report page section.
"""

from tl_dynamics.circuits._build import ov_circuit, positional_qk_circuit, qk_circuit
from tl_dynamics.circuits._circuit import Circuit, TokenTopK, positivity
from tl_dynamics.circuits._composition import (BASELINE_SAMPLES, BASELINE_SEED, CHANCE_Z,
                                               CompositionScores, composition_scores)
from tl_dynamics.circuits._offsets import OffsetSummary, offset_summary
from tl_dynamics.circuits._prompt import PromptCircuit, prompt_circuit
from tl_dynamics.circuits._report import CircuitsOverview, compute, report_section
from tl_dynamics.circuits._rotary import RotaryMap, rotary_map
from tl_dynamics.circuits._spectrum import HeadScores, copying_scores, qk_positivity_scores
from tl_dynamics.circuits._virtual import TokenComposition, composition_circuit, token_composition

__all__ = ["BASELINE_SAMPLES", "BASELINE_SEED", "CHANCE_Z", "Circuit", "CircuitsOverview",
           "CompositionScores", "HeadScores", "OffsetSummary", "PromptCircuit", "RotaryMap",
           "TokenComposition", "TokenTopK", "composition_circuit", "composition_scores", "compute",
           "copying_scores", "offset_summary", "ov_circuit", "positional_qk_circuit", "positivity",
           "prompt_circuit", "qk_circuit", "qk_positivity_scores", "report_section", "rotary_map",
           "token_composition"]
