"""``AdapterBase``: what a model holds, read once: weights, query norms, embeddings and
unembedding, positions, rotations (on ``AdapterCore``, ``_core.py``: host, specs, checks, hook
names; ``ModelAdapter``, ``_model.py``, adds prompts, forward passes and hooks on top of it)."""

from __future__ import annotations

from typing import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.adapter import _finite, _readers, _switches, _weights
from tl_dynamics.adapter._batch import Batch, model_device
from tl_dynamics.adapter._checks import check_attention
from tl_dynamics.adapter._finalnorm import logit_directions, read_final_norm
from tl_dynamics.adapter._core import AdapterCore
from tl_dynamics.adapter._gate import gate_refusal
from tl_dynamics.adapter._jetmoe import ROUTED_WEIGHTS, routed_queries, routed_weight
from tl_dynamics.adapter._gemma4 import (
    gemma4_weight,
    kv_shared_refusal,
    layer_d_head,
    vnorm_refusal,
)
from tl_dynamics.adapter._mla import LatentFactors, latent_weight, read_latent
from tl_dynamics.adapter._postrope import refuse_query_map
from tl_dynamics.adapter._qknorm import QueryNorm, read_query_norm
from tl_dynamics.adapter._rotary import Rotation, positions_from_mask
from tl_dynamics.adapter._probepass import rotation_probe
from tl_dynamics.adapter._rotation import inv_freq_buffers, read_rotation
from tl_dynamics.adapter._unhooked import unhooked_param
from tl_dynamics.errors import TLDynamicsError


class AdapterBase(AdapterCore):
    """The model's weights, norms, embeddings and rotations (see ``ModelAdapter``)."""

    # ----------------------------------------------------------------- weights
    def expand_kv(self, t: Float[Tensor, "batch pos kv_head d_head"]) -> Tensor:
        if t.shape[2] == self.n_heads:
            return t
        return torch.repeat_interleave(t, self.n_heads // t.shape[2], dim=2)

    def _attn_weight(
        self, layer: int, name: str, bias_shape: tuple[int, ...] | None = None
    ) -> Tensor:
        """A weight (required) or a bias (zeros where the model has none), GQA expanded."""
        check_attention(self.specs, [layer], self.info.architecture)

        if name in ("W_V", "b_V") and self.specs[layer].gate is not None:  # gated: no fixed OV
            raise gate_refusal(self.specs[layer], self.info.architecture, name)
        routed = self.specs[layer].gate == "router"  # JetMoE: W_Q, W_O chosen per token
        if routed and name in ROUTED_WEIGHTS:
            raise gate_refusal(self.specs[layer], self.info.architecture, name)
        if name in ("W_V", "b_V") and self.specs[layer].vnorm:  # Gemma 4: no fixed OV either
            raise vnorm_refusal(layer, self.info.architecture, name)
        source = self.specs[layer].kv_from
        if name[-1] in "KV" and source is not None:  # Gemma 4: an earlier layer's keys, values
            raise kv_shared_refusal(layer, source, self.info.architecture, name)

        def compute() -> Tensor:
            if self.specs[layer].latent:  # low-rank q/k/v factors, gains folded in
                return latent_weight(
                    self.model, layer, name, bias_shape, self.n_heads, lambda: self.latent(layer)
                )
            if routed:
                w = routed_weight(self.model, layer, name, self.n_heads)
            elif self.info.family == "gemma4":  # the bridge cannot split per-layer widths
                w = gemma4_weight(self.model, layer, name, self.n_heads)
            else:
                read = unhooked_param if self.specs[layer].unhooked else _weights.attn_param
                w = read(self.model, layer, name)
            if w is None:
                if bias_shape is None:
                    raise TLDynamicsError(
                        f"layer {layer} of {self.info.architecture} exposes no {name}"
                    )
                w = torch.zeros(bias_shape, device=model_device(self.model))
            return w if name == "b_O" else _weights.expand_heads(w, self.n_heads)

        return self._cached((name, layer), compute)

    def W_Q(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_Q")

    def W_K(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_K")

    def W_V(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_V")

    def W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        return self._attn_weight(self.check_layer(layer), "W_O")

    def b_Q(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(
            self.check_layer(layer), "b_Q", (self.n_heads, self.head_width(layer))
        )

    def b_K(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(
            self.check_layer(layer), "b_K", (self.n_heads, self.head_width(layer))
        )

    def b_V(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(
            self.check_layer(layer), "b_V", (self.n_heads, self.head_width(layer))
        )

    def b_O(self, layer: int) -> Float[Tensor, " d_model"]:
        return self._attn_weight(self.check_layer(layer), "b_O", (self.d_model,))

    def head_width(self, layer: int) -> int:
        """The query/key head width of ``layer``: ``d_head`` except where layers differ
        (Gemma 4's sliding and full layers, ``_gemma4``)."""
        return (
            layer_d_head(self.model, layer, self.d_head)
            if self.info.family == "gemma4"
            else self.d_head
        )

    def query_norm(self, layer: int) -> QueryNorm | None:
        """The query normalisation of ``layer`` on qk-norm architectures (``None`` elsewhere).

        Read from the model's own norm module: Gemma 3 (per head, gain ``1 + w``), OLMo 2 (over
        all heads), a HookedTransformer with ``use_qk_norm`` (per head). ``apply`` maps
        ``x W_Q + b_Q`` to the query before rotary.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ad = ModelAdapter(testing.tiny_model("gemma3"))
            >>> ad.query_norm(0).scope, ModelAdapter(testing.tiny_model("llama")).query_norm(0)
            ('head', None)
        """
        refuse_query_map(self.specs[self.check_layer(layer)], self.info.architecture)
        return self._query_norm(layer)

    def _query_norm(self, layer: int) -> QueryNorm | None:
        """``query_norm`` without the refusal of layers whose query map it is not (_postrope)."""
        factors = self.latent(layer)  # latent attention: (x W_Q + b_Q) / rho_q(x) (_mla)
        if factors is not None:
            return factors.query_norm()
        if not self.specs[layer].qk_norm:
            return None

        def compute() -> QueryNorm:
            return read_query_norm(
                self.model.blocks[layer].attn,
                f"layer {layer} of {self.info.architecture}",
                gemma_gain=self.info.host == "bridge" and self.info.family == "gemma3",
                n_heads=self.n_heads,
                d_head=self.head_width(layer),
                W_Q=self.W_Q(layer),
                b_Q=self.b_Q(layer),
            )

        return self._cached(("query_norm", layer), compute)

    def latent(self, layer: int) -> LatentFactors | None:
        """The factors of a multi-head latent attention layer (None elsewhere): exact q/k/v, the
        RMS scales W_Q/W_K/W_V leave out, the scores' rotary split (docs/math.md §1.7)."""
        check_attention(self.specs, [self.check_layer(layer)], self.info.architecture)
        return (
            None
            if not self.specs[layer].latent
            else self._cached(
                ("latent", layer), lambda: read_latent(self.model, layer, self.info.architecture)
            )
        )

    def head_weights(self, layer: int, head: int) -> _weights.HeadWeights:
        """All of one head's weights and its score scale."""
        self.check_layer(layer)
        self.check_head(head, layer)
        return _weights.HeadWeights(
            layer=layer,
            head=head,
            W_Q=self.W_Q(layer)[head],
            W_K=self.W_K(layer)[head],
            W_V=self.W_V(layer)[head],
            W_O=self.W_O(layer)[head],
            b_Q=self.b_Q(layer)[head],
            b_K=self.b_K(layer)[head],
            b_V=self.b_V(layer)[head],
            b_O=self.b_O(layer),
            scale=self.specs[layer].scale,
        )

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self._cached(("W_E",), lambda: _weights.model_param(self.model, "W_E"))

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self._cached(("W_U",), lambda: _weights.model_param(self.model, "W_U"))

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        def compute() -> Tensor:
            b = _weights.model_param(self.model, "b_U")
            return torch.zeros(self.W_U.shape[1], device=self.W_U.device) if b is None else b

        return self._cached(("b_U",), compute)

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"] | None:
        """Learned absolute position embeddings, or None (rotary, ALiBi)."""

        def compute() -> Tensor | None:
            if self.model.cfg.positional_embedding_type not in ("standard", "shortformer"):
                return None
            pos_embed = getattr(self.model, "pos_embed", None)
            return None if pos_embed is None else _weights.model_param(pos_embed, "W_pos")

        return self._cached(("W_pos",), compute)

    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The model's own final normalisation (identity where it has none), in float32: its
        arithmetic on its frozen parameters (``_finalnorm``), never a call of the hooked module,
        so reading a lens fires none of the user's hooks."""
        norm = self._cached(
            ("final_norm",),
            lambda: read_final_norm(self.model, self.info.host, self.info.architecture),
        )
        with torch.no_grad():
            return norm(resid)

    def unembed(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_vocab"]:
        """``x @ W_U + b_U`` (x already normalised), soft-capped where the model caps its logits
        (``cap * tanh(l / cap)``, ``final_softcap``: Gemma 2, 3 and 4)."""
        logits = x.float() @ self.W_U + self.b_U
        cap = self.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def logit_directions(self, ids: Tensor) -> tuple[bool, Float[Tensor, "d_model n"]]:
        """``(center, W)``: a write ``x`` to the last residual stream changes the logits of
        ``ids`` directly by ``(x - mean(x) if center else x) @ W`` times the final norm's positive
        per-position scale (``_finalnorm.logit_directions``; ranks do not depend on the scale).

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ad = ModelAdapter(testing.cached_model("gpt2"))
            >>> center, W = ad.logit_directions(torch.tensor([3, 5]))
            >>> center, tuple(W.shape)
            (True, (64, 2))
        """
        norm = self._cached(
            ("final_norm",),
            lambda: read_final_norm(self.model, self.info.host, self.info.architecture),
        )
        return logit_directions(norm, self.W_U, ids)

    @property
    def final_softcap(self) -> float | None:
        """The soft-cap the model applies to its output logits, or None: Hugging Face's
        ``final_logit_softcapping`` on a bridge, ``output_logits_soft_cap`` on a
        HookedTransformer."""
        return _readers.final_softcap(self.model, self.info.host, self.info.family)

    def logit_lens(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_vocab"]:
        """Logits read from a residual-stream state as the model's own head would: final
        normalisation, then unembedding. Equals the model's logits on the last ``resid_post``
        for decoder language models (tested). Encoders raise: their MLM head is not a final
        norm plus unembedding."""
        if self.is_encoder:
            raise TLDynamicsError(
                f"the logit lens is not applicable to the encoder "
                f"{self.info.architecture}: its masked-LM head is not a final "
                "normalisation followed by the unembedding"
            )
        return self.unembed(self.final_norm(resid))

    @property
    def attention_only(self) -> bool:
        """True when no block has an MLP (TransformerLens's ``attn_only``): the stream between
        attention layers holds only the embeddings, the heads' outputs and biases, so a circuit
        read from the weights alone (through the norms) is the whole path.

        Example:
            >>> from tl_dynamics import zoo
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ModelAdapter(zoo.load("induction-2l")).attention_only
            True
        """
        cfg = self.model.cfg
        if getattr(cfg, "attn_only", False):
            return True
        return all(getattr(block, "mlp", None) is None for block in self.model.blocks)

    @property
    def is_encoder(self) -> bool:
        """True for bidirectional (encoder) models."""
        return any(not spec.causal for spec in self.specs)

    # ----------------------------------------------------------------- positions
    def positions(self, batch: Batch | Bool[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
        """Position ids as the host derives them from the padding mask (of a ``Batch``, or a
        ``key_valid`` mask): counted over real tokens, so a left-padded row starts at 0.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ad = ModelAdapter(testing.tiny_model("llama"))
            >>> batch = ad.tokenize(["a b c", "a"], padding_side="left")  # row 1: 2 pads, BOS, a
            >>> ad.positions(batch)[1][batch.key_valid[1]].tolist()
            [0, 1]
        """
        key_valid = batch.key_valid if isinstance(batch, Batch) else batch
        return positions_from_mask(key_valid)

    def rotation(self, layer: int) -> Rotation | None:
        """The rotary ``Rotation`` of ``layer`` as the model applies it, or None where the layer
        has no rotary embedding. Read once (a short probe forward pass on some hosts) and
        checked against the model's own rotated queries wherever it fires them.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ad = ModelAdapter(testing.tiny_model("phi"))   # partial rotary: 8 of 16 dims
            >>> r = ad.rotation(0)
            >>> (r.layout, r.rotary_dim), ModelAdapter(testing.tiny_model("gpt2")).rotation(0)
            (('half', 8), None)
        """
        self.check_layer(layer)
        where = f"layer {layer} of {self.info.architecture}"
        return self._cached(
            ("rotation", layer),
            lambda: read_rotation(
                self.specs[layer],
                self.model,
                lambda roles: self._probe(layer, roles),
                lambda x: self.unrotated_queries(layer, self.attention_input(layer, x)),
                where,
                lambda: self._cached(("inv_freq",), lambda: inv_freq_buffers(self.model)),
            ),
        )

    def unrotated_queries(
        self, layer: int, x: Float[Tensor, "... d_model"]
    ) -> Float[Tensor, "... head d_head"]:
        """The queries of every head before rotary for attention inputs ``x`` (as W_Q reads
        them, e.g. ``LayerAttention.reference["x"]``): ``x W_Q + b_Q``, normalised by the
        model's own query norm on qk-norm layers (``query_norm``)."""
        spec = self.specs[layer]
        if spec.gate == "router":  # JetMoE: each token's query expert, by its router (_jetmoe)
            return routed_queries(self.model, layer, x, self.n_kv_heads)
        q = torch.einsum("...m,hmd->...hd", x.float(), self.W_Q(layer)) + self.b_Q(layer)
        norm = None if spec.postrope else self._query_norm(layer)  # postrope: after rotary
        q = q if norm is None else norm.apply_heads(q, x.float())
        return q if spec.clip is None else q.clamp(-spec.clip, spec.clip)  # clip_qkv: after norm

    def _probe(self, layer: int, roles: Sequence[str]) -> dict[str, Tensor]:
        """The activations of ``roles`` that ``layer`` fires in the probe pass (``_probepass``:
        ``PROBE_TOKENS`` tokens, stopped after the last rotary layer). One pass serves every
        rotary layer (the self-check's own, where it ran); it runs when the first rotation is
        read, never inside another forward pass (``ModelAdapter.capture`` reads rotations
        before it hooks the model)."""
        return self._cached(("probe", tuple(roles)), lambda: rotation_probe(self, roles)).get(
            layer, {}
        )

    def attention_input(self, layer: int, x: Tensor) -> Tensor:
        """The vector W_Q reads, from the captured ``x`` hook. HookedTransformer's
        ``ln1.hook_normalized`` is taken before the LayerNorm's own weight and bias, so they
        are applied here (identity for LNPre and for models with folded LayerNorm)."""
        if self.info.host != "hooked" or self.post_norm == "post":
            return x  # a bridge's hook is the input itself; OLMo 2 post-norm reads the stream
        ln = self.model.blocks[layer].ln1
        weight, bias = getattr(ln, "w", None), getattr(ln, "b", None)
        if isinstance(weight, Tensor):
            x = x * weight.detach().float()
        if isinstance(bias, Tensor):
            x = x + bias.detach().float()
        return x

    def fingerprints(self) -> dict[str, str]:
        """What the model computes from, as SHA-256 digests: its weights (the state dict, in name
        order), its configuration (bookkeeping fields left out) and its tokenizer (with whether
        the host prepends BOS); a statistics file records them (docs/stats-format.md). Reads
        every weight once: about a second for GPT-2 small on a CPU (benchmarks/README.md).

        Returns:
            ``{"weights": hex, "config": hex, "tokenizer": hex}``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> prints = ModelAdapter(testing.cached_model("gpt2")).fingerprints()
            >>> sorted(prints), len(prints["weights"])
            (['config', 'tokenizer', 'weights'], 64)
        """
        tokenizer = getattr(self.model, "tokenizer", None)
        prepend = _switches.prepend_bos(self.model) if tokenizer is not None else None
        return _finite.fingerprints(self.model, tokenizer, prepend)
