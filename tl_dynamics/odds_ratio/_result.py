"""Result objects: per-prompt decompositions (on request) and ``OddsRatioResult``; the per-head
statistics are ``_headstats.HeadStats`` (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import _views
from tl_dynamics.odds_ratio._headstats import HeadStats
from tl_dynamics.odds_ratio._headtable import head_name
from tl_dynamics.odds_ratio._labels import KEEP, LABEL_THRESHOLD, SHARP

# Re-exported: the collector and the tests read them here.
from tl_dynamics.odds_ratio._headstats import SINK_SUM_KEYS as SINK_SUM_KEYS
from tl_dynamics.odds_ratio._split import ScoreParts, row_kl, sink_log_patterns


@dataclass(frozen=True)
class Decomposition(viz.Result):
    """The exact split of one layer's scores for one batch of prompts (per-prompt tensors).

    ``parts`` holds query term, key prior, log-likelihood and bias for ``heads``; ``pattern``
    is the model's pattern (recomputed exactly; equal to its own ``hook_pattern`` on valid
    rows), ``prior_pattern``/``likelihood_pattern`` the counterfactuals. When ``softcap`` is
    set the parts sum to the **pre-cap** score; the model then applies
    ``softcap * tanh(r / softcap)`` before its softmax.
    """

    model: str
    layer: int
    heads: tuple[int, ...]
    tokens: Int[Tensor, "batch pos"]
    str_tokens: tuple[tuple[str, ...], ...]
    parts: ScoreParts
    pattern: Float[Tensor, "batch head q k"]
    prior_pattern: Float[Tensor, "batch head q k"]
    likelihood_pattern: Float[Tensor, "batch head q k"]
    allowed: Bool[Tensor, "batch q k"]
    query_valid: Bool[Tensor, "batch q"]
    softcap: float | None

    def __repr__(self) -> str:
        return (
            f"Decomposition({self.model}, layer={self.layer}, heads={list(self.heads)}, "
            f"batch={tuple(self.tokens.shape)}, precap={self.softcap is not None})"
        )

    @property
    def precap(self) -> bool:
        """True when the split is of the pre-cap score (the layer soft-caps)."""
        return self.softcap is not None

    def head_index(self, head: int) -> int:
        if head not in self.heads:
            raise TLDynamicsError(
                f"head {head!r} was not decomposed in layer {self.layer}; "
                f"decomposed heads: {list(self.heads)}"
            )
        return self.heads.index(head)

    @property
    def learned_sink(self) -> Float[Tensor, "batch head q"] | None:
        """The mass the learned sink absorbs per row, ``1 - sum_j pattern_ij`` (None on layers
        without one; zero on rows with no allowed key), from the parts (docs/math.md §2.6)."""
        if self.parts.sink is None:
            return None
        log_real = sink_log_patterns(self.parts, self.allowed, self.softcap)[0]
        return log_real[..., -1].exp() * self.allowed.any(-1)[:, None]

    def kl(self) -> dict[str, Float[Tensor, "batch head q"]]:
        """Per row ``KL(real || prior-only)`` and ``KL(real || likelihood-only)`` (with a learned
        sink, over the real keys and the virtual one: docs/math.md §2.6)."""
        if self.parts.sink is not None:
            log_real, log_prior, log_lik = sink_log_patterns(self.parts, self.allowed, self.softcap)
            return {"prior": row_kl(log_real, log_prior), "loglik": row_kl(log_real, log_lik)}

        def log(p: Tensor) -> Tensor:
            return torch.where(self.allowed[:, None], p.clamp(min=1e-45).log(), float("-inf"))

        log_real = log(self.pattern)
        return {
            "prior": row_kl(log_real, log(self.prior_pattern)),
            "loglik": row_kl(log_real, log(self.likelihood_pattern)),
        }

    def to_dataframe(self, row: int = 0) -> pd.DataFrame:
        """Per key of prompt ``row``: key prior per head and attention received."""
        valid = self.allowed[row].any(0)
        toks = [t for t, v in zip(self.str_tokens[row], valid.tolist()) if v]
        frames = []
        for b, head in enumerate(self.heads):
            received = (self.pattern[row, b] * self.query_valid[row, :, None]).sum(0)[valid]
            frames.append(
                pd.DataFrame(
                    {
                        "head_name": head_name(self.layer, head),
                        "position": torch.nonzero(valid).flatten().tolist(),
                        "token": toks,
                        "key_prior": self.parts.key_prior[row, b][valid].tolist(),
                        "attention_received": received.tolist(),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)

    def show(self, heads: int | list[int] | None = None, row: int = 0) -> viz.Group:
        """Real pattern beside prior-only and likelihood-only patterns, the three score parts,
        and the key prior per token of prompt ``row``'s real positions (``tl_dynamics.viz``)."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.tokens.shape[0]:
            raise TLDynamicsError(
                f"row {row!r} is out of range: the decomposition has "
                f"{self.tokens.shape[0]} prompts (valid: 0..{self.tokens.shape[0] - 1})"
            )
        chosen = (
            list(self.heads)
            if heads is None
            else [heads]
            if isinstance(heads, int)
            else list(heads)
        )
        idx = [self.head_index(h) for h in chosen]  # raises naming the decomposed heads
        real = torch.nonzero(self.allowed[row].any(0)).flatten()
        tokens = (
            list(self.str_tokens[row])
            if self.str_tokens
            else [str(i) for i in range(self.tokens.shape[1])]
        )
        tokens = [tokens[i] for i in real.tolist()]
        allowed = self.allowed[row][real][:, real]
        causal = bool((torch.triu(allowed.float(), diagonal=1) == 0).all())

        def sub(t: Tensor) -> Tensor:
            return t[row][idx][:, real][:, :, real].float().masked_fill(~allowed, 0.0)

        p = self.parts
        parts = {
            "query_term": p.query_term[..., :, None].expand_as(p.loglik),
            "key_prior": p.key_prior[..., None, :].expand_as(p.loglik),
            "loglik": p.loglik,
        }
        return _views.decomposition_view(
            self.layer,
            tokens,
            [head_name(self.layer, h) for h in chosen],
            causal,
            allowed,
            {
                "real": sub(self.pattern),
                "prior-only": sub(self.prior_pattern),
                "likelihood-only": sub(self.likelihood_pattern),
            },
            {k: sub(v) for k, v in parts.items()},
            p.key_prior[row][idx][:, real].T.float(),
            p.sigma2,
            self.precap,
            learned_sink=p.sink is not None,
        )


@dataclass(frozen=True)
class OddsRatioResult(viz.Result):
    """What ``compute`` and ``attach`` return: per-head statistics and per-prompt decompositions.

    The decompositions (``{layer: Decomposition}`` per forward pass) are kept when they were asked
    for (``keep_tensors``); ``result[layer]`` is the first pass's.

    Attributes:
        stats: the per-head ``HeadStats``.
        decompositions: per kept pass, ``{layer: Decomposition}`` (query term, key prior,
            log-likelihood and bias ``[batch, head, q, k]``, real and counterfactual patterns).
        sinks: per kept pass, ``{layer: {fact: [batch, head] tensor}}`` (``sink_facts``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> res = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=0)
        >>> res[0].parts.key_prior.shape  # [batch, head, key]
        torch.Size([1, 4, 4])
    """

    stats: HeadStats
    decompositions: tuple[Mapping[int, Decomposition], ...] = ()
    sinks: tuple[dict[int, dict[str, Tensor]], ...] = ()

    def __repr__(self) -> str:
        return f"OddsRatioResult({self.stats!r}, passes_kept={len(self.decompositions)})"

    def __getitem__(self, layer: int) -> Decomposition:
        """The decomposition of ``layer`` in the first kept forward pass."""
        if not self.decompositions:
            raise TLDynamicsError("no per-prompt tensors were kept: pass keep_tensors=True")
        first = self.decompositions[0]
        if layer not in first:
            raise TLDynamicsError(
                f"layer {layer!r} was not decomposed; decomposed layers: {sorted(first)}"
            )
        return first[layer]

    def _head(self, layer: int, head: int) -> Decomposition:
        """One head's decomposition: formed for that head alone when the pass is lazy."""
        first = self.decompositions[0] if self.decompositions else None
        heads_of = getattr(first, "heads_of", None)  # a lazy pass forms one head on demand
        if first is not None and layer in first and heads_of is not None:
            return heads_of(layer, [head])
        return self[layer]

    def to_dataframe(self) -> pd.DataFrame:
        """The per-head table of ``stats`` (``HeadStats.to_dataframe``).

        Returns:
            A pandas DataFrame, one row per head.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=1).to_dataframe().shape[0]
            4
        """
        return self.stats.to_dataframe()

    def sink_table(self) -> pd.DataFrame:
        """Per kept prompt and head: where the sink is, how strong, and why it wins.

        The source position taking most attention (counted in real tokens), its token, mean
        attention mass (over rows with at least two allowed keys), its dominance (its column over the
        next-largest; a near-tie below ``SINK_DOMINANCE`` = 2 is not a sink), whether it wins by
        prior or by likelihood (its attention-weighted score advantage over the row mean, split;
        docs/math.md §2.3), and the mass a learned sink absorbs (``learned_sink_mass``, zero
        without one, §2.6); and Gu et al.'s ``sink_alpha`` of the prompt's first real key (its
        mean weight over the queries that may see it, §2.3), whatever the sink.

        Returns:
            A pandas DataFrame with columns ``pass, prompt, head, layer, position, token, mass,
            prior_adv, loglik_adv, bias_adv, prior_rank, dominance, learned_sink_mass, wins_by,
            sink_alpha``.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> res = odds_ratio.compute(testing.tiny_model("gpt2"), ["a b c a b c", "x = 1"], layers=1)
            >>> res.sink_table().shape  # 2 prompts x 4 heads
            (8, 15)
        """
        records = []
        for p, (sinks, decs) in enumerate(zip(self.sinks, self.decompositions)):
            for layer, facts in sinks.items():
                dec = decs.get(layer)
                for b in range(facts["sink_mass"].shape[0]):
                    real = torch.nonzero(dec.allowed[b].any(0)).flatten().tolist() if dec else []
                    toks = [dec.str_tokens[b][i] for i in real] if dec and dec.str_tokens else []
                    for h, head in enumerate(self.stats.heads):
                        pos = int(facts["sink_position"][b, h])
                        prior_adv = float(facts["sink_prior_adv"][b, h])
                        loglik_adv = float(facts["sink_loglik_adv"][b, h])
                        records.append(
                            {
                                "pass": p,
                                "prompt": b,
                                "head_name": head_name(layer, head),
                                "layer": layer,
                                "position": pos,
                                "token": toks[pos] if pos < len(toks) else str(pos),
                                "mass": float(facts["sink_mass"][b, h]),
                                "prior_adv": prior_adv,
                                "loglik_adv": loglik_adv,
                                "bias_adv": float(facts["sink_bias_adv"][b, h]),
                                "prior_rank": int(facts["sink_prior_rank"][b, h]),
                                "dominance": float(facts["sink_dominance"][b, h]),
                                "learned_sink_mass": float(facts["learned_sink_mass"][b, h]),
                                "wins_by": "prior" if prior_adv > loglik_adv else "likelihood",
                                "sink_alpha": float(facts["sink_alpha"][b, h]),
                            }
                        )
        return pd.DataFrame.from_records(records)

    def extreme_heads(self) -> list[tuple[int, int, str, float]]:
        """The heads with the largest ``attr_prior`` and the largest ``attr_loglik``.

        The largest share, whatever its value. Whether the head is prior- or likelihood-driven is
        its label (docs/math.md §2.2, §9); ``show_extremes`` says so in words.

        Returns:
            Two tuples ``(layer, head, share name, share)``, for ``"attr_prior"`` then
            ``"attr_loglik"``.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> picks = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b + c").extreme_heads()
            >>> [name for _, _, name, _ in picks]
            ['attr_prior', 'attr_loglik']
        """
        shares = self.stats.shares()
        picks = []
        for key in ("attr_prior", "attr_loglik"):
            values = np.nan_to_num(shares[key], nan=-np.inf)
            a, b = np.unravel_index(int(np.argmax(values)), values.shape)
            picks.append((self.stats.layers[a], self.stats.heads[b], key, float(values[a, b])))
        return picks

    def show(self, heads: int | list[int] | None = None, row: int = 0) -> viz.Group:
        """The per-head table, then every decomposed layer's split of one prompt.

        Args:
            heads: a head, a list of heads, or None (all decomposed heads).
            row: which prompt of the first kept pass to draw.

        Returns:
            A ``viz.Group``: the table, then (when tensors were kept) per layer the real pattern
            beside the prior-only and likelihood-only patterns and the score parts.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> view = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=1).show(heads=0)
            >>> type(view).__name__
            'Group'
        """
        layers = (
            [
                self.decompositions[0][layer].show(heads, row)
                for layer in sorted(self.decompositions[0])
            ]
            if self.decompositions
            else []
        )
        return _views.result_view(self.stats.show(), layers, self.stats.model)

    def show_extremes(self, row: int = 0) -> viz.Group:
        """The per-head table and the split of the two extreme heads on one prompt.

        For each part, the head with the largest share among those carrying its one-part label
        (prior- or likelihood-driven), else the head with the largest share (``extreme_heads``),
        said not to carry it; needs kept tensors.

        Args:
            row: which prompt of the first kept pass to draw.

        Returns:
            A ``viz.Group``: the table, then each extreme head's split with what its share means.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> view = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1").show_extremes()
            >>> type(view).__name__
            'Group'
        """
        ev = self.stats.label_evidence()
        labels = ev.label
        shares = self.stats.shares()
        picks = []
        for layer, head, key, value in self.extreme_heads():
            what = "prior-driven" if key == "attr_prior" else "likelihood-driven"
            carriers = np.where(labels == what, np.nan_to_num(shares[key], nan=-np.inf), -np.inf)
            if np.isfinite(carriers).any():  # the labelled head with the largest share
                a, b = np.unravel_index(int(np.argmax(carriers)), carriers.shape)
                layer, head = self.stats.layers[a], self.stats.heads[b]
                value = float(shares[key][a, b])
            a, b = self.stats.layers.index(layer), self.stats.heads.index(head)
            agree = ev.estimate["kept_prior" if key == "attr_prior" else "kept_loglik"][a, b]
            picks.append(
                (
                    head_name(layer, head),
                    key,
                    value,
                    str(labels[a, b]),
                    float(agree),
                    self._head(layer, head).show([head], row),
                )
            )
        return _views.extremes_view(
            self.stats.show(), picks, self.stats.model, (LABEL_THRESHOLD, SHARP, KEEP)
        )
