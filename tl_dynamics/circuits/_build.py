"""Factored QK and OV circuits of one head, from the adapter's weights.

Row-vector convention throughout (as TransformerLens): a query input ``x`` and key input
``y`` (rows, ``d_model``) score ``c (x W_Q + b_Q) R_delta (y W_K + b_K)^T`` and a source
input ``x`` writes ``(x W_V + b_V) W_O``; its direct effect on the logits is that times
``W_U``. Each circuit is a ``FactoredMatrix(A, B)`` of inner width ``d_head``.
"""

from __future__ import annotations

from typing import Any, Union

from jaxtyping import Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits._circuit import Circuit
from tl_dynamics.circuits._topk import KeyRule
from tl_dynamics.circuits._labels import vocabulary
from tl_dynamics.errors import TLDynamicsError

Inputs = Union[str, Tensor, tuple[Tensor, Tensor]]
INPUT_SPACES = ("tokens", "positions")


def checked_head(adapter: ModelAdapter, layer: int, head: int) -> tuple[int, int]:
    adapter.check_layer(layer)
    return layer, adapter.check_head(head, layer=layer)


def input_rows(adapter: ModelAdapter, inputs: str | Tensor, side: str) -> tuple[Tensor, str]:
    """The residual-stream rows a circuit reads: ``W_E``, ``W_pos`` or given vectors."""
    if isinstance(inputs, Tensor):
        if inputs.ndim != 2 or inputs.shape[1] != adapter.d_model or not inputs.is_floating_point():
            raise TLDynamicsError(
                f"{side} inputs must be a float [n, d_model={adapter.d_model}] "
                f"tensor, got {tuple(inputs.shape)} {inputs.dtype}"
            )
        return inputs.detach().float(), "input"
    if inputs == "tokens":
        return adapter.W_E, "token"
    if inputs == "positions":
        if adapter.W_pos is None:
            raise TLDynamicsError(
                f"inputs='positions' needs learned absolute position embeddings, which this "
                f"{adapter.info.architecture} model does not have (rotary or ALiBi); for rotary "
                "layers use qk_circuit(..., offset=delta) or offset_summary"
            )
        return adapter.W_pos, "position"
    raise TLDynamicsError(
        f"inputs={inputs!r} is not valid: use 'tokens', 'positions', a "
        f"[n, d_model] tensor, or a (query_inputs, key_inputs) pair of them"
    )


def input_pair(adapter: ModelAdapter, inputs: Inputs) -> tuple[Tensor, str, Tensor, str]:
    if isinstance(inputs, tuple):
        if len(inputs) != 2:
            raise TLDynamicsError(
                f"inputs pair must be (query_inputs, key_inputs), got {len(inputs)} items"
            )
        return (*input_rows(adapter, inputs[0], "query"), *input_rows(adapter, inputs[1], "key"))
    rows, space = input_rows(adapter, inputs, "query")
    return rows, space, rows, space


def offsets_checked(offsets: int | list[int] | range, n_ctx: int) -> list[int]:
    """Validate relative offsets (query position minus key position, ``|delta| < n_ctx``)."""
    items = [offsets] if isinstance(offsets, int) else list(offsets)
    bad = [d for d in items if not isinstance(d, int) or isinstance(d, bool) or abs(d) >= n_ctx]
    if not items or bad:
        raise TLDynamicsError(
            f"offsets {bad or items!r} are not valid relative positions "
            f"(query minus key): valid are integers with |delta| < n_ctx = {n_ctx}"
        )
    return items


def rotation(
    adapter: ModelAdapter, layer: int, offset: int | None
) -> tuple[Tensor | None, int | None]:
    """``(R_offset, offset)`` for rotary layers (offset 0 when None), ``(None, None)`` otherwise."""
    rmap = adapter.rotation(layer)
    if rmap is None:
        if offset not in (None, 0):
            raise TLDynamicsError(
                f"offset={offset!r} applies only to rotary layers; layer {layer} "
                f"of {adapter.info.architecture} has no rotary embedding (its "
                "positions enter through W_pos or a position bias)"
            )
        return None, None
    offset = offsets_checked(0 if offset is None else offset, adapter.n_ctx)[0]
    W_Q = adapter.W_Q(layer)  # its width: d_head, or nope + rope on latent attention
    return rmap.matrix(offset, W_Q.shape[-1]).to(W_Q.device), offset


PARTS = ("non-rotary", "rotary")


def latent_part(adapter: ModelAdapter, layer: int, part: str | None) -> slice:
    """The q/k coordinates of ``part`` of a latent-attention layer's scores (all for None)."""
    if part is None:
        return slice(None)
    factors = adapter.latent(layer)
    if factors is None or part not in PARTS:
        why = (
            f"valid: None, {', '.join(map(repr, PARTS))}"
            if factors is not None
            else f"layer {layer} of {adapter.info.architecture} has no multi-head latent "
            "attention; part applies only there (valid here: None)"
        )
        raise TLDynamicsError(f"part={part!r} is not valid: {why}")
    return slice(0, factors.d_nope) if part == "non-rotary" else slice(factors.d_nope, None)


def latent_notes(adapter: ModelAdapter, layers: list[int], side: str = "QK") -> list[str]:
    """What the circuits of latent-attention layers (among ``layers``) fold in and leave out."""
    factors = [f for f in (adapter.latent(layer) for layer in layers) if f is not None]
    if not factors:
        return []
    if side == "OV":
        return [
            "Multi-head latent attention: W_V is the low-rank product through the key/value "
            "latent with its RMS norm's gain folded in; the norm's per-token scale "
            "1/rho_kv(y) on the values is left out (docs/math.md §1.7)."
        ]
    return [
        f"Multi-head latent attention: W_Q and W_K are the low-rank products with the latent "
        "RMS norms' gains folded in; their per-token scales are left out (the model divides "
        "the query by rho_q(x) and the non-rotary key by rho_kv(y), the rotary key by "
        f"nothing), so this is the score at unit latent RMS. The last {factors[0].d_rope} q/k "
        f"coordinates are rotary, the key's the same for every head; qk_circuit(..., "
        "part='non-rotary' or 'rotary') gives each part alone (docs/math.md §1.7)."
    ]


def queries(
    adapter: ModelAdapter,
    layer: int,
    heads: Any,
    rows: Tensor,
    biases: bool,
    rot: Tensor | None = None,
) -> Float[Tensor, "... n d_head"]:
    """``c (x W_Q + b_Q) R`` for each row ``x``; ``heads`` indexes the head dim."""
    q = rows @ adapter.W_Q(layer)[heads]
    if biases:
        q = q + adapter.b_Q(layer)[heads][..., None, :]
    q = q * adapter.specs[layer].scale
    return q if rot is None else q @ rot


def keys(adapter: ModelAdapter, layer: int, heads: Any, rows: Tensor, biases: bool) -> Tensor:
    k = rows @ adapter.W_K(layer)[heads]
    return k + adapter.b_K(layer)[heads][..., None, :] if biases else k


def values(adapter: ModelAdapter, layer: int, heads: Any, rows: Tensor, biases: bool) -> Tensor:
    v = rows @ adapter.W_V(layer)[heads]
    return v + adapter.b_V(layer)[heads][..., None, :] if biases else v


def norm_note(adapter: ModelAdapter) -> str:
    if adapter.info.host == "bridge" and not adapter.info.compat:
        return (
            "LayerNorm: not applied. This bridge is not in compatibility mode, so the "
            "normalisation before attention (its centring, scaling, weight and bias) is "
            "left out; enable_compatibility_mode() folds its weight into W_Q/W_K/W_V."
        )
    return (
        "LayerNorm: not applied. Its weight is folded into W_Q/W_K/W_V in compatibility "
        "mode and by HookedTransformer.from_pretrained (fold_ln=True), leaving out only its "
        "centring and per-row scaling; a model built from a config keeps it unfolded."
    )


def qk_notes(adapter: ModelAdapter, layer: int, biases: bool, offset: int | None) -> list[str]:
    spec = adapter.specs[layer]
    notes = [
        f"Values are scores as the model computes them: scale c = {spec.scale:.4g} included; "
        f"biases b_Q, b_K {'included' if biases else 'left out'}.",
        norm_note(adapter),
    ]
    if offset is not None:
        notes.append(
            f"Rotary: the circuit for a key {offset} position(s) before the query "
            "(offset 0: the query's own position)."
        )
    if spec.qk_norm:
        notes.append(
            "q and k are normalised after their projections (qk_norm): this bilinear "
            "circuit leaves that normalisation out, so it is not the model's score."
        )
    if spec.softcap is not None:
        notes.append(
            f"Scores are before the soft-cap {spec.softcap:g} * tanh(s / {spec.softcap:g})."
        )
    if spec.alibi != "none":
        notes.append("The ALiBi position bias is not included.")
    if adapter.n_kv_heads != adapter.n_heads:
        notes.append(
            f"Grouped K/V heads: each of the {adapter.n_kv_heads} key heads serves "
            f"{adapter.n_heads // adapter.n_kv_heads} query heads."
        )
    return notes + latent_notes(adapter, [layer])


def ov_notes(adapter: ModelAdapter, biases: bool, layer: int | None = None) -> list[str]:
    return [
        f"Direct effect on the logits through W_U; b_V {'included' if biases else 'left out'}; "
        "b_O (shared by the layer's heads), b_U and the final LayerNorm left out.",
        norm_note(adapter),
    ] + latent_notes(adapter, [] if layer is None else [layer], "OV")


def qk_circuit(
    model: Any,
    layer: int,
    head: int,
    offset: int | None = None,
    inputs: Inputs = "tokens",
    biases: bool = True,
    part: str | None = None,
) -> Circuit:
    """The QK circuit of one head, kept factored: ``c (X W_Q + b_Q) R_offset (Y W_K + b_K)^T``.

    ``inputs="tokens"`` gives the full circuit over the vocabulary (``X = Y = W_E``; rows are
    query tokens, columns key tokens), ``"positions"`` the positional circuit over learned
    positions (its read-outs rank only the keys each query position may attend to), a
    ``[n, d_model]`` tensor or a ``(query_inputs, key_inputs)`` pair any other inputs. On rotary
    layers ``offset`` is the query position minus the key position. On multi-head latent
    attention layers ``part="non-rotary"`` or ``"rotary"`` keeps that part of the q/k coordinates
    only (the two sum to the whole; docs/math.md §1.7).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layer: the head's layer.
        head: the head's index.
        offset: rotary layers only: query position minus key position (None: 0).
        inputs: ``"tokens"``, ``"positions"``, a ``[n, d_model]`` tensor, or a
            ``(query_inputs [n_q, d_model], key_inputs [n_k, d_model])`` pair.
        biases: include ``b_Q`` and ``b_K``.
        part: latent-attention layers only: ``"non-rotary"``, ``"rotary"`` or None (both).

    Returns:
        A ``Circuit`` (a factored ``[rows, cols]`` matrix, e.g. ``[d_vocab, d_vocab]``, with its
        provenance and ``notes``).

    Example:
        >>> from tl_dynamics import testing, circuits
        >>> c = circuits.qk_circuit(testing.tiny_model("gpt2"), layer=1, head=0)
        >>> c.shape, c.topk(3).indices.shape
        ((512, 512), torch.Size([512, 3]))
    """
    adapter = ModelAdapter.of(model)
    layer, head = checked_head(adapter, layer, head)
    xq, q_space, xk, k_space = input_pair(adapter, inputs)
    cols = latent_part(adapter, layer, part)
    rot, offset = rotation(adapter, layer, offset)
    A = queries(adapter, layer, head, xq, biases, rot)[:, cols]  # R_offset keeps the parts apart
    B = keys(adapter, layer, head, xk, biases)[:, cols].T
    kind = "positional QK" if q_space == k_space == "position" else "QK"
    kind += "" if part is None else f" ({part} part)"
    notes, rule = qk_notes(adapter, layer, biases, offset), None
    if kind.startswith("positional QK"):
        spec = adapter.specs[layer]
        rule = KeyRule(causal=spec.causal, window=spec.window)
        if rule.masks:
            notes.append(
                "Read-outs (topk, own_best_fraction) rank only the keys a query "
                "position may attend to ("
                + ("causal" if spec.causal else "")
                + (", " if spec.causal and spec.window else "")
                + (f"window {spec.window}" if spec.window else "")
                + ")."
            )
    return Circuit(
        kind=kind,
        layer=layer,
        head=head,
        matrix=FactoredMatrix(A, B),
        rows=q_space,
        cols=k_space,
        offset=offset,
        notes=tuple(notes),
        architecture=adapter.info.architecture,
        vocab=vocabulary(adapter),
        key_rule=rule,
    )


def positional_qk_circuit(model: Any, layer: int, head: int, biases: bool = True) -> Circuit:
    """``c (W_pos W_Q + b_Q)(W_pos W_K + b_K)^T``: which positions attend to which, by position
    embeddings alone (learned absolute positions only). Its read-outs rank only the keys each
    query position may attend to (causal mask, sliding window; ``Circuit.key_rule``)."""
    return qk_circuit(model, layer, head, inputs="positions", biases=biases)


def ov_circuit(
    model: Any, layer: int, head: int, inputs: str | Tensor = "tokens", biases: bool = True
) -> Circuit:
    """The OV circuit of one head on the logits, kept factored: ``(X W_V + b_V) W_O W_U``.

    Rows are source tokens (``inputs="tokens"``) or the given ``[n, d_model]`` inputs; columns
    are output tokens.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layer: the head's layer.
        head: the head's index.
        inputs: ``"tokens"`` (``W_E``) or a ``[n, d_model]`` tensor of source inputs.
        biases: include ``b_V``.

    Returns:
        A ``Circuit``: a factored ``[d_vocab or n, d_vocab]`` matrix with provenance and notes.

    Example:
        >>> from tl_dynamics import testing, circuits
        >>> c = circuits.ov_circuit(testing.tiny_model("gpt2"), layer=1, head=0)
        >>> c.shape, -1 <= c.positivity() <= 1
        ((512, 512), True)
    """
    adapter = ModelAdapter.of(model)
    layer, head = checked_head(adapter, layer, head)
    rows, space = input_rows(adapter, inputs, "source")
    A = values(adapter, layer, head, rows, biases)
    B = adapter.W_O(layer)[head] @ adapter.W_U
    return Circuit(
        kind="OV",
        layer=layer,
        head=head,
        matrix=FactoredMatrix(A, B),
        rows=space,
        cols="output token",
        offset=None,
        notes=tuple(ov_notes(adapter, biases, layer)),
        architecture=adapter.info.architecture,
        vocab=vocabulary(adapter),
    )
