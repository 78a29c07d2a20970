"""The dataset page: a statistics file as one offline HTML page (``tl-dynamics report --stats``)."""

from __future__ import annotations

import json

import numpy as np

from tl_dynamics import viz
from tl_dynamics.odds_ratio import HeadStats
from tl_dynamics.scale._format import DatasetStats


def _head_maps(h: HeadStats) -> list[viz.Component]:
    rows = [f"L{layer}" for layer in h.layers]
    cols = [f"H{head}" for head in h.heads]
    n = max(h.n_prompts, 1)
    shares = h.shares()

    def heat(
        values: np.ndarray,
        title: str,
        name: str,
        lo: float | None,
        hi: float | None,
        cmap: str | None,
        caption: str,
    ) -> viz.Component:
        return viz.heatmap(
            values,
            rows,
            cols,
            title=title,
            row_title="layer",
            col_title="head",
            value_name=name,
            min_value=lo,
            max_value=hi,
            cmap=cmap,
            caption=caption,
        )

    learned = h.means()["learned_sink_mass"]
    maps = []
    if np.nan_to_num(learned).any():  # learned attention sinks (GPT-OSS): the mass they absorb
        maps.append(
            heat(
                learned,
                "learned sink",
                "mean mass the learned sink absorbs",
                0.0,
                1.0,
                "blues",
                "mean share of each row's attention that the head's learned sink logit takes "
                "(a virtual key in every softmax denominator, docs/math.md §2.6)",
            )
        )
    return maps + [
        heat(
            h.sink_sums["sink_mass"] / n,
            "sink mass",
            "mean attention to the sink",
            0.0,
            1.0,
            "blues",
            "mean share of attention the most-attended source position takes, per "
            "prompt (averaged over prompts)",
        ),
        heat(
            h.sink_sums["sink_first"] / n,
            "sink on the first token",
            "share of prompts",
            0.0,
            1.0,
            "blues",
            "share of prompts whose most-attended source is the first real token",
        ),
        heat(
            shares["attr_prior"],
            "prior attribution",
            "Cov(prior, r) / Var(r)",
            -1.0,
            1.0,
            "rdbu",
            "key prior's additive share of the row-centred score variance",
        ),
        heat(
            shares["attr_loglik"],
            "likelihood attribution",
            "Cov(loglik, r) / Var(r)",
            -1.0,
            1.0,
            "rdbu",
            "log-likelihood's additive share of the row-centred score variance",
        ),
    ]


def stats_page(stats: DatasetStats, title: str | None = None) -> viz.Page:
    """The page of a statistics file (``tl-dynamics report --stats FILE``).

    Per-head sink rates and prior/likelihood attribution as layer x head heat maps with the
    per-head table (odds_ratio), and pairwise-cosine histograms and cluster counts by depth
    (trajectories).

    Args:
        stats: The ``DatasetStats``.
        title: The page's title (default: names the model).

    Returns:
        A ``viz.Page`` (``.write(path)`` writes it).

    Example:
        >>> from tl_dynamics import scale, testing
        >>> stats = scale.run_stats(testing.cached_model("gpt2"), ["a = 1"], progress=False,
        ...                         model_name="tiny-gpt2")
        >>> [section.title for section in scale.stats_page(stats).sections]
        ['Heads over the corpus: sinks and prior vs likelihood', 'Tokens through depth: cosines and clusters']
    """
    page = viz.Page(title or f"tl-dynamics dataset statistics: {stats.model}")
    page.meta += [
        ("model", stats.model),
        ("prompts", str(stats.n_prompts)),
        ("analyses", ", ".join(stats.analyses)),
        ("settings", json.dumps(stats.settings, sort_keys=True)),
        ("prompt-list hash", f"{stats.prompts_hash:064x}"),
    ]
    left_out = {k: v for k, v in stats.skipped.items() if v}
    if left_out:
        words = {
            "skipped_long": "longer than the model's context, left out",
            "truncated": "longer than the model's context, cut to fit",
            "skipped_undecodable": "not valid UTF-8, left out",
        }
        text = "; ".join(f"{n} {words.get(k, k)}" for k, n in sorted(left_out.items()))
        page.meta.append(("corpus lines not used whole", text))
        page.warnings.append(
            f"Not every corpus line was used whole ({text}): these statistics "
            "cover the prompts that were kept."
        )
    if stats.n_prompts == 0:
        page.warnings.append("These statistics cover no prompts (an empty corpus or shard).")
        return page
    if stats.odds_ratio is not None:
        page.add_section(
            "Heads over the corpus: sinks and prior vs likelihood",
            _head_maps(stats.odds_ratio) + [stats.odds_ratio.show()],
            intro="Each attention score splits into a query term, a key prior and a "
            "distance log-likelihood; these maps pool every valid query row "
            "of every prompt.",
            math="docs/math.md §2",
        )
    if stats.trajectories is not None:
        page.add_section(
            "Tokens through depth: cosines and clusters",
            [stats.trajectories.show()],
            intro="Pairwise cosines of the token states at each depth, and the mean "
            "number of clusters per prompt.",
            math="docs/math.md §5",
        )
    return page
