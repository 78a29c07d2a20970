"""One attention layer's inputs as the model scored them, and the exact recomputation.

Pure tensors: no model, no hooks. Everything the analyzers need is a method here, so the
recipe ``s = c <q, k> + bias -> soft-cap -> mask -> softmax -> pattern @ v -> z @ W_O`` is
written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_dynamics.adapter._gate import gate_refusal
from tl_dynamics.adapter._host import LayerSpec
from tl_dynamics.adapter._softmax import masked_log_softmax, masked_softmax
from tl_dynamics.errors import TLDynamicsError


@dataclass(frozen=True)
class LayerAttention:
    """Queries, keys and values of one layer exactly as the model scored them.

    ``q``, ``k`` and ``v`` are float32, rotary applied where the architecture has it, with
    grouped K/V heads already mapped to their query heads. ``allowed[b, i, j]`` says whether
    query ``i`` may attend to key ``j`` (causal, sliding window and key padding together);
    ``query_valid[b, i]`` is False on padding query rows, whose pattern is meaningless.
    ``sink_logit[h]`` is head ``h``'s learned sink logit where the layer has sinks
    (``spec.sinks``; GPT-OSS), joining every softmax denominator; None elsewhere.
    ``gate`` is the output gate's multiplier on gated layers (``spec.gate``: ``sigmoid(g)`` on
    Qwen3-Next and Qwen3.5, the gates of AFMoE and Laguna, BitNet's sub-norm ``w / rms(z_i)``),
    which ``z`` includes: ``z_i = (sum_j p_ij v_j) * gate_i``; None elsewhere. It is the layer's
    own (BitNet's from the layer's own pattern, also under ``z(pattern=...)``).
    ``reference`` holds the model's own cached activations when they were asked for
    (keys ``"scores"``, ``"pattern"``, ``"z"``, ``"out"``); ``spec.scores_hook`` says
    whether ``"scores"`` holds logits or, on delegating bridges, the pattern itself.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> adapter = ModelAdapter(testing.tiny_model("llama"))     # doctest: +SKIP
        >>> la = adapter.attention("def f(x): return x", layers=[0])[0]  # doctest: +SKIP
        >>> la.pattern().shape                                      # doctest: +SKIP
        torch.Size([1, 4, 9, 9])
    """

    spec: LayerSpec
    q: Float[Tensor, "batch pos head d_head"]
    k: Float[Tensor, "batch pos head d_head"]
    v: Float[Tensor, "batch pos head d_head"]
    position_bias: Float[Tensor, "batch head pos pos"] | None
    allowed: Bool[Tensor, "batch pos pos"]
    query_valid: Bool[Tensor, "batch pos"]
    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, " d_model"]
    reference: dict[str, Tensor] = field(default_factory=dict)
    sink_logit: Float[Tensor, " head"] | None = None
    gate: Float[Tensor, "batch pos head d_head"] | None = None
    # what every collector reads of this layer, computed once (all heads): scores, pattern,
    # log-pattern; new for each instance (``dataclasses.replace`` makes a fresh one)
    _memo: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _memoised(self, name: str, heads: Sequence[int] | None, make) -> Tensor:
        if heads is not None:
            return make()
        if name not in self._memo:
            self._memo[name] = make()
        return self._memo[name]

    @property
    def layer(self) -> int:
        return self.spec.layer

    @property
    def scale(self) -> float:
        return self.spec.scale

    @property
    def softcap(self) -> float | None:
        return self.spec.softcap

    @property
    def n_heads(self) -> int:
        return self.q.shape[2]

    def require_no_sinks(self, analysis: str) -> None:
        """Refuse, naming ``analysis``, when this layer has learned attention sinks (its rows sum
        to less than 1, which ``analysis`` does not model)."""
        if self.sink_logit is not None:
            raise TLDynamicsError(
                f"{analysis}: layer {self.layer} has learned attention sinks (a per-head logit "
                "joins every softmax denominator, p_ij = exp(s_ij) / (sum_j exp(s_ij) + "
                "exp(sink_h)), so rows sum to less than 1), which it does not model")

    def require_ungated(self, analysis: str) -> None:
        """Refuse, naming ``analysis``, when this layer's ``z`` is multiplied by an output gate
        (``spec.gate``), which ``analysis`` does not model."""
        if self.gate is not None:
            raise gate_refusal(self.spec, "this model", analysis)

    def _heads(self, heads: Sequence[int] | None) -> slice | list[int]:
        return slice(None) if heads is None else list(heads)

    def bias(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"] | None:
        """The additive position bias ``p_ij`` (ALiBi), or None when the model has none."""
        if self.position_bias is None:
            return None
        return self.position_bias[:, self._heads(heads)]

    def raw_scores(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """``r_ij = c <q_i, k_j> + p_ij`` before soft-capping and masking."""
        h = self._heads(heads)
        r = torch.einsum("bihd,bjhd->bhij", self.q[:, :, h], self.k[:, :, h]) * self.scale
        bias = self.bias(heads)
        return r if bias is None else r + bias

    def capped(self, raw: Float[Tensor, "batch head pos pos"]) -> Float[Tensor, "batch head pos pos"]:
        """Apply the model's soft-cap (identity when it has none)."""
        cap = self.softcap
        return raw if cap is None else cap * torch.tanh(raw / cap)

    def scores(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """The pre-softmax scores the model's softmax sees on allowed entries (post-cap); over
        all heads, computed once per layer and shared by every reader."""
        return self._memoised("scores", heads, lambda: self.capped(self.raw_scores(heads)))

    def masked_softmax(self, scores: Float[Tensor, "batch head pos pos"],
                       heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """Softmax over allowed keys (``scores`` of ``heads``, all heads by default); rows with
        no allowed key (pad queries) are all zero. Learned sinks, where the layer has them,
        join every row's denominator (``sink_logit``)."""
        sink = None if self.sink_logit is None else self.sink_logit[self._heads(heads)]
        return masked_softmax(scores, self.allowed, sink)

    def pattern(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """The attention pattern, recomputed: equals the model's ``hook_pattern`` on valid rows
        (over all heads, computed once per layer)."""
        return self._memoised("pattern", heads,
                              lambda: self.masked_softmax(self.scores(heads), heads))

    def log_pattern(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """``log pattern``: -inf on masked keys and on rows with no allowed key (over all heads,
        computed once per layer). Learned sinks join the denominator as in ``pattern``."""
        def make() -> Tensor:
            if self.sink_logit is not None:
                return torch.log(self.pattern(heads))
            return masked_log_softmax(self.scores(heads), self.allowed)
        return self._memoised("log_pattern", heads, make)

    def z(self, heads: Sequence[int] | None = None,
          pattern: Tensor | None = None) -> Float[Tensor, "batch pos head d_head"]:
        """``pattern @ v`` per head, times the output gate on gated layers (``gate``): equals
        the model's ``hook_z`` on valid rows."""
        h = self._heads(heads)
        pattern = self.pattern(heads) if pattern is None else pattern
        z = torch.einsum("bhij,bjhd->bihd", pattern, self.v[:, :, h])
        return z if self.gate is None else z * self.gate[:, :, h]

    def head_outputs(self, heads: Sequence[int] | None = None,
                     z: Tensor | None = None) -> Float[Tensor, "batch pos head d_model"]:
        """Per-head outputs ``z_h @ W_O[h]``; over all heads they sum (plus ``b_O``) to the
        attention output."""
        h = self._heads(heads)
        z = self.z(heads) if z is None else z
        return torch.einsum("bihd,hdm->bihm", z, self.W_O[h])

    def source_outputs(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch pos head d_model"]:
        """Per-source head outputs ``o_j = v_j @ W_O`` (the contextual MLP's outgoing weights);
        refused on gated layers, where what source ``j`` adds depends on the query's gate."""
        self.require_ungated("LayerAttention.source_outputs")
        h = self._heads(heads)
        return torch.einsum("bjhd,hdm->bjhm", self.v[:, :, h], self.W_O[h])
