"""What a layer refuses to analyses that do not model it: learned attention sinks (GPT-OSS)
and output gates on ``z`` (gated attention). ``LayerAttention`` has these methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from tl_dynamics.adapter._checks import sink_refusal
from tl_dynamics.adapter._gate import gate_refusal

if TYPE_CHECKING:
    from tl_dynamics.adapter._spec import LayerSpec


class LayerRefusals:
    """The refusals of ``LayerAttention`` (its base class): each names the analysis asking."""

    spec: "LayerSpec"
    sink_logit: Tensor | None
    gate: Tensor | None

    def require_no_sinks(self, analysis: str) -> None:
        """Refuse, naming ``analysis``, when this layer has learned attention sinks.

        Its rows then sum to less than 1, which ``analysis`` does not model.

        Args:
            analysis: The name of the analysis asking (for the error message).

        Raises:
            TLDynamicsError: When the layer has a ``sink_logit``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.require_no_sinks("my analysis")  # gpt2 has no sinks: nothing happens
        """
        if self.sink_logit is not None:
            raise sink_refusal(self.spec.layer, analysis)

    def require_ungated(self, analysis: str) -> None:
        """Refuse, naming ``analysis``, when this layer's ``z`` is multiplied by an output gate.

        On gated layers (``spec.gate``: Qwen3-Next, Qwen3.5, AFMoE, Laguna, BitNet) what a head
        writes is not ``pattern @ v`` times a fixed matrix, which ``analysis`` does not model.

        Args:
            analysis: The name of the analysis asking (for the error message).

        Raises:
            TLDynamicsError: When the layer has a ``gate``.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> adapter = ModelAdapter(testing.cached_model("gpt2"))
            >>> la = adapter.attention("def f(x): return x", layers=[0])[0]
            >>> la.require_ungated("my analysis")  # gpt2 has no gate: nothing happens
        """
        if self.gate is not None:
            raise gate_refusal(self.spec, "this model", analysis)
