"""Attention scores as odds ratios: query term + key prior + distance log-likelihood (+ bias).

``compute``/``attach`` split every score of the asked heads exactly and collect per-head
statistics (variance shares, KL to the prior-only and likelihood-only patterns, labels, sinks);
``markov``/``composed`` read a pattern as a random walk; ``barycentric`` reads its rows as
simplex coordinates over the per-source head outputs.
"""

from tl_dynamics.odds_ratio._collect import (OddsRatioCollector, attach, compute, decompose_layer,
                                         sink_facts)
from tl_dynamics.odds_ratio._barycentric import BarycentricView, barycentric
from tl_dynamics.odds_ratio._markov import (DAMPING, ChainSummary, absorption_steps, chain_summary,
                                            compose, damped_stationary, effective_rank, stationary)
from tl_dynamics.odds_ratio._report import OddsRatioAnalysis, report_section
from tl_dynamics.odds_ratio._result import (LABEL_THRESHOLD, SINK_SUM_KEYS, Decomposition,
                                            HeadStats, OddsRatioResult, label)
from tl_dynamics.odds_ratio._simplex import SimplexSolution, kkt_residual, simplex_lstsq
from tl_dynamics.odds_ratio._stats import SUM_KEYS
from tl_dynamics.odds_ratio._split import (ScoreParts, counterfactual_patterns, masked_softmax,
                                           row_kl, split_scores)
from tl_dynamics.odds_ratio._stats import SINK_DOMINANCE
from tl_dynamics.odds_ratio._walk import composed, markov

__all__ = ["BarycentricView", "ChainSummary", "DAMPING", "Decomposition", "HeadStats",
           "LABEL_THRESHOLD", "OddsRatioAnalysis", "OddsRatioCollector", "OddsRatioResult",
           "SINK_DOMINANCE", "SINK_SUM_KEYS", "SUM_KEYS", "ScoreParts", "SimplexSolution",
           "absorption_steps", "attach", "barycentric", "chain_summary", "compose", "composed",
           "compute", "counterfactual_patterns", "damped_stationary", "decompose_layer",
           "effective_rank", "kkt_residual", "label", "markov", "masked_softmax",
           "report_section", "row_kl", "simplex_lstsq", "sink_facts", "split_scores",
           "stationary"]
