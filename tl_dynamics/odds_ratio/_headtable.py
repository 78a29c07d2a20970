"""The rows of ``HeadStats.to_dataframe``: one record per analysed head."""

from __future__ import annotations

from typing import Any

import numpy as np


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def head_records(stats: Any) -> list[dict[str, Any]]:
    """One record per head of ``stats`` (a ``HeadStats``): its place, shares, agreement,
    means, label, per-prompt sink means and the first key's alpha (NaN where not kept)."""
    sh, ag, mn = stats.shares(), stats.agreement(), stats.means()
    ev = stats.label_evidence()
    n = max(stats.n_prompts, 1)
    sk, eps = stats.sink_sums, stats.sink_epsilon()
    nan = np.full(sh["attr_prior"].shape, np.nan)
    first = {k: nan if eps is None else eps[k] for k in ("alpha", "share")}
    records = []
    for a, layer in enumerate(stats.layers):
        for b, head in enumerate(stats.heads):
            rec: dict[str, Any] = {
                "head_name": head_name(layer, head),
                "layer": layer,
                "head_index": head,
                "sigma2": 1.0 / stats.scale[a],
                "softcap": stats.softcap[a],
                "rows": int(stats.sums["rows"][a, b]),
            }
            rec.update({k: float(v[a, b]) for k, v in sh.items()})
            rec.update({k: float(v[a, b]) for k, v in ag.items()})
            rec.update({k: float(v[a, b]) for k, v in mn.items()})
            rec["label"] = ev.label[a, b]
            rec["label_waits_on"] = ev.undecided_on[a, b]
            for name in ("top_real", "kept_prior", "kept_loglik", "attr_prior", "attr_loglik"):
                rec[name] = float(ev.estimate[name][a, b])
                rec[f"{name}_ci"] = _ci(ev.low[name][a, b], ev.high[name][a, b])
            rec["sink_mass"] = float(sk["sink_mass"][a, b] / n)
            rec["sink_first_share"] = float(sk["sink_first"][a, b] / n)
            rec["sink_by_prior_share"] = float(sk["sink_by_prior"][a, b] / n)
            rec["sink_prior_adv"] = float(sk["sink_prior_adv"][a, b] / n)
            rec["sink_loglik_adv"] = float(sk["sink_loglik_adv"][a, b] / n)
            rec["sink_alpha"] = float(first["alpha"][a, b])
            rec["sink_alpha_share"] = float(first["share"][a, b])
            records.append(rec)
    return records


def _ci(low: float, high: float) -> str:
    """A 95% interval as text (empty where there is none)."""
    return "" if not (np.isfinite(low) and np.isfinite(high)) else f"[{low:.2f}, {high:.2f}]"
