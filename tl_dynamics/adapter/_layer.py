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

from tl_dynamics.adapter._refusals import LayerRefusals
from tl_dynamics.adapter._softmax import masked_log_softmax, masked_softmax
from tl_dynamics.adapter._spec import LayerSpec


@dataclass(frozen=True)
class LayerAttention(LayerRefusals):
    """Queries, keys and values of one layer exactly as the model scored them.

    ``q``, ``k`` and ``v`` are float32, rotary applied where the architecture has it, with grouped
    K/V heads already mapped to their query heads. ``spec.scores_hook`` says whether the reference
    ``"scores"`` hold logits or, on delegating bridges, the pattern itself. Made by
    ``ModelAdapter.attention`` and ``ModelAdapter.capture``.

    Args:
        spec: The layer's ``LayerSpec`` (scale, soft-cap, mask kind, window, hooks).
        q: Queries, ``[batch, pos, head, d_head]``.
        k: Keys, ``[batch, pos, head, d_head]``.
        v: Values, ``[batch, pos, head, d_head]``.
        position_bias: The additive position bias (ALiBi), ``[batch, head, pos, pos]``, or None.
        allowed: ``allowed[b, i, j]``: may query ``i`` attend to key ``j`` (causal, sliding
            window and key padding together), ``[batch, pos, pos]``.
        query_valid: False on padding query rows, whose pattern is meaningless, ``[batch, pos]``.
        W_O: The output projection, ``[head, d_head, d_model]``.
        b_O: The output bias, ``[d_model]``.
        reference: The model's own cached activations when asked for (keys ``"scores"``,
            ``"pattern"``, ``"z"``, ``"out"``).
        sink_logit: Each head's learned sink logit, ``[head]``, where the layer has sinks
            (GPT-OSS); None elsewhere.
        gate: The output gate's multiplier on gated layers (``spec.gate``: ``sigmoid(g)`` on
            Qwen3-Next and Qwen3.5, the gates of AFMoE and Laguna, BitNet's sub-norm
            ``w / rms(z_i)``), ``[batch, pos, head, d_head]`` or broadcastable to it; ``z``
            includes it: ``z_i = (sum_j p_ij v_j) * gate_i``. None elsewhere.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
        >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
        >>> la.pattern().shape
        torch.Size([1, 4, 8, 8])
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
        """The layer's index.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.layer
            0
        """
        return self.spec.layer

    @property
    def scale(self) -> float:
        """The score scale ``c`` (``1 / sqrt(d_head)`` unless the architecture sets another).

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.scale
            0.25
        """
        return self.spec.scale

    @property
    def softcap(self) -> float | None:
        """The attention logit soft-cap (Gemma 2), or None when the model has none.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.softcap is None
            True
        """
        return self.spec.softcap

    @property
    def n_heads(self) -> int:
        """The number of query heads.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.n_heads
            4
        """
        return self.q.shape[2]

    def _heads(self, heads: Sequence[int] | None) -> slice | list[int]:
        return slice(None) if heads is None else list(heads)

    def bias(
        self, heads: Sequence[int] | None = None
    ) -> Float[Tensor, "batch head pos pos"] | None:
        """The additive position bias ``p_ij`` (ALiBi), or None when the model has none.

        Args:
            heads: The heads to return (all by default).

        Returns:
            The bias, ``[batch, head, pos, pos]``, or None.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.bias() is None
            True
        """
        if self.position_bias is None:
            return None
        return self.position_bias[:, self._heads(heads)]

    def raw_scores(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """The scores ``r_ij = c <q_i, k_j> + p_ij`` before soft-capping and masking.

        Args:
            heads: The heads to score (all by default).

        Returns:
            The raw scores, ``[batch, head, pos, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.raw_scores(heads=[1]).shape
            torch.Size([1, 1, 8, 8])
        """
        h = self._heads(heads)
        r = torch.einsum("bihd,bjhd->bhij", self.q[:, :, h], self.k[:, :, h]) * self.scale
        bias = self.bias(heads)
        return r if bias is None else r + bias

    def capped(
        self, raw: Float[Tensor, "batch head pos pos"]
    ) -> Float[Tensor, "batch head pos pos"]:
        """Apply the model's soft-cap ``cap * tanh(raw / cap)`` (the identity when it has none).

        Args:
            raw: Scores, ``[batch, head, pos, pos]``.

        Returns:
            The capped scores, same shape.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> raw = la.raw_scores()
            >>> la.capped(raw).equal(raw)
            True
        """
        cap = self.softcap
        return raw if cap is None else cap * torch.tanh(raw / cap)

    def scores(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """The pre-softmax scores the model's softmax sees on allowed entries (after the soft-cap).

        Over all heads they are computed once per layer and shared by every reader.

        Args:
            heads: The heads to return (all by default).

        Returns:
            The scores, ``[batch, head, pos, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.scores().equal(la.raw_scores())  # gpt2: no bias, no soft-cap
            True
        """
        return self._memoised("scores", heads, lambda: self.capped(self.raw_scores(heads)))

    def masked_softmax(
        self, scores: Float[Tensor, "batch head pos pos"], heads: Sequence[int] | None = None
    ) -> Float[Tensor, "batch head pos pos"]:
        """Softmax over allowed keys; rows with no allowed key (pad queries) are all zero.

        Learned sinks, where the layer has them, join every row's denominator (``sink_logit``).

        Args:
            scores: Scores of ``heads``, ``[batch, head, pos, pos]``.
            heads: The heads ``scores`` belong to (all by default).

        Returns:
            The weights, ``[batch, head, pos, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> torch.allclose(la.masked_softmax(la.scores()), la.pattern())
            True
        """
        sink = None if self.sink_logit is None else self.sink_logit[self._heads(heads)]
        return masked_softmax(scores, self.allowed, sink)

    def pattern(self, heads: Sequence[int] | None = None) -> Float[Tensor, "batch head pos pos"]:
        """The attention pattern, recomputed: it equals the model's ``hook_pattern`` on valid rows.

        Over all heads it is computed once per layer.

        Args:
            heads: The heads to return (all by default).

        Returns:
            The pattern, ``[batch, head, pos, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.pattern().sum(-1).allclose(torch.ones(1, 4, 8))
            True
        """
        return self._memoised(
            "pattern", heads, lambda: self.masked_softmax(self.scores(heads), heads)
        )

    def log_pattern(
        self, heads: Sequence[int] | None = None
    ) -> Float[Tensor, "batch head pos pos"]:
        """The log of the pattern: -inf on masked keys and on rows with no allowed key.

        Over all heads it is computed once per layer. Learned sinks join the denominator as in
        ``pattern``.

        Args:
            heads: The heads to return (all by default).

        Returns:
            The log-pattern, ``[batch, head, pos, pos]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.log_pattern()[0, 0, 0, 1].item()  # query 0 may not see key 1
            -inf
        """

        def make() -> Tensor:
            if self.sink_logit is not None:
                return torch.log(self.pattern(heads))
            return masked_log_softmax(self.scores(heads), self.allowed)

        return self._memoised("log_pattern", heads, make)

    def z(
        self, heads: Sequence[int] | None = None, pattern: Tensor | None = None
    ) -> Float[Tensor, "batch pos head d_head"]:
        """The heads' mixed values ``pattern @ v`` (times the output gate on gated layers).

        They equal the model's ``hook_z`` on valid rows; on gated layers (``gate``) ``z``
        includes the gate.

        Args:
            heads: The heads to compute (all by default).
            pattern: A pattern of ``heads`` to use instead of the recomputed one,
                ``[batch, head, pos, pos]``.

        Returns:
            ``z``, ``[batch, pos, head, d_head]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.z(heads=[0, 2]).shape
            torch.Size([1, 8, 2, 16])
        """
        h = self._heads(heads)
        pattern = self.pattern(heads) if pattern is None else pattern
        z = torch.einsum("bhij,bjhd->bihd", pattern, self.v[:, :, h])
        return z if self.gate is None else z * self.gate[:, :, h]

    def head_outputs(
        self, heads: Sequence[int] | None = None, z: Tensor | None = None
    ) -> Float[Tensor, "batch pos head d_model"]:
        """Per-head outputs ``z_h @ W_O[h]``; over all heads they sum (plus ``b_O``) to the attention output.

        Args:
            heads: The heads to compute (all by default).
            z: The ``z`` of ``heads`` to use instead of the recomputed one,
                ``[batch, pos, head, d_head]``.

        Returns:
            The outputs, ``[batch, pos, head, d_model]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.head_outputs().shape
            torch.Size([1, 8, 4, 64])
        """
        h = self._heads(heads)
        z = self.z(heads) if z is None else z
        return torch.einsum("bihd,hdm->bihm", z, self.W_O[h])

    def source_outputs(
        self, heads: Sequence[int] | None = None
    ) -> Float[Tensor, "batch pos head d_model"]:
        """Per-source head outputs ``o_j = v_j @ W_O`` (the contextual MLP's outgoing weights).

        Refused on gated layers, where what source ``j`` adds depends on the query's gate.

        Args:
            heads: The heads to compute (all by default).

        Returns:
            The outputs by key position, ``[batch, pos, head, d_model]``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> out = la.head_outputs()[0, 3, 1]
            >>> mixed = la.pattern()[0, 1, 3] @ la.source_outputs()[0, :, 1]
            >>> torch.allclose(out, mixed, atol=1e-5)
            True
        """
        self.require_ungated("LayerAttention.source_outputs")
        h = self._heads(heads)
        return torch.einsum("bjhd,hdm->bjhm", self.v[:, :, h], self.W_O[h])
