"""The odds-ratio section of the ``tl-dynamics report`` page."""

from __future__ import annotations

from typing import Any

import numpy as np

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.odds_ratio._api import OddsRatioCollector
from tl_dynamics.odds_ratio._result import LABEL_THRESHOLD, head_name
from tl_dynamics.odds_ratio._views import decomposition_view, stats_view

INTRO = ("Every attention score splits exactly into a query term (constant along the row), a key "
         "prior (c/2)|k_j|^2 and a distance log-likelihood -(c/2)|q_i-k_j|^2 (plus any position "
         "bias): attention is a posterior over source positions, prior times likelihood, at "
         "temperature sigma^2 = 1/c. A head is prior-driven when the key prior carries at least "
         f"{LABEL_THRESHOLD:.2f} of the row-centred score variance (additive attribution "
         "Cov(term, r)/Var(r)), likelihood-driven when the log-likelihood does.")


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the odds-ratio section: per-head table, and the decomposition of the most
    prior-driven and the most likelihood-driven head on the first prompt."""
    collector = OddsRatioCollector(adapter, adapter.check_layers(None), adapter.check_heads(None),
                                   keep_tensors=True)
    collector.forward(batch)
    res = collector.result()
    shares = res.stats.shares()
    items: list[Any] = [stats_view(res.stats)]
    picks = []
    for key in ("attr_prior", "attr_loglik"):
        values = np.nan_to_num(shares[key], nan=-np.inf)
        a, b = np.unravel_index(int(np.argmax(values)), values.shape)
        picks.append((res.stats.layers[a], res.stats.heads[b], key, float(values[a, b])))
    for layer, head, key, value in picks:
        view = decomposition_view(res.decompositions[0][layer], [head], row=0)
        what = "prior" if key == "attr_prior" else "likelihood"
        items.append(viz.text(f"{head_name(layer, head)}: the head most driven by the {what} "
                              f"({key} = {value:.3f})."))
        items.extend(view.components)
    page.add_section("Attention as odds ratios: key prior vs distance likelihood", items, INTRO)
