"""Attention scores as odds ratios: query term + key prior + distance log-likelihood (+ bias).

``compute``/``attach`` split every score of the asked heads exactly and collect per-head
statistics (variance shares, the agreement of the prior-only and likelihood-only patterns with
the real one, KLs, labels, sinks: docs/math.md §2.2);
``markov``/``composed`` read a pattern as a random walk; ``barycentric`` reads its rows as
simplex coordinates over the per-source head outputs.

The scores split are the adapter's recomputation from ``q`` and ``k``, checked against the
model's own pattern. On the TransformerLens bridges that load the shipped models (TransformerLens
4.x) ``hook_attn_scores`` holds the **pattern**, not the pre-softmax scores (TransformerLens's
behaviour): there the recomputed scores are the only ones there are (docs/math.md §2).
"""

from tl_dynamics.odds_ratio._barycentric import barycentric
from tl_dynamics.odds_ratio._collect import attach, compute, sink_facts
from tl_dynamics.odds_ratio._report import report_section
from tl_dynamics.odds_ratio._result import HeadStats, OddsRatioResult
from tl_dynamics.odds_ratio._split import counterfactual_patterns, split_scores
from tl_dynamics.odds_ratio._walk import composed, markov

__all__ = [
    "HeadStats",
    "OddsRatioResult",
    "attach",
    "barycentric",
    "composed",
    "compute",
    "counterfactual_patterns",
    "markov",
    "report_section",
    "sink_facts",
    "split_scores",
]
