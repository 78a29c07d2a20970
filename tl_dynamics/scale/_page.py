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
    first = h.sink_epsilon()  # Gu et al.'s alpha of the first key (None: a version 1 file)
    alpha_maps = (
        []
        if first is None
        else [
            heat(
                first["alpha"],
                "first-key alpha",
                "mean alpha over prompts",
                0.0,
                1.0,
                "blues",
                "alpha of the first token (Gu et al.): its mean weight over the queries that may "
                "see it, single-key rows included, per prompt (averaged over prompts)",
            ),
            heat(
                first["share"],
                f"alpha > {first['epsilon']:g}",
                "share of prompts",
                0.0,
                1.0,
                "blues",
                f"share of prompts whose first-key alpha exceeds eps = {first['epsilon']:g}; "
                "its mean over the heads is Sink^eps (the sentence below)",
            ),
        ]
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
        *alpha_maps,
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


def sink_epsilon_sentence(stats: DatasetStats) -> str:
    """Gu et al.'s Sink^eps of the first key over the corpus, in words, naming whether a BOS
    token was prepended (or why the file cannot say: format version 1).

    Example:
        >>> from tl_dynamics import scale, testing
        >>> stats = scale.run_stats(testing.cached_model("gpt2"), ["a = 1"], progress=False)
        >>> "BOS token" in sink_epsilon_sentence(stats)
        True
    """
    h, n = stats.odds_ratio, stats.n_prompts
    first = None if h is None else h.sink_epsilon()
    if h is None or first is None or stats.bos_prompts is None:
        return (
            "Sink^eps of the first key (Gu et al. 2025) is not available in this file: it is of "
            f"format version {stats.version}, written before tl_dynamics kept each prompt's "
            "first-key alpha and whether a BOS token was prepended; recompute it with "
            "`tl-dynamics stats` to see it."
        )
    o = stats.settings.get("odds_ratio") or {}
    n_heads = len(h.layers) * len(h.heads)
    which = (
        f"all {n_heads} heads of every attention layer"
        if o.get("layers") is None and o.get("heads") is None
        else f"the {n_heads} heads analysed (layers {list(h.layers)}, heads {list(h.heads)})"
    )
    bos = stats.bos_prompts
    if bos == n:
        said = f"The first key is a BOS token, prepended by the tokenizer, in all {n} prompts."
    elif bos == 0:
        said = "No BOS token was prepended: the first key is each prompt's own first token."
    else:
        said = (
            f"A BOS token was prepended in {bos} of the {n} prompts (the first key); in the "
            "others the first key is the prompt's own first token."
        )
    eps = first["epsilon"]
    return (
        f"Sink^eps of the first key (Gu et al. 2025, eps = {eps:g}): "
        f"{first['sink_epsilon']:.3f}. For each prompt, the fraction of {which} whose alpha (the "
        f"mean weight on the first key over the queries that may see it) exceeds {eps:g}, "
        f"averaged over the {n} prompts, as Gu et al. average it over sequences. Of the "
        f"corpus-mean alpha (the first-key alpha map), {first['of_mean_alpha']:.3f} of the heads "
        f"exceed {eps:g}. {said} The sink maps beside it come from the odds-ratio statistics: "
        "the most-attended column over rows with at least two keys, and for the first token "
        "also its dominance; alpha asks neither (docs/math.md §2.3)."
    )


def stats_page(stats: DatasetStats, title: str | None = None) -> viz.Page:
    """The page of a statistics file (``tl-dynamics report --stats FILE``).

    Per-head sink rates, the first key's alpha with Gu et al.'s Sink^eps (``sink_epsilon_sentence``)
    and prior/likelihood attribution as layer x head heat maps with the per-head table
    (odds_ratio), and pairwise-cosine histograms and cluster counts by depth (trajectories).

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
        ("format version", str(stats.version)),
        (
            "prompts beginning with a BOS token",
            "not recorded (format version 1)"
            if stats.bos_prompts is None
            else f"{stats.bos_prompts} of {stats.n_prompts}",
        ),
    ]
    prints = stats.fingerprints or {}
    for key, words in (("weights", "model weights"), ("config", "model configuration")):
        page.meta.append(
            (
                f"{words} (SHA-256)",
                prints.get(key, f"not recorded (format version {stats.version})"),
            )
        )
    page.meta += [
        ("tokenizer (SHA-256)", prints.get("tokenizer", "not recorded")),
        (
            "batches hash (prompts in their batches and order)",
            "not recorded" if stats.batches_hash is None else f"{stats.batches_hash:064x}",
        ),
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
            _head_maps(stats.odds_ratio)
            + [viz.text(sink_epsilon_sentence(stats)), stats.odds_ratio.show()],
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
