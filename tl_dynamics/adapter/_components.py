"""The residual stream entering a layer, split exactly into the parts that wrote it, and those
parts carried into the layer's queries and keys with the pass's own norm scale (docs/math.md §10).

``ResidualSplit(adapter, layer)`` says what a pass must deliver (``layers``, ``points``) and,
from the ``LayerState`` of each layer, gathers a ``Residual``: the token embedding, the learned
positional embedding, each earlier head's ``z_h W_O[h]``, each earlier attention bias ``b_O`` and
each earlier MLP's output, which sum to the stream the layer reads. ``queries``/``keys`` map every
part through the frozen input norm, ``W_Q``/``W_K`` and rotary, so every query and key of the
layer is an exact sum of per-part vectors plus one bias part. What cannot be split exactly is
refused by name before any pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter._frozennorm import InputNorm, read_input_norm
from tl_dynamics.adapter._maps import bias_part, side_map, value_map
from tl_dynamics.adapter._qkparts import frozen_parts, side_norms
from tl_dynamics.adapter._saesplit import feature_residual, refuse_spliced_stream, sae_layer
from tl_dynamics.adapter._splitrefusals import refuse_split
from tl_dynamics.adapter._residual import Residual, layer_parts, relative_error as _rel
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._hub import LayerState
    from tl_dynamics.adapter._model import ModelAdapter

# Relative error (to the largest entry) within which the pass's own stream must match the sum
# of its parts, per model dtype (float32 reorders sums; half precision rounds at ~1e-3..1e-2).
SPLIT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _rtol(dtype: torch.dtype) -> float:
    return SPLIT_RTOL.get(dtype, 5e-2)


class ResidualSplit:
    """What one attention layer reads, split into the components that wrote it (docs/math.md §10).

    Built once per adapter and layer; refuses (``TLDynamicsError``) what it cannot split exactly:
    unverified families, post-attention norms, hybrids, latent or gated attention, q/k norms after
    rotary. A q/k norm before rotary is frozen per position and head like the input norm.

    Args:
        adapter: A ``ModelAdapter``.
        layer: The attention layer whose input is split.
        sae: A SAELens SAE on this layer's ``hook_resid_pre``, for ``features`` (optional).

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
        >>> split = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1)
        >>> split.names[:4]
        ('token embedding', 'positional embedding', 'L0H0 output', 'L0H1 output')
        >>> split.names[-2:]
        ('L0H3 output', 'L0 MLP output')
    """

    def __init__(self, adapter: "ModelAdapter", layer: int, sae: Any = None):
        self.adapter = adapter
        self.layer = layer = adapter.check_layer(layer)
        adapter.check_attention_layers([layer])
        arch, info = adapter.info.architecture, adapter.info
        refuse_split(adapter, layer, arch, info.family)
        refuse_spliced_stream(adapter, layer)  # an SAE in the stream without its error term
        if sae is not None and sae_layer(sae) != layer:
            raise TLDynamicsError(
                f"qk attribution: the SAE reads the input of layer {sae_layer(sae)}; its "
                f"features can split layer {sae_layer(sae)}'s queries and keys, not layer {layer}'s"
            )
        self.sae = sae
        self.query_norm, self.key_norm = side_norms(adapter, layer)  # QK-norm, frozen per head
        model = adapter.model
        self.norm: InputNorm = read_input_norm(
            model.blocks[layer].ln1, adapter.d_model, f"layer {layer} of {arch}"
        )
        cfg = model.cfg
        self.learned_positions = adapter.W_pos is not None
        pos_module = getattr(getattr(model, "pos_embed", None), "original_component", None)
        self.position_offset = int(getattr(pos_module, "offset", 0) or 0)  # OPT: 2
        attn_only = bool(getattr(cfg, "attn_only", False))
        self.mlp = tuple(
            not attn_only and getattr(model.blocks[l], "mlp", None) is not None
            for l in range(layer)
        )
        names = adapter.hook_names([("resid_mid", l) for l in range(layer)])
        self.sequential = tuple(name is not None for name in names)
        kinds: list[tuple[str, str, int, int]] = [("token embedding", "embedding", -1, -1)]
        if self.learned_positions:
            kinds.append(("positional embedding", "position", -1, -1))
        self.attn_bias = tuple(bool(adapter.b_O(l).abs().max() > 0) for l in range(layer))
        for l in range(layer):
            kinds += [(f"L{l}H{h} output", "head", l, h) for h in range(adapter.n_heads)]
            if self.attn_bias[l]:
                kinds.append((f"L{l} attention bias", "bias", l, -1))
            if self.mlp[l]:
                kinds.append((f"L{l} MLP output", "mlp", l, -1))
        self.names = tuple(k[0] for k in kinds)
        # "position" reads as "embedding" in ``kinds`` (as before); ``origins`` tells them apart
        self.kinds = tuple("embedding" if k[1] == "position" else k[1] for k in kinds)
        self.origins: tuple[tuple[str, int, int], ...] = tuple((k[1], k[2], k[3]) for k in kinds)
        """Per part: ``(kind, layer, head)``; kind ``"embedding"`` (the token embedding),
        ``"position"``, ``"head"``, ``"bias"`` or ``"mlp"``; -1 where a layer or head does not
        apply."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The attention layers a pass must deliver: every layer up to this one.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1).layers
            (0, 1)
        """
        return tuple(range(self.layer + 1))

    @property
    def points(self) -> tuple[tuple[str, int], ...]:
        """The residual points a pass must deliver.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1).points
            (('resid_pre', 0), ('resid_pre', 1), ('resid_mid', 0))
        """
        pts = [("resid_pre", l) for l in range(self.layer + 1)]
        pts += [("resid_mid", l) for l in range(self.layer) if self.sequential[l]]
        return tuple(pts)

    def keep(self, state: "LayerState") -> dict[str, Tensor]:
        """What this split needs of one layer of a pass, called as each layer is delivered.

        The residual points, and for earlier layers ``z``, ``W_O`` and ``b_O`` (not the pattern),
        for this layer the attention input ``x`` where it was kept.

        Args:
            state: The ``LayerState`` a collector receives.

        Returns:
            The tensors to hand to ``gather``, by name.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> from tl_dynamics.collect import Collector
            >>> ad = ModelAdapter(testing.cached_model("gpt2"))
            >>> split, kept = ResidualSplit(ad, 1), {}
            >>> class Keep(Collector):
            ...     layers, points, inputs = split.layers, split.points, True
            ...     def on_layer(self, state):
            ...         kept[state.layer] = split.keep(state)
            >>> with ad.collecting(Keep()):
            ...     _ = ad.forward(ad.tokenize("a b c"))
            >>> sorted(kept[0]), sorted(kept[1])
            (['W_O', 'b_O', 'resid_mid', 'resid_pre', 'z'], ['resid_pre', 'x'])
        """
        l, kept = state.layer, {k: v.float() for k, v in state.points.items()}
        la = state.attention
        if la is not None and l < self.layer:
            kept.update(z=la.z(), W_O=la.W_O, b_O=la.b_O)
        elif la is not None and "x" in la.reference:
            kept["x"] = la.reference["x"]
        return kept

    def gather(self, kept: dict[int, dict[str, Tensor]], batch: Any) -> Residual:
        """The parts of one pass's stream, from what ``keep`` kept of each layer.

        Checks each earlier layer's attention output against the stream, and the frozen norm
        against the attention input ``x`` where it was kept (``TLDynamicsError`` beyond
        ``SPLIT_RTOL``).

        Args:
            kept: ``{layer: keep(state)}`` for every layer in ``layers``.
            batch: The pass's ``Batch``.

        Returns:
            A ``Residual``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> split = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1)
            >>> res = split.run("a b c")  # one pass: keep, then gather
            >>> res.vectors().shape, res.errors["input norm"] < 1e-5
            (torch.Size([7, 1, 4, 64]), True)
        """
        ad, L = self.adapter, self.layer
        missing = [l for l in self.layers if l not in kept]
        if missing:
            raise TLDynamicsError(f"qk attribution: the pass did not deliver layers {missing}")
        pre = {l: kept[l]["resid_pre"] for l in range(L + 1)}
        valid = batch.key_valid.to(pre[0].device)
        positions = ad.positions(batch).to(pre[0].device)
        coefs: list[Tensor] = []
        bases: list[Tensor | None] = []
        errors: dict[str, float] = {}
        tol = _rtol(ad.dtype)
        W_pos = ad.W_pos
        token = pre[0]
        if self.learned_positions and W_pos is not None:
            token = pre[0] - W_pos[positions + self.position_offset]
            coefs += [token, pre[0] - token]
            bases += [None, None]
        else:
            coefs.append(token)
            bases.append(None)
        for l in range(L):
            z, W_O, b_O = kept[l]["z"], kept[l]["W_O"], kept[l]["b_O"]
            for h in range(z.shape[2]):
                coefs.append(z[:, :, h])
                bases.append(W_O[h])
            if self.attn_bias[l]:
                coefs.append(torch.ones(*z.shape[:2], 1, device=z.device))
                bases.append(b_O[None])
            mlp, err = layer_parts(kept[l], l, pre, valid, self.sequential[l], self.mlp[l])
            if err is not None:
                errors[f"L{l} attention"] = err
            if self.mlp[l]:
                coefs.append(mlp)
                bases.append(None)
        for what, err in errors.items():
            if err > tol:
                raise TLDynamicsError(
                    f"qk attribution: on {ad.info.architecture}, {what}'s output does not add to "
                    f"the residual stream as sum_h z_h W_O[h] + b_O (relative error {err:.2e} > "
                    f"{tol:g}), so the stream cannot be split exactly"
                )
        scale = self.norm.scale(pre[L])
        x = kept[L].get("x")
        if x is not None:
            err = _rel(self.norm.apply(pre[L], scale), x.float(), valid)
            errors["input norm"] = err
            if err > tol:
                raise TLDynamicsError(
                    f"qk attribution: the input norm of layer {L} of {ad.info.architecture}, with "
                    f"its scale frozen, does not reproduce the attention input (relative error "
                    f"{err:.2e} > {tol:g})"
                )
        return Residual(
            L, self.names, self.kinds, coefs, bases, pre[L], scale, positions, valid, errors
        )

    def run(self, prompt: Any) -> Residual:
        """One pass of the model on ``prompt``, kept and gathered: its ``Residual``.

        Args:
            prompt: Anything ``ModelAdapter.tokenize`` takes.

        Returns:
            A ``Residual``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> res = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1).run("a b")
            >>> res.names[-1], tuple(res.stream.shape)
            ('L0 MLP output', (1, 3, 64))
        """
        from tl_dynamics.collect import Collector

        split, kept = self, {}

        class _Keep(Collector):
            layers, points, inputs = split.layers, split.points, True

            def on_layer(self, state: Any) -> None:
                kept[state.layer] = split.keep(state)

        batch = self.adapter.tokenize(prompt)
        with torch.no_grad(), self.adapter.collecting(_Keep()):
            self.adapter.forward(batch)
        return self.gather(kept, batch)

    def features(self, res: Residual) -> Residual:
        """``res``'s stream split into a SAELens SAE's active features instead of components.

        The split's ``sae`` reads this layer's ``hook_resid_pre``. The parts are each feature active
        somewhere (``"SAE feature 1234"``: its activation times its decoder row), the decoder
        bias and the error term (input less reconstruction); they sum to the same stream, so
        ``queries``/``keys`` of the result sum to the scored queries and keys (docs/math.md §10.7).

        Args:
            res: A ``Residual`` of this split.

        Returns:
            A ``Residual`` whose parts are the features, ``"SAE decoder bias"`` and ``"SAE error"``.

        Example:
            >>> import importlib.util
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> if importlib.util.find_spec("sae_lens"):  # SAELens: TransformerLens 3.x
            ...     import sae_lens
            ...     from sae_lens.saes.sae import SAEMetadata
            ...     meta = SAEMetadata(hook_name="blocks.1.hook_resid_pre")
            ...     sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=64, d_sae=256, metadata=meta))
            ...     split = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1, sae=sae)
            ...     feats = split.features(split.run("a b c"))
            ...     assert feats.names[-2:] == ("SAE decoder bias", "SAE error")
        """
        if self.sae is None:
            raise TLDynamicsError("qk attribution: this ResidualSplit was made without an sae")
        return feature_residual(res, self.sae, self.adapter.info.architecture)

    def queries(self, res: Residual, heads: Sequence[int]) -> Tensor:
        """Every part's share of the queries of ``heads``; they sum to the queries as scored.

        Args:
            res: A ``Residual`` of this split.
            heads: Query heads.

        Returns:
            ``[part + 1, batch, pos, head, d_head]``, the last part the query bias (the norm's
            shift through ``W_Q`` plus ``b_Q``), rotated where the layer is rotary.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> ad = ModelAdapter(testing.cached_model("llama"))
            >>> split = ResidualSplit(ad, 1)
            >>> q = split.queries(split.run("a b c"), [0, 3])
            >>> q.shape, bool((q.sum(0) - ad.attention("a b c", layers=1)[1].q[:, :, [0, 3]]).abs().max() < 1e-5)
            (torch.Size([7, 1, 4, 2, 16]), True)
        """
        ad, L = self.adapter, self.layer
        norm = self.query_norm
        side = None if norm is None else (norm, range(ad.n_heads), list(heads))
        return frozen_parts(ad, res, self.norm, ad.W_Q(L), ad.b_Q(L), heads, side, L)

    def maps(self, res: Residual, head: int) -> dict[str, Tensor]:
        """The linear maps of head ``head`` on this pass, with its norm scales frozen (``_maps``).

        Args:
            res: A ``Residual`` of this split (its stream and scales).
            head: A query head.

        Returns:
            ``"query"`` and ``"key"`` ``[batch, pos, d_model, d_head]`` (a residual vector at a
            position to its share of the query or key there), ``"query_bias"``/``"key_bias"``
            ``[batch, pos, d_head]`` (the part no vector wrote), ``"value"`` likewise and
            ``"value_bias"`` ``[d_head]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> split = ResidualSplit(ModelAdapter(testing.cached_model("llama")), 1)
            >>> sorted(split.maps(split.run("a b"), 0))
            ['key', 'key_bias', 'query', 'query_bias', 'value', 'value_bias']
        """
        value, value_bias = value_map(self, res, head)
        return {
            "query": side_map(self, res, head, "query"),
            "key": side_map(self, res, head, "key"),
            "query_bias": bias_part(self, res, head, "query"),
            "key_bias": bias_part(self, res, head, "key"),
            "value": value,
            "value_bias": value_bias,
        }

    def keys(self, res: Residual, heads: Sequence[int]) -> Tensor:
        """Every part's share of the keys of ``heads``; grouped heads share one computation.

        Args:
            res: A ``Residual`` of this split.
            heads: Query heads (each gets its key/value group's keys).

        Returns:
            ``[part + 1, batch, pos, head, d_head]``, the last part the key bias.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> split = ResidualSplit(ModelAdapter(testing.cached_model("llama")), 1)  # 2 kv heads
            >>> k = split.keys(split.run("a b c"), [0, 1, 2])
            >>> bool(k[:, :, :, 0].equal(k[:, :, :, 1])), bool(k[:, :, :, 0].equal(k[:, :, :, 2]))
            (True, False)
        """
        ad = self.adapter
        group = max(1, ad.n_heads // ad.n_kv_heads)
        kv = [h // group for h in heads]
        uniq = sorted(set(kv))
        L, norm = self.layer, self.key_norm
        rows = [g * group for g in range(ad.n_kv_heads)]
        side = None if norm is None else (norm, rows, uniq)
        out = frozen_parts(
            ad, res, self.norm, ad.W_K(L), ad.b_K(L), [g * group for g in uniq], side, L
        )
        return out if kv == uniq else out[:, :, :, [uniq.index(g) for g in kv]]  # heads' order
