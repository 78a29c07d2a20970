"""``compute``: one forward pass, every selected layer's predictors in float64 as its attention is
captured, the measure at the end (docs/math.md §8).

``layers`` and ``heads`` follow the one convention of every analysis (``docs/developing.md``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.evidence import N_BOOT
from tl_dynamics.regression._ablation import ablation_effects
from tl_dynamics.regression._measure import Scores, Sums, band_labels, score
from tl_dynamics.regression._predict import (
    GD_STEPS,
    MEMORY_BUDGET,
    RIDGE_PATH,
    chunks,
    intervals,
    predictor_names,
)
from tl_dynamics.regression._result import RegressionResult

MIN_PROMPTS = 4  # with fewer prompts the units are blocks of BLOCK destinations
BLOCK = 16


def _check(stride: int, fit_fraction: float, ridge_path, gd_steps, n_boot: int) -> None:
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise TLDynamicsError(f"regression: stride must be a positive int, got {stride!r}")
    if not 0.0 < float(fit_fraction) < 1.0:
        raise TLDynamicsError(
            f"regression: fit_fraction must lie strictly between 0 and 1, got {fit_fraction!r}"
        )
    if not ridge_path or any(not float(r) > 0 for r in ridge_path):
        raise TLDynamicsError(
            f"regression: ridge_path must be positive numbers, got {ridge_path!r}"
        )
    if not gd_steps or any(isinstance(k, bool) or int(k) != k or k < 1 for k in gd_steps):
        raise TLDynamicsError(f"regression: gd_steps must be positive ints, got {gd_steps!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise TLDynamicsError(f"regression: n_boot must be a positive int, got {n_boot!r}")


def _kv_of(la: LayerAttention, heads: list[int], n_kv: int) -> list[int]:
    """The key/value head of each query head: ``h // (H / n_kv)`` where the expanded keys and
    values confirm it, else each head its own."""
    group = max(1, la.n_heads // max(1, n_kv))
    kv = [h // group for h in heads]
    for h, g in zip(heads, kv):
        rep = g * group
        if not (
            torch.equal(la.k[:, :, h], la.k[:, :, rep])
            and torch.equal(la.v[:, :, h], la.v[:, :, rep])
        ):
            return list(range(len(heads)))
    return kv


def layer_predictions(
    la: LayerAttention,
    heads: list[int],
    n_kv: int,
    dest_b: torch.Tensor,
    dest_t: torch.Tensor,
    budget: int = MEMORY_BUDGET,
    ridge_path: Sequence[float] = RIDGE_PATH,
    gd_steps: Sequence[int] = GD_STEPS,
):
    """The chunks of ``chunks`` for one captured layer: float64 scaled queries of ``heads``, the
    keys and values of their key/value heads (deduplicated)."""
    kv = _kv_of(la, heads, n_kv)
    firsts: dict[int, int] = {}
    for h, g in zip(heads, kv):
        firsts.setdefault(g, h)
    order = sorted(firsts)
    src = [firsts[g] for g in order]
    local = [order.index(g) for g in kv]
    f64 = torch.float64
    q = la.q[:, :, heads].to(f64) * la.scale
    k, v = la.k[:, :, src].to(f64), la.v[:, :, src].to(f64)
    sink = None if la.sink_logit is None else la.sink_logit[heads].to(f64)
    return chunks(q, k, v, la.allowed, local, dest_b, dest_t, budget, ridge_path, gd_steps, sink)


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    stride: int = 1,
    fit_fraction: float = 0.5,
    ridge_path: Sequence[float] = RIDGE_PATH,
    gd_steps: Sequence[int] = GD_STEPS,
    n_boot: int = N_BOOT,
    seed: int = 0,
    memory_budget: int = MEMORY_BUDGET,
    positions: Sequence[int] | torch.Tensor | None = None,
    ablation: bool = True,
) -> RegressionResult:
    """Which heads' outputs are closest to in-context regression of values on keys.

    Per head and destination the head's real ``z`` (before ``W_O``) is compared with linear
    attention, its normalised variant, ridge over a ``lambda`` path and at the GCV pick,
    gradient descent from zero, and the baselines (mean of the visible values, first value,
    ``v_t``, ``v_{t-1}``), all in float64 (docs/math.md §8). A gain per head and predictor is
    fitted on the fitting units; R² is given on the held-out units with bootstrap intervals.
    Claims are restricted to destinations that see at least ``2 d_head`` keys: below that, ridge
    interpolates and copying heads look like regression.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: anything ``adapter.tokenize`` takes. With at least 4 prompts the units (of
            fitting, held-out and the bootstrap) are prompts; with fewer, blocks of 16
            destinations (fewer on short prompts: at least 4 blocks per prompt).
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        stride: measure every ``stride``-th destination (sums still see every key).
        positions: the destinations to measure instead of a stride: positions (ints, the same
            in every prompt) or a ``[batch, pos]`` bool mask; task layouts rarely put their
            prediction positions on multiples of a stride.
        fit_fraction: the share of units that fit the gains (alternating units).
        ridge_path: ``lambda`` in units of ``tr(G_t) / d_head``.
        gd_steps: the gradient-descent step counts.
        n_boot: bootstrap resamples of the held-out units (of the R² and the ablation).
        seed: seeds the bootstrap.
        memory_budget: bytes of float64 temporaries per chunk.
        ablation: also measure each head's mean-ablation change in next-token loss at the
            measured destinations (one patched forward per head, replicas batched), shown
            beside its reading: a reading is not a causal claim (docs/math.md §9.5).

    Returns:
        A ``RegressionResult``.

    Example:
        >>> from tl_dynamics import regression, testing
        >>> res = regression.compute(testing.cached_model("gpt2"), "a b c d e f g h", layers=0)
        >>> res.r2.shape  # layers, bands, heads, predictors
        (1, 6, 4, 17)
        >>> res.units
        'blocks of 2 destinations'
    """
    adapter = ModelAdapter.of(model)
    chosen = adapter.check_attention_layers(layers)
    hs = adapter.check_heads(heads)
    _check(stride, fit_fraction, ridge_path, gd_steps, n_boot)
    if not isinstance(ablation, bool):
        raise TLDynamicsError(f"regression: ablation must be True or False, got {ablation!r}")
    batch = adapter.tokenize(prompt)
    chosen_positions = _positions(positions, stride, batch)
    names = predictor_names(ridge_path, gd_steps)
    kept: dict[int, tuple[Sums, float]] = {}
    state: dict[str, Any] = {}

    def on_layer(la: LayerAttention) -> None:
        la.require_ungated("regression")
        lo, hi, n, _ = intervals(la.allowed)
        if "units" not in state:
            state.update(
                _units(batch.key_valid.shape[0], n, la.query_valid, chosen_positions, fit_fraction)
            )
        db, dt, unit = state["dest_b"], state["dest_t"], state["unit"]
        ref = la.reference.get("z")
        z_model = (la.z() if ref is None else ref)[:, :, hs].to(torch.float64)
        pattern = la.masked_softmax(la.scores(hs).to(torch.float64), hs)  # learned sinks join
        z64 = torch.einsum("bhij,bjhd->bihd", pattern, la.v[:, :, hs].to(torch.float64))
        valid = la.query_valid & (n > 0)
        err = (z64 - z_model)[valid].abs().max() / z_model[valid].abs().max().clamp_min(1e-30)
        sums = Sums(state["n_units"], len(hs), names, la.v.shape[-1], la.q.device)
        nd = n[db, dt].to(torch.float64)
        for sl, local, P in layer_predictions(
            la, hs, adapter.n_kv_heads, db, dt, memory_budget, ridge_path, gd_steps
        ):
            z = z_model[db[sl], dt[sl]][:, local]
            sums.add(unit[sl], nd[sl], adapter.d_head, local, z, P)
        kept[la.layer] = (sums, float(err))

    with (
        torch.no_grad(),
        adapter.capture(on_layer, layers=chosen, reference=True, batch=batch, sinks=True),
    ):
        adapter.forward(batch)
    if state.get("n_units", 0) < 2 or state["fit"].all() or not state["fit"].any():
        raise TLDynamicsError(
            "regression: the prompt gives fewer than two units (one to fit, one to hold out); "
            f"give at least {MIN_PROMPTS} prompts or a prompt of at least 2 tokens"
        )
    scores: list[Scores] = [score(kept[lay][0], state["fit"], n_boot, seed) for lay in chosen]
    effects = None
    if ablation:
        effects = ablation_effects(
            adapter,
            batch,
            chosen,
            hs,
            state["dest_b"],
            state["dest_t"],
            state["unit"],
            n_boot,
            seed,
        )
    return RegressionResult.build(
        architecture=adapter.info.architecture,
        d_head=adapter.d_head,
        layers=tuple(chosen),
        heads=tuple(hs),
        names=names,
        bands=band_labels(),
        scores=scores,
        z_error=tuple(kept[lay][1] for lay in chosen),
        units=state["unit_kind"],
        n_units=(int(state["fit"].sum()), int((~state["fit"]).sum())),
        stride=stride,
        ablation=effects,
        n_prompts=int(batch.tokens.shape[0]),
        n_boot=n_boot,
    )


def _positions(
    positions: Sequence[int] | torch.Tensor | None, stride: int, batch: Batch
) -> torch.Tensor:
    """The destinations asked for, ``[batch, pos]`` bool: every ``stride``-th position, or
    ``positions`` (ints in every prompt, or a mask of the batch's shape), checked."""
    shape = tuple(batch.tokens.shape)
    index = torch.arange(shape[1])
    if positions is None:
        return (index % stride == 0)[None].expand(shape)
    if stride != 1:
        raise TLDynamicsError("regression: give stride or positions, not both")
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        if tuple(positions.shape) != shape:
            raise TLDynamicsError(
                f"regression: a positions mask must have the batch's shape {list(shape)}, got "
                f"{list(positions.shape)}"
            )
        return positions.cpu()
    try:
        wanted = sorted({int(p) for p in positions})
    except (TypeError, ValueError):
        raise TLDynamicsError(
            f"regression: positions must be ints or a [batch, pos] bool mask, got {positions!r}"
        ) from None
    if not wanted or wanted[0] < -shape[1] or wanted[-1] >= shape[1]:
        raise TLDynamicsError(
            f"regression: positions {wanted} out of range for {shape[1]} positions "
            f"(valid: 0 to {shape[1] - 1}, or negative from the end)"
        )
    mask = torch.zeros(shape[1], dtype=torch.bool)
    mask[torch.tensor(wanted)] = True
    return mask[None].expand(shape)


def _units(
    n_rows: int,
    n: torch.Tensor,
    query_valid: torch.Tensor,
    chosen: torch.Tensor,
    fit_fraction: float,
):
    """The destinations measured (``chosen``, where the query is real and sees a key) and
    their units; every ``round(1 / fit_fraction)``-th unit fits (starting with the first)."""
    keep = query_valid & (n > 0) & chosen.to(query_valid.device)
    db, dt = keep.nonzero(as_tuple=True)
    if n_rows >= MIN_PROMPTS:
        unit, kind = db, "prompts"
    else:  # blocks of BLOCK destinations, smaller on short prompts (at least 4 per prompt)
        per_row = int(keep.sum(1).max()) if keep.numel() else 0
        size = max(1, min(BLOCK, per_row // 4))
        block = (keep.long().cumsum(1)[db, dt] - 1) // size
        n_blocks = int(block.max()) + 1 if block.numel() else 1
        unit, kind = db * n_blocks + block, f"blocks of {size} destinations"
    uniq, unit = torch.unique(unit, return_inverse=True)
    n_units = int(uniq.numel())
    every = max(2, round(1.0 / fit_fraction)) if fit_fraction <= 0.5 else 2
    fit = np.arange(n_units) % every == 0
    if fit_fraction > 0.5:
        fit = ~(np.arange(n_units) % max(2, round(1.0 / (1.0 - fit_fraction))) == 1)
    return dict(
        dest_b=db, dest_t=dt, unit=unit, n_units=n_units, fit=fit, unit_kind=kind, units=True
    )
