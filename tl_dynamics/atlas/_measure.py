"""Every per-head score the roles are read from, for one model (the real one or its control).

Pattern scores come from one captured forward pass over the repeated probes (and one over the
natural probes when the user gave prompts); weight scores from ``tl_dynamics.circuits``; the
sink and its cause from ``tl_dynamics.odds_ratio.sink_facts``. All arrays are ``[n_layers,
n_heads]`` float64, NaN where a score does not apply to the model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics import circuits, odds_ratio
from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter
from tl_dynamics.atlas._copying import CopyReader
from tl_dynamics.atlas._probes import Probes
from tl_dynamics.errors import TLDynamicsError

# Keys within this many positions of the query (the query included) count as "local".
LOCAL_WINDOW = 4
# Token ids sampled as rows of the token-level K-composition circuit.
KCOMP_ROWS = 256

# Repeated probes captured at once: every score is a mean over probes of equal length, so the
# probes run in chunks of this many and the chunk means are averaged by size; memory stays flat
# in n_seq (``tl-dynamics heads --n-seq 100000`` holds 32 probes' patterns at a time).
PROBE_CHUNK = 32

PATTERN_KEYS = ("prev_pattern", "dup_pattern", "ind_pattern", "ind_top", "dup_top", "copy_pass")
NATURAL_KEYS = (
    "sink_mass",
    "sink_first",
    "sink_dominant",
    "sink_prior_adv",
    "sink_loglik_adv",
    "learned_sink",
    "local_mass",
)


@dataclass
class Measurements:
    """Scores ``[layer, head]`` by name (see ``SCORES`` in ``_roles``) and, for the real model,
    the per-layer captures the causal step needs."""

    scores: dict[str, np.ndarray]
    chances: dict[str, float] = field(default_factory=dict)  # weight scores' chance levels
    captures: dict[int, LayerAttention] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    per_probe: dict[str, np.ndarray] = field(default_factory=dict)  # [probe, layer, head]
    # per induction head, the heads whose output led its key side (``_mechanism``), counted
    feeders: dict[tuple[int, int], Any] = field(default_factory=dict)


def _rows(la: LayerAttention) -> Tensor:
    """Valid query rows with at least two allowed keys ``[batch, q]``."""
    return la.query_valid & (la.allowed.sum(-1) >= 2)


def _target_mass(pattern: Tensor, queries: Sequence[int], shift: int) -> Tensor:
    """Per probe, the mean over ``queries`` of the attention from ``i`` to ``i - shift``
    ``[batch, head]``."""
    q = torch.tensor(list(queries), dtype=torch.long)
    return pattern[:, :, q, q - shift].mean(dim=2)


def pattern_scores(la: LayerAttention, probes: Probes) -> dict[str, Tensor]:
    """Previous-token, duplicate-token and induction attention on the repeated probes, per
    probe ``[batch, head]``; ``ind_top``/``dup_top``: the share of second-copy rows whose most
    attended key is the induction / duplicate-token target (what bounds a mechanism share, which
    counts only such rows)."""
    pattern = la.pattern()
    n, start = probes.seq_len, probes.offset
    second = list(probes.second_copy)
    q = torch.tensor(second, dtype=torch.long, device=pattern.device)
    top = pattern[:, :, q].argmax(-1)  # [b, h, rows]
    return {
        "prev_pattern": _target_mass(pattern, range(start + 1, start + 2 * n), 1),
        "dup_pattern": _target_mass(pattern, second, n),
        "ind_pattern": _target_mass(pattern, second, n - 1),
        "ind_top": (top == q - n + 1).float().mean(-1),
        "dup_top": (top == q - n).float().mean(-1),
    }


def natural_scores(la: LayerAttention) -> dict[str, Tensor]:
    """Sink mass, dominance and position, its cause (odds-ratio split), the mass a learned
    sink absorbs (``learned_sink``; NaN on layers without one) and local mass ``[head]`` each.

    The sink of a prompt is the key with the most attention summed over the rows that choose
    among at least two keys; its mass is that sum over the number of rows. It dominates when
    that column is at least ``odds_ratio.HeadStats.SINK_DOMINANCE`` times the next-largest
    (``sink_dominant``: the share of prompts where it does; ``sink_first``: the share where a
    dominant sink is the first real token, ``odds_ratio``'s first-token rule). Its cause: the
    attention-weighted advantage of that key over the row mean, split into key prior and
    distance log-likelihood (``odds_ratio.sink_facts``; docs/math.md §2.3). Each per prompt,
    ``[batch, head]`` (the prompts are the units of their intervals, docs/math.md §9).
    """
    sinks = odds_ratio.sink_facts(la)  # [b, h] each
    pattern = la.pattern()  # [b, h, q, k]
    rows = _rows(la)
    n_rows = rows.float().sum(-1).clamp(min=1.0)[:, None]  # [b, 1]
    first_real = la.allowed.any(1).float().argmax(-1)  # [b]
    positions = torch.arange(pattern.shape[-1], device=pattern.device)
    near = (positions[:, None] - positions[None, :]).abs() < LOCAL_WINDOW  # [q, k]
    not_first = positions[None, :] != first_real[:, None]  # [b, k]
    local = near[None] & not_first[:, None, :]  # [b, q, k]
    local_mass = ((pattern * local[:, None].float()).sum(-1) * rows[:, None].float()).sum(
        -1
    ) / n_rows
    dominant = sinks["sink_dominance"] >= odds_ratio.HeadStats.SINK_DOMINANCE  # [b, h]
    return {
        "sink_mass": sinks["sink_mass"],
        "sink_first": ((sinks["sink_position"] == 0) & dominant).float(),
        "sink_dominant": dominant.float(),
        "sink_prior_adv": sinks["sink_prior_adv"],
        "sink_loglik_adv": sinks["sink_loglik_adv"],
        "learned_sink": sinks["learned_sink_mass"]
        if la.sink_logit is not None
        else torch.full_like(local_mass, float("nan")),
        "local_mass": local_mass,
    }


def _capture(adapter: ModelAdapter, batch: Batch, on_layer) -> None:
    # learned sinks (GPT-OSS) are modelled: the odds-ratio split's virtual key (docs/math.md §2.6)
    with adapter.capture(on_layer, batch=batch, sinks=True):
        adapter.forward(batch)


def weight_scores(
    adapter: ModelAdapter, n_pos: int, notes: list[str], chances: dict[str, float] | None = None
) -> dict[str, np.ndarray]:
    """OV copying, QK positivity and the masked positional circuit's previous-token share: the
    share of query positions ``2..n-1`` whose highest-scoring key position (causally masked,
    the first position left out) is the previous one, in ``(W_pos W_Q)(W_pos W_K)^T``. With
    ``chances``, fills it with the OV copying and QK positivity scores' chance levels, the
    circuits section's own (``circuits.copying_scores(...).chance``: random heads reading the
    model's own embeddings, docs/math.md §4.3): one null per score. Without ``chances`` (the
    control model, whose weights-only scores nothing reads) only the positional circuit."""
    shape = (adapter.n_layers, adapter.n_heads)
    out = {
        "prev_circuit": np.full(shape, np.nan),
        "ov_copying": np.full(shape, np.nan),
        "qk_positivity": np.full(shape, np.nan),
    }
    if chances is not None:  # the control's weights-only scores are not read (chance is)
        try:
            # rows of the attention layers (every layer but a hybrid's other layer types)
            rows = adapter.attention_layers
            ov = circuits.copying_scores(adapter, chance=True)
            qk = circuits.qk_positivity_scores(adapter, chance=True)
            out["ov_copying"][rows] = ov.scores.double().numpy()
            out["qk_positivity"][rows] = qk.scores.double().numpy()
            if ov.chance is not None and qk.chance is not None:
                chances.update(ov_copying=ov.chance, qk_positivity=qk.chance)
        except TLDynamicsError as exc:
            notes.append(f"OV copying and QK positivity not available: {exc}")
    if adapter.W_pos is None:
        notes.append(
            "no learned position embeddings: the positional circuit does not apply, so "
            "previous-token heads are read from the pattern alone"
        )
        return out
    n = min(n_pos, adapter.n_ctx)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    queries = torch.arange(2, n)
    positions = adapter.W_pos[:n]
    for layer in adapter.attention_layers:
        mask = causal if adapter.specs[layer].causal else torch.ones(n, n, dtype=torch.bool)
        mask = mask.clone()
        mask[:, 0] = False  # the first position is the sink's place, not a relative position
        for head in range(adapter.n_heads):
            # Without biases: b_Q adds a key-only term (a positional key prior) that can make
            # one position win every row (the first, on MiniLM), which says nothing about offsets.
            # The positional circuit on the first n positions only (rows W_pos[:n]).
            matrix = circuits.qk_circuit(
                adapter, layer, head, inputs=positions, biases=False
            ).matrix
            block = (matrix.A @ matrix.B).cpu().masked_fill(~mask, float("-inf"))
            out["prev_circuit"][layer, head] = float(
                (block[queries].argmax(-1) == queries - 1).float().mean()
            )
    return out


def chunks(batch: Batch, size: int | None = None):
    """``(rows, share)``: consecutive row slices of ``batch`` (``PROBE_CHUNK`` rows each by
    default) and each one's share of its rows."""
    n, size = batch.tokens.shape[0], size or PROBE_CHUNK
    for start in range(0, n, size):
        part = Batch(
            batch.tokens[start : start + size],
            batch.key_valid[start : start + size],
            batch.padding_side,
        )
        yield part, part.tokens.shape[0] / n


def measure(
    adapter: ModelAdapter, probes: Probes, keep: bool = False, chance: bool = False
) -> Measurements:
    """All scores of every head; ``keep`` also keeps the natural probes' captured layers when
    the user gave them (the repeated probes run in chunks, see ``PROBE_CHUNK``, and the causal
    step captures each chunk again); ``chance``: the weight scores' chance levels too."""
    shape = (adapter.n_layers, adapter.n_heads)
    # per probe, per layer: the pattern scores of the repeated probes, the natural ones' sinks
    rows: dict[str, dict[int, list[np.ndarray]]] = {k: {} for k in PATTERN_KEYS + NATURAL_KEYS}
    captures: dict[int, LayerAttention] = {}
    same = probes.natural is probes.repeat

    def add(values: dict[str, Tensor], layer: int) -> None:
        for key, value in values.items():
            rows[key].setdefault(layer, []).append(value.double().cpu().numpy())

    copy = CopyReader(adapter, probes)
    tokens: dict[str, Tensor] = {}  # the chunk being run

    def on_repeat(la: LayerAttention) -> None:
        add({**pattern_scores(la, probes), "copy_pass": copy(la, tokens["now"])}, la.layer)
        if same:
            add(natural_scores(la), la.layer)

    def on_natural(la: LayerAttention) -> None:
        add(natural_scores(la), la.layer)
        if keep:
            captures[la.layer] = la

    for part, _ in chunks(probes.repeat):
        tokens["now"] = part.tokens
        _capture(adapter, part, on_repeat)
    if not same:
        _capture(adapter, probes.natural, on_natural)
    per_probe: dict[str, np.ndarray] = {}
    for key, by_layer in rows.items():
        n = probes.repeat.tokens.shape[0] if key in PATTERN_KEYS else probes.natural.tokens.shape[0]
        x = np.zeros((n, *shape))
        for layer, parts in by_layer.items():
            x[:, layer] = np.concatenate(parts)
        per_probe[key] = x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a score NaN in every probe stays NaN
        scores = {k: v.mean(0) for k, v in per_probe.items()}
    notes: list[str] = []
    chances: dict[str, float] = {}
    n_pos = int(probes.repeat.tokens.shape[1])
    scores.update(weight_scores(adapter, n_pos, notes, chances if chance else None))
    return Measurements(
        scores=scores, chances=chances, captures=captures, notes=notes, per_probe=per_probe
    )


def capture_layers(adapter: ModelAdapter, batch: Batch) -> dict[int, LayerAttention]:
    """Every layer's capture of one forward pass over ``batch``."""
    out: dict[int, LayerAttention] = {}

    def keep(la: LayerAttention) -> None:
        out[la.layer] = la

    _capture(adapter, batch, keep)
    return out


def k_composition(
    adapter: ModelAdapter, later: tuple[int, int], earlier: Sequence[tuple[int, int]], rows: Tensor
) -> float:
    """Share of ``rows`` tokens for which the later head's token-level K-circuit through the
    ``earlier`` heads prefers the key whose previous token is the query's own token."""
    if not earlier:
        return float("nan")
    return float(circuits.token_composition(adapter, "K", later, list(earlier), rows=rows).fraction)


def kcomp_rows(probes: Probes) -> Tensor:
    """Up to ``KCOMP_ROWS`` distinct token ids of the repeated probes (the composition rows)."""
    ids = probes.repeat.tokens[:, probes.offset :].reshape(-1).unique()
    return ids[:KCOMP_ROWS]


def suppression_qk(adapter: ModelAdapter, layer: int, head: int, rows: Tensor) -> float:
    """The QK side of copy suppression: the share of ``rows`` tokens ``t`` for which the head's
    QK circuit ``W_U^T W_Q W_K^T W_E^T``, with the unembedding direction ``W_U[:, t]`` of the
    token the query's residual stream predicts on the query side and the token embeddings on
    the key side, ranks the key ``t`` first among every vocabulary token (biases, LayerNorm and
    the rotary rotation beyond offset 0 left out, as in ``circuits.qk_circuit``)."""
    rows = rows.to(adapter.W_U.device)
    circuit = circuits.qk_circuit(
        adapter, layer, head, inputs=(adapter.W_U.T[rows], adapter.W_E), biases=False
    )  # query rows: only the probe tokens' directions
    best = circuit.topk(1, bottom=False).indices[:, 0]
    return float((best.to(rows.device) == rows).float().mean())
