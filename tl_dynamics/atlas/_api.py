"""``compute`` (the whole atlas in one call) and ``report_section``."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, shuffled_weights
from tl_dynamics.atlas import _measure
from tl_dynamics.atlas._causal import KINDS, causal_deltas
from tl_dynamics.atlas._probes import N_SEQ, SEED, SEQ_LEN, Probes, build_probes
from tl_dynamics.atlas._result import HeadAtlas
from tl_dynamics.atlas._evidence import margins
from tl_dynamics.atlas._roles import (
    FLOORS,
    LEARNED_SINK_FLOOR,
    MARGIN,
    HeadRoles,
    classify,
    controls,
)
from tl_dynamics.errors import TLDynamicsError


def _head_scores(scores: dict[str, np.ndarray], layer: int, head: int) -> dict[str, float]:
    return {k: float(v[layer, head]) for k, v in scores.items()}


def _induction_circuits(
    adapter: ModelAdapter,
    control: ModelAdapter,
    probes,
    real: dict,
    ctrl: dict,
    c: dict[str, float],
    pairs: list[tuple[int, int]],
) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
    """Fill ``ind_kcomp`` for heads whose induction pattern clears its control: the token-level
    K-circuit through every earlier previous-token head, on the model and on the control."""
    prev = [
        (layer, head)
        for layer in range(adapter.n_layers)
        for head in range(adapter.n_heads)
        if "previous-token" in classify(_head_scores(real, layer, head), c).roles
    ]
    rows = _measure.kcomp_rows(probes)
    via_of: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
    control_values = []
    for layer, head in pairs:
        via = tuple(p for p in prev if p[0] < layer)
        via_of[(layer, head)] = via
        if not via or real["ind_pattern"][layer, head] < c["ind_pattern"] + MARGIN:
            continue
        real["ind_kcomp"][layer, head] = _measure.k_composition(adapter, (layer, head), via, rows)
        ctrl["ind_kcomp"][layer, head] = _measure.k_composition(control, (layer, head), via, rows)
        control_values.append(ctrl["ind_kcomp"][layer, head])
    chance = 1.0 / max(len(rows), 1)
    c["ind_kcomp"] = max(control_values + [chance])
    return via_of


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
    """Fill ``suppression_qk`` for heads whose negative OV copying clears its control: the QK
    side of copy suppression (``_measure.suppression_qk``), on the model and on the same head
    of the control; the control value is the largest of those and chance (one key in d_vocab)."""
    vocab = int(adapter.W_E.shape[0])
    if adapter.W_U.shape[1] != vocab:
        notes.append(
            f"the copy-suppression QK circuit needs W_U over W_E's vocabulary ({vocab} "
            f"tokens; W_U has {adapter.W_U.shape[1]}): negative copying heads stay so"
        )
        c["suppression_qk"] = float("nan")
        return
    rows = _measure.kcomp_rows(probes)
    control_values = []
    for layer, head in pairs:
        if not real["neg_ov_copying"][layer, head] >= c["neg_ov_copying"] + MARGIN:
            continue
        real["suppression_qk"][layer, head] = _measure.suppression_qk(adapter, layer, head, rows)
        ctrl["suppression_qk"][layer, head] = _measure.suppression_qk(control, layer, head, rows)
        control_values.append(ctrl["suppression_qk"][layer, head])
    c["suppression_qk"] = max(control_values + [1.0 / vocab])


DELTA_KEYS = KINDS + ("mean_unrepeated",)


def _causal(
    adapter: ModelAdapter, probes: Probes, captures: dict, selected: dict, targets: dict
) -> tuple[dict, dict[str, float], bool]:
    """``causal_deltas`` on the natural probes; the repeated probes (equal lengths, no padding)
    run in chunks of ``_measure.PROBE_CHUNK``, each loss a mean over the same number of tokens
    per probe, so the size-weighted mean of the chunks' losses is the whole batch's."""
    if probes.natural is not probes.repeat:
        return causal_deltas(adapter, probes.natural, captures, selected, targets)
    found: dict = {}
    losses: dict[str, float] = {}
    shared = False
    for part, share in _measure.chunks(probes.repeat):
        got, clean, shared = causal_deltas(
            adapter, part, _measure.capture_layers(adapter, part), selected, targets
        )
        for key, value in got.items():
            found[key] = found.get(key, 0.0) + share * value
        for key, value in clean.items():
            losses[key] = losses.get(key, 0.0) + share * value
    return found, losses, shared


def _targets(probes: Probes) -> dict[str, Tensor | None]:
    """Which predicted positions the losses average over: on the repeated probes, the second
    copy (where repetition makes tokens predictable) and, as a control, the first copy."""
    if probes.user_prompts:
        return {"all": None}
    n_pos = probes.repeat.tokens.shape[1]
    second = torch.zeros(n_pos, dtype=torch.bool)
    second[list(probes.second_copy)] = True
    first = torch.zeros(n_pos, dtype=torch.bool)
    first[list(probes.first_copy)] = True
    return {"repeated": second, "unrepeated": first}


def _unpatchable(adapter: ModelAdapter, layers: list[int]) -> str | None:
    """Why the host cannot patch the heads' ``z`` or pattern in ``layers`` (``ModelAdapter.patch``
    refuses before any pass: no such hook, or a hook whose edits the host discards), or None."""
    keep = [(role, layer, lambda t: None) for layer in layers for role in ("z", "pattern")]
    try:
        with adapter.patch(keep):
            pass
    except TLDynamicsError as exc:
        return str(exc)
    return None


def _causal_columns(
    adapter: ModelAdapter,
    probes: Probes,
    real: Any,
    layers: list[int],
    heads: list[int],
    deltas: dict[str, np.ndarray],
    notes: list[str],
) -> float:
    """Fill ``deltas`` with the interventions' loss changes, note how they ran, return the
    clean loss."""
    targets = _targets(probes)
    main = next(iter(targets))
    found, losses, shared = _causal(
        adapter, probes, real.captures, {layer: heads for layer in layers}, targets
    )
    deltas.update({kind: found[(kind, main)] for kind in KINDS})
    if "unrepeated" in targets:
        deltas["mean_unrepeated"] = found[("mean", "unrepeated")]
    clean = losses[main]
    where = (
        "on the second copy of the repeated probes"
        if main == "repeated"
        else "on the given prompts"
    )
    notes.append(
        f"clean next-token loss {where}: {clean:.3f} nats; "
        + (
            "earlier layers run once per layer of variants"
            if shared
            else "every variant re-runs the whole model (this host does not let a "
            "hook grow the batch)"
        )
    )
    return clean


def compute(
    model: Any,
    prompts: Prompt | Batch | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    n_seq: int = N_SEQ,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    causal: bool = True,
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
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        n_seq: number of repeated random probe sequences.
        seq_len: length of the repeated sequence ``R`` (a probe is ``[prefix] R R``).
        seed: seed of the probes and of the weight-shuffled control.
        causal: run the interventions (mean ablation, prior/likelihood patching).

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
    chosen_layers, chosen_heads = adapter.check_attention_layers(layers), adapter.check_heads(heads)
    if not isinstance(causal, bool):
        raise TLDynamicsError(f"causal must be True or False, got {causal!r}")
    probes = build_probes(adapter, prompts, n_seq, seq_len, seed)
    real = _measure.measure(adapter, probes, keep=causal)
    control = shuffled_weights(adapter, seed)
    ctrl = _measure.measure(control, probes)
    for scores in (real.scores, ctrl.scores):
        scores["neg_ov_copying"] = -scores["ov_copying"]
        scores["ind_kcomp"] = np.full((adapter.n_layers, adapter.n_heads), np.nan)
        scores["suppression_qk"] = np.full((adapter.n_layers, adapter.n_heads), np.nan)
    c = controls(ctrl.scores)
    pairs = [(layer, head) for layer in chosen_layers for head in chosen_heads]
    notes = list(real.notes)
    via_of = _induction_circuits(adapter, control, probes, real.scores, ctrl.scores, c, pairs)
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
    deltas = {kind: np.full(shape, np.nan) for kind in DELTA_KEYS}
    clean = float("nan")
    if causal and adapter.is_encoder:
        notes.append("causal evidence not run: an encoder has no next-token loss")
    elif causal and (why := _unpatchable(adapter, chosen_layers)) is not None:
        notes.append(f"causal evidence not run: {why}")  # e.g. delegated attention
    elif causal:
        clean = _causal_columns(adapter, probes, real, chosen_layers, chosen_heads, deltas, notes)
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
        delta_loss=deltas,
        clean_loss=clean,
        probes=probe_info,
        notes=tuple(notes),
    )


# The report runs the interventions only up to this many heads (three patched variants each);
# larger models get the scores and a pointer to ``tl-dynamics heads``, which runs them all.
REPORT_CAUSAL_HEADS = 64
# The report's natural probe is at most this many leading tokens of its first prompt (the sink
# split costs the square of the length per head).
REPORT_NATURAL_TOKENS = 128


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add "What each head does" to ``page``: the atlas with the report's first prompt as probe.

    The natural probe is the prompt's first 128 real tokens; the causal
    columns are run only on models with at most 64 heads.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); row 0 is used.

    Example:
        >>> from tl_dynamics import atlas, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> atlas.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'What each head does'
    """
    n_heads = adapter.n_layers * adapter.n_heads
    causal = n_heads <= REPORT_CAUSAL_HEADS
    real = batch.real_tokens()
    natural = real[:REPORT_NATURAL_TOKENS]
    result = compute(adapter, adapter.tokenize(natural[None]), causal=causal)
    page.results["atlas"] = result  # the heads a later section (QK attribution) explains
    cut = (
        "the report's prompt"
        if len(natural) == len(real)
        else f"the report's prompt (its first {len(natural)} of {len(real)} tokens)"
    )
    not_run = [n.split(": ", 1)[1] for n in result.notes if n.startswith("causal evidence not run")]
    if not_run:  # the host cannot patch these heads (delegated attention), or an encoder
        cost = f"The causal columns are left out: {not_run[0]}."
    elif causal:
        cost = (
            f"Numbers under a role: the change in next-token loss when the head is mean-ablated "
            f"on {cut}."
        )
    else:
        cost = (
            f"The causal columns are left out of the report for {n_heads} heads (more than "
            f"{REPORT_CAUSAL_HEADS}); `tl-dynamics heads --model M` runs them. Sinks and "
            f"locality are read on {cut}."
        )
    page.add_section(
        "What each head does",
        [result.show()],
        intro=(
            "Each head's roles from mechanism, not one pattern: the pattern on repeated random token "
            "sequences and the weights that produce it (positional circuit, token-level K-circuit "
            "through earlier previous-token heads, OV copying, and for a head that writes against "
            "what it reads the QK circuit that seeks the predicted token), the sink's dominance and "
            "its cause from the odds-ratio "
            "split (and, where the model has them, the mass each head's learned sink absorbs, named "
            f'"learned sink" from {LEARNED_SINK_FLOOR:.2f}), each score against a weight-shuffled copy of the model by a margin of '
            f"{result.margin}. {cost} Hover a cell for the evidence."
        ),
    )
