"""``compute`` (the whole atlas in one call) and ``report_section``."""

from __future__ import annotations

import re
import warnings
from typing import Any, Sequence

import numpy as np

from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, shuffled_weights
from tl_dynamics.atlas import _measure
from tl_dynamics.atlas._ablate import DELTA_KEYS, EXACT_TOP, causal_columns, unpatchable
from tl_dynamics.atlas._probes import N_SEQ, SEED, SEQ_LEN, Probes, build_probes
from tl_dynamics.atlas._result import HeadAtlas
from tl_dynamics.atlas._evidence import margins
from tl_dynamics.atlas._mechanism import mechanism_scores
from tl_dynamics.atlas._roles import (
    FLOORS,
    MARGIN,
    HeadRoles,
    classify,
    controls,
)
from tl_dynamics.errors import TLDynamicsError


def _head_scores(scores: dict[str, np.ndarray], layer: int, head: int) -> dict[str, float]:
    return {k: float(v[layer, head]) for k, v in scores.items()}


def _supporting_kcomp(
    adapter: ModelAdapter,
    control: ModelAdapter,
    probes,
    real: dict,
    ctrl: dict,
    c: dict[str, float],
    pairs: list[tuple[int, int]],
) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
    """Supporting evidence where it applies (attention-only models: the weights are the whole
    path): ``ind_kcomp``, the token-level K-circuit through every earlier previous-token head, for
    heads whose induction pattern clears its control, on the model and on the control."""
    prev = [
        (layer, head)
        for layer in range(adapter.n_layers)
        for head in range(adapter.n_heads)
        if "previous-token" in classify(_head_scores(real, layer, head), c).roles
    ]
    via_of = {pair: tuple(p for p in prev if p[0] < pair[0]) for pair in pairs}
    if not adapter.attention_only:
        return via_of
    rows = _measure.kcomp_rows(probes)
    control_values = []
    for layer, head in pairs:
        via = via_of[(layer, head)]
        if not via or real["ind_pattern"][layer, head] < c["ind_pattern"] + MARGIN:
            continue
        real["ind_kcomp"][layer, head] = _measure.k_composition(adapter, (layer, head), via, rows)
        ctrl["ind_kcomp"][layer, head] = _measure.k_composition(control, (layer, head), via, rows)
        control_values.append(ctrl["ind_kcomp"][layer, head])
    chance = 1.0 / max(len(rows), 1)
    c["ind_kcomp"] = max(control_values + [chance])
    return via_of


def _mechanisms(
    adapter: ModelAdapter,
    probes: Probes,
    real: _measure.Measurements,
    ctrl: _measure.Measurements,
    c: dict[str, float],
    pairs: list[tuple[int, int]],
    notes: list[str],
) -> None:
    """Fill ``ind_mech`` and ``dup_mech`` (``_mechanism``: read on the pass) for the heads whose
    induction or duplicate-token pattern comes within half a margin of its control, per probe,
    so their intervals are formed like the patterns'. The control's value is an upper bound, not
    a second QK attribution: a mechanism share counts only rows whose most attended key is the
    target, so no control head's share exceeds its ``ind_top`` / ``dup_top``."""
    heads_of: dict[int, list[int]] = {}
    for layer, head in pairs:
        near = [
            real.scores[k][layer, head] >= c[k] + MARGIN / 2 for k in ("ind_pattern", "dup_pattern")
        ]
        if any(near):
            heads_of.setdefault(layer, []).append(head)
    got, why, feeders = mechanism_scores(adapter, probes, heads_of)
    real.feeders = feeders
    if why:
        notes.append(why)
    for key, values in got.items():
        real.per_probe[key] = values
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # heads not measured stay NaN
            real.scores[key] = np.nanmean(values, 0) if values.size else values.sum(0)
        bound = ctrl.per_probe[key.replace("_mech", "_top")]
        ctrl.per_probe[key], ctrl.scores[key] = bound, bound.mean(0)
        c[key] = float(np.nanmax(ctrl.scores[key]))


def _suppression_circuits(
    adapter: ModelAdapter,
    control: ModelAdapter,
    probes: Probes,
    real: dict,
    ctrl: dict,
    c: dict[str, float],
    pairs: list[tuple[int, int]],
    notes: list[str],
) -> None:
    """Fill ``suppression_qk`` for heads whose negative copying clears its control, where the
    weights-only QK read-out applies (attention-only models): the QK side of copy suppression
    (``_measure.suppression_qk``), on the model and on the same head of the control; the control
    value is the largest of those and chance (one key in d_vocab)."""
    vocab = int(adapter.W_E.shape[0])
    c["suppression_qk"] = float("nan")
    if not adapter.attention_only:
        if any(real["neg_copy_pass"][p] >= c["neg_copy_pass"] + MARGIN for p in pairs):
            notes.append(
                "copy-suppression's QK side is read from the weights (W_U to W_E), which see "
                "through no MLP: on this model it is not measured, so heads that write against "
                "what they read are 'negative copying'"
            )
        return
    if adapter.W_U.shape[1] != vocab:
        notes.append(
            f"the copy-suppression QK circuit needs W_U over W_E's vocabulary ({vocab} "
            f"tokens; W_U has {adapter.W_U.shape[1]}): negative copying heads stay so"
        )
        return
    rows = _measure.kcomp_rows(probes)
    control_values = []
    for layer, head in pairs:
        if not real["neg_copy_pass"][layer, head] >= c["neg_copy_pass"] + MARGIN:
            continue
        real["suppression_qk"][layer, head] = _measure.suppression_qk(adapter, layer, head, rows)
        ctrl["suppression_qk"][layer, head] = _measure.suppression_qk(control, layer, head, rows)
        control_values.append(ctrl["suppression_qk"][layer, head])
    c["suppression_qk"] = max(control_values + [1.0 / vocab])


_HEAD_NAME = re.compile(r"^L(\d+)H(\d+)$")


def _pairs_of(adapter: ModelAdapter, layers: Any, heads: Any) -> list[tuple[int, int]]:
    """The asked ``(layer, head)`` pairs: the grid of ``layers`` x ``heads``, or the heads named
    one by one (``(layer, head)`` tuples or ``"L<layer>H<head>"``), checked against the model."""
    named = (
        isinstance(heads, (list, tuple))
        and len(heads) > 0
        and all(isinstance(h, (tuple, list, str)) for h in heads)
    )
    if not named:
        ls, hs = adapter.check_attention_layers(layers), adapter.check_heads(heads)
        return [(layer, head) for layer in ls for head in hs]
    if layers is not None:
        raise TLDynamicsError(
            "atlas.compute: give either layers= with head indices, or heads= as (layer, head) "
            f"pairs or names like 'L1H3' with layers=None; got layers={layers!r}, heads={heads!r}"
        )
    out: list[tuple[int, int]] = []
    for h in heads:
        match = _HEAD_NAME.match(h) if isinstance(h, str) else None
        if isinstance(h, str) and match is None:
            raise TLDynamicsError(f"atlas.compute: {h!r} is not a head name like 'L1H3'")
        if match is not None:
            layer, head = int(match[1]), int(match[2])
        elif isinstance(h, (tuple, list)) and len(h) == 2 and all(isinstance(x, int) for x in h):
            layer, head = int(h[0]), int(h[1])
        else:
            raise TLDynamicsError(f"atlas.compute: {h!r} is not a (layer, head) pair")
        pair = (adapter.check_attention_layers([layer])[0], adapter.check_heads([head])[0])
        if pair not in out:
            out.append(pair)
    return out


def compute(
    model: Any,
    prompts: Prompt | Batch | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | Sequence[tuple[int, int]] | Sequence[str] | None = None,
    n_seq: int = N_SEQ,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    causal: bool = True,
    exact: int = EXACT_TOP,
) -> HeadAtlas:
    """What every asked head does, from its pattern, its weights and its causal cost.

    ``prompts`` (anything ``adapter.tokenize`` takes) are the natural probes for sinks,
    locality and the causal losses; by default the ``n_seq`` repeated random sequences of
    ``seq_len`` token ids (seeded) serve for everything, so no tokenizer is needed, and the
    causal losses are taken on their second copy (``delta_loss_unrepeated``: on the first). Every
    score is compared with the same score on a weight-shuffled copy of the model (seeded by
    ``seed``); ``causal=False`` skips the interventions (delta_loss NaN). ``layers`` and
    ``heads`` select the rows (all scores that roles depend on, such as earlier
    previous-token heads, are read from every head).

    It runs where ``model`` is, in its dtype, like every analysis: there is no ``device=``
    (moving the caller's model, or copying an 8B one, is not this function's to do); load the
    model where it should run, ``load_model(name, device="cuda", dtype="bfloat16")``, or move it
    with ``model.to(...)`` first. ``tl-dynamics heads --device/--dtype`` does the former.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: natural probes (text, texts, ``[batch, pos]`` token ids or a ``Batch``), or
            None for the repeated random sequences.
        layers: a layer index, a list of them, or None (all layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer; or
            the heads themselves, ``[(18, 6), (17, 3)]`` or ``["L18H6", "L17H3"]`` (then
            ``layers`` stays None): exactly those are measured and ablated.
        n_seq: number of repeated random probe sequences.
        seq_len: length of the repeated sequence ``R`` (a probe is ``[prefix] R R``).
        seed: seed of the probes and of the weight-shuffled control.
        causal: run the interventions: every asked head's mean-ablation effect estimated by
            attribution patching (one forward and one backward pass), and the exact mean
            ablation and prior/likelihood patching of every named head, of every head on models
            of at most 64, else of the ``exact`` heads the estimate ranks first.
        exact: how many heads the estimate's ranking sends to exact ablation on larger models.

    Returns:
        A ``HeadAtlas``.

    Example:
        >>> from tl_dynamics import atlas, zoo
        >>> res = atlas.compute(zoo.load("induction-2l"))
        >>> res.heads_with("induction")
        [(1, 0), (1, 1), (1, 2), (1, 3)]
        >>> bool(res.to_dataframe()["delta_loss"].iloc[0] > 0)   # ablating L0H0 costs loss
        True
    """
    adapter = ModelAdapter.of(model)
    pairs = _pairs_of(adapter, layers, heads)
    chosen_layers = sorted({layer for layer, _ in pairs})
    chosen_heads = sorted({head for _, head in pairs})
    named = layers is not None or heads is not None
    if not isinstance(causal, bool):
        raise TLDynamicsError(f"causal must be True or False, got {causal!r}")
    if isinstance(exact, bool) or not isinstance(exact, int) or exact < 0:
        raise TLDynamicsError(f"exact must be a non-negative int, got {exact!r}")
    probes = build_probes(adapter, prompts, n_seq, seq_len, seed)
    real = _measure.measure(adapter, probes, keep=causal, chance=True)
    control = shuffled_weights(adapter, seed)
    ctrl = _measure.measure(control, probes)
    for m in (real, ctrl):
        m.scores["neg_ov_copying"] = -m.scores["ov_copying"]
        m.scores["neg_copy_pass"] = -m.scores["copy_pass"]
        m.per_probe["neg_copy_pass"] = -m.per_probe["copy_pass"]
        m.scores["ind_kcomp"] = np.full((adapter.n_layers, adapter.n_heads), np.nan)
        m.scores["suppression_qk"] = np.full((adapter.n_layers, adapter.n_heads), np.nan)
    c = controls(ctrl.scores)
    # the weight scores' one null: the circuits section's chance level (random heads reading the
    # model's own embeddings), symmetric about 0, so the negative side's is the same
    for key, chance in real.chances.items():
        c[key] = chance
        if key == "ov_copying":
            c["neg_ov_copying"] = chance
    notes = list(real.notes)
    _mechanisms(adapter, probes, real, ctrl, c, pairs, notes)
    via_of = _supporting_kcomp(adapter, control, probes, real.scores, ctrl.scores, c, pairs)
    _suppression_circuits(adapter, control, probes, real.scores, ctrl.scores, c, pairs, notes)
    ci = margins(real.per_probe, ctrl.per_probe, seed, tuple(FLOORS))  # [layer, head] each

    def head_ci(layer: int, head: int) -> dict[str, tuple[float, float, int]]:
        return {
            k: (float(lo[layer, head]), float(hi[layer, head]), n) for k, (lo, hi, n) in ci.items()
        }

    roles: dict[tuple[int, int], HeadRoles] = {
        pair: classify(_head_scores(real.scores, *pair), c, via_of[pair], head_ci(*pair))
        for pair in pairs
    }

    shape = (adapter.n_layers, adapter.n_heads)
    nan = np.full(shape, np.nan)
    columns: dict[str, Any] = {
        "delta": {kind: nan.copy() for kind in DELTA_KEYS},
        "ci": {kind: (nan.copy(), nan.copy()) for kind in DELTA_KEYS},
        "clean": float("nan"),
        "exact": [],
        "agreement": {},
    }
    if causal and adapter.is_encoder:
        notes.append("causal evidence not run: an encoder has no next-token loss")
    elif causal and (why := unpatchable(adapter, chosen_layers)) is not None:
        notes.append(f"causal evidence not run: {why}")  # e.g. delegated attention
    elif causal:
        feeders = tuple(
            sorted(
                {
                    lead
                    for pair, counts in real.feeders.items()
                    if "induction" in roles[pair].roles
                    for lead, _ in counts.most_common(1)
                }
            )
        )
        columns = causal_columns(
            adapter, probes, real.captures, pairs, named, seed, notes, top=exact, feeders=feeders
        )
    probe_info = {
        "n_seq": n_seq,
        "seq_len": seq_len,
        "seed": seed,
        "user_prompts": probes.user_prompts,
        "natural_tokens": tuple(probes.natural.tokens.shape),
    }
    return HeadAtlas(
        model=adapter.info.architecture,
        n_layers=adapter.n_layers,
        n_heads=adapter.n_heads,
        layers=tuple(chosen_layers),
        heads=tuple(chosen_heads),
        roles=roles,
        scores=real.scores,
        control_scores=ctrl.scores,
        controls=c,
        delta_loss=columns["delta"],
        clean_loss=columns["clean"],
        delta_ci=columns["ci"],
        exact=tuple(columns["exact"]),
        atp_agreement=columns["agreement"],
        pairs=tuple(pairs),
        probes=probe_info,
        notes=tuple(notes),
    )
