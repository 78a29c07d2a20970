"""``LayerSpec`` and ``HostInfo``: what ``_host`` (and ``_bridgespec`` for a bridge) read from
a TransformerLens model, per layer and once per model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tl_dynamics.adapter._kinds import ATTENTION
from tl_dynamics.compat import Host

RotaryStyle = Literal["none", "hooked", "half", "interleaved"]


@dataclass(frozen=True)
class LayerSpec:
    """How one attention layer scores, as read from the model (not from cfg defaults).

    Attributes:
        scale: ``c`` in ``s = c <q, k> + bias``.
        softcap: ``cap`` in ``cap * tanh(s / cap)``, or None.
        window: sliding/local window ``w`` (key ``j`` allowed iff ``j > i - w``, and also
            ``j < i + w`` on bidirectional layers: Gemma 3 with use_bidirectional_attention), or None.
        causal: whether key ``j`` must satisfy ``j <= i``.
        rotary: how q and k are rotated: ``"none"``; ``"hooked"`` (the model fires rotated
            q/k hooks); ``"half"`` (rotate_half with the model's cos/sin on the first
            ``rotary_dim`` dims); ``"interleaved"`` (GPT-J style, base ``rotary_base``).
        alibi: ``"none"``, ``"key"`` (Bloom: ``slope_h * key_position``), ``"relative"``
            (HookedTransformer: ``slope_h * (j - i)``), ``"falcon"`` (Falcon with
            ``alibi=True``: Hugging Face adds its bf16 ``a_j = slope_h * key_position`` twice,
            inside the module as ``(q.k + a_j) * scale`` and again through the attention mask
            as ``a_j / sqrt(d_head)``; TransformerLens runs the same two terms) or ``"mpt"``
            (MPT: ``slope_h * (j - (n - 1))`` with MPT's own slopes, not padding-aware).
        scores_hook: what the model's ``hook_attn_scores`` holds: ``"logits"`` (pre-softmax,
            post-mask) or ``"pattern"`` (post-softmax weights, on delegating bridges).
        qk_norm: whether q/k are normalised after their projections (q is then not linear
            in the layer input).
        sinks: whether the layer has learned per-head attention sinks (GPT-OSS): a logit
            ``sink_h`` joins every softmax row as an extra column that is then dropped, so
            ``p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h))`` and rows sum to less than 1.
        kind: what the layer mixes tokens with (``_kinds``): ``"attention"`` (softmax attention
            the host hooks: every other field describes it), else e.g. ``"state_space"``,
            ``"linear_attention"``, ``"conv"`` on hybrid and attention-free models, whose other
            fields are placeholders that no recipe reads.
        latent: multi-head latent attention (DeepSeek-V2/V3; ``_mla``): the q/k hooks hold the
            rotated, concatenated non-rotary and rotary parts, so ``rotary`` is ``"none"`` (no
            rotation left to apply; ``ModelAdapter.rotation`` gives the one the model applied, to
            the last coordinates) and the q/k width differs from the value width.
        prenorm: the q/k hooks hold the projections before the layer's q/k norm (Llama 4, whose
            bridge delegates to Hugging Face): the adapter applies the norm (``query_norm``) to
            both before rotary. Llama 4 normalises after rotary; a weightless RMS norm commutes
            with a rotation (it preserves the sum of squares), so the order does not matter.
        gate: the output gate multiplying ``z`` (``_gate.GATE_WHAT``: ``"sigmoid"`` on Qwen3-Next
            and Qwen3.5, ``"gate_proj"`` on AFMoE, ``"g_proj"`` on Laguna, ``"sub_norm"`` on
            BitNet, ``"router"`` on JetMoE: each slot's router weight, its query and output
            projections chosen per token, ``_jetmoe``), or None.
        postrope: q and k are normalised after rotary (HunYuan; ``_postrope``): the scored q/k
            are read from the norm's hooks, and ``query_norm`` refuses the layer.
        clip: ``clip_qkv`` (OLMo, OLMoE, MPT): q, k and v clamped to ``[-clip, clip]`` after
            their projections (after the hooks fire), or None.
        unhooked: the host wraps this softmax attention without query, key or pattern hooks
            (RecurrentGemma, NemotronH; ``_unhooked``): what it scores is read with torch hooks
            on the Hugging Face module, its weights from the module's projections.
        vnorm: q, k and v are each RMS-normalised per head (Gemma 4; ``_gemma4``): q/k/v are
            read from the norms' hooks, and ``W_V`` (no fixed OV map) refuses the layer.
        kv_from: the earlier layer whose keys and values this one scores (Gemma 4's
            ``num_kv_shared_layers``), or None: its ``W_K``/``W_V`` refuse, and it is collected
            together with that layer.
    """

    layer: int
    scale: float
    softcap: float | None
    window: int | None
    causal: bool
    rotary: RotaryStyle
    rotary_dim: int | None
    rotary_base: float | None
    alibi: Literal["none", "key", "relative", "falcon", "mpt"]
    scores_hook: Literal["logits", "pattern"]
    qk_norm: bool
    sinks: bool = False
    kind: str = ATTENTION
    latent: bool = False
    prenorm: bool = False
    gate: str | None = None
    postrope: bool = False
    clip: float | None = None
    unhooked: bool = False
    vnorm: bool = False
    kv_from: int | None = None

    @property
    def is_attention(self) -> bool:
        return self.kind == ATTENTION


@dataclass(frozen=True)
class HostInfo:
    """What the model is: its host, the TransformerLens version, the bridge's compatibility mode,
    the architecture's name and its attention family (a ``VERIFIED_HF_ATTENTION`` value, or
    ``"hooked"``, ``"none"`` without softmax attention)."""

    host: Host
    tl_version: str
    compat: bool
    architecture: str
    family: str
