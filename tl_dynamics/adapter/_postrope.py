"""q/k normalised after rotary (HunYuan dense): the scored q and k come from the norm's hooks.

HunYuan rotates the projected query and key first and RMS-normalises each head after
(``qk_norm_after_rope``), with a per-dimension gain ``w``:

    q_ih = N(R_i (x_i W_Q^h)) = R_i (x_i W_Q^h) / rms(x_i W_Q^h) * w

A rotation keeps the sum of squares, so the rms is the projection's own, but the gain does not
commute with the rotation unless ``w`` is equal on each rotated pair: the scored query is not the
rotation of a normalised linear map of ``x``, the form the adapter's ``query_norm`` and rotary
frames assume. TransformerLens fires ``hook_rot_q``/``hook_rot_k`` before the norm and
``hook_q_normed``/``hook_k_normed`` (``[batch, head, pos, d_head]``) after it, on what is scored;
the adapter reads those (``LayerSpec.postrope``), so the pattern, ``z`` and head outputs are
exact, and ``ModelAdapter.query_norm`` refuses such a layer by name (docs/math.md §1.6).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from tl_dynamics.adapter._gate import gate_roles
from tl_dynamics.adapter._jetmoe import routed_refusal
from tl_dynamics.errors import TLDynamicsError

__all__ = ["POSTROPE_HOOKS", "extra_roles", "postrope_qk", "postrope_refusal", "refuse_query_map"]

# role -> bridge hook (after ``attn.``'s block prefix), fired only where the layer has them
POSTROPE_HOOKS = {"q_normed": "attn.hook_q_normed", "k_normed": "attn.hook_k_normed"}


def extra_roles(spec: Any) -> list[str]:
    """The hook roles a layer needs besides q/k/v and rotary: what its gate is formed from on
    gated layers (``_gate``), its post-rotary q/k norms' outputs on ``postrope`` layers."""
    return gate_roles(spec) + (list(POSTROPE_HOOKS) if getattr(spec, "postrope", False) else [])


def postrope_qk(spec: Any, st: dict[str, Tensor], architecture: str) -> tuple[Tensor, Tensor]:
    """The scored ``(q, k)`` ``[batch, pos, head, d_head]`` of a ``postrope`` layer."""
    missing = [r for r in POSTROPE_HOOKS if r not in st]
    if missing:
        raise TLDynamicsError(
            f"layer {spec.layer} of {architecture} normalises q and k after "
            f"rotary but the forward pass did not fire its {missing} hooks"
        )
    return st["q_normed"].float().transpose(1, 2), st["k_normed"].float().transpose(1, 2)


def postrope_refusal(layer: int, architecture: str) -> TLDynamicsError:
    """What ``query_norm`` raises on a ``postrope`` layer.

    Example:
        >>> str(postrope_refusal(0, "HunYuanDenseV1ForCausalLM"))[:74]
        'layer 0 of HunYuanDenseV1ForCausalLM normalises q and k after rotary with '
    """
    return TLDynamicsError(
        f"layer {layer} of {architecture} normalises q and k after rotary with a per-dimension "
        "gain (qk_norm_after_rope), so its scored query is not a rotation of a normalised linear "
        "map of the layer input; analyses that read the query as one (the contextual MLP's query "
        "frame) do not apply (the pattern, z and head outputs are exact: ModelAdapter.attention)"
    )


def refuse_query_map(spec: Any, architecture: str) -> None:
    """Refuse (``ModelAdapter.query_norm``) a layer whose scored query is not the rotation of
    ``N(x W_Q + b_Q)``: q/k normalised after rotary (``postrope``), or clamped after their
    projections (``clip``: OLMo, OLMoE, MPT ``clip_qkv``), so not a fixed map of ``x`` that
    the query frame can invert."""
    if getattr(spec, "postrope", False):
        raise postrope_refusal(spec.layer, architecture)
    if getattr(spec, "gate", None) == "router":  # JetMoE: the query expert depends on x
        raise routed_refusal(spec, architecture, "ModelAdapter.query_norm")
    if getattr(spec, "clip", None) is not None:
        raise TLDynamicsError(
            f"layer {spec.layer} of {architecture} clamps q, k and v to [-{spec.clip}, "
            f"{spec.clip}] after their projections (clip_qkv), so its query is not a linear map "
            "of the layer input; analyses that read the query as one (the contextual MLP's query "
            "frame) do not apply (the pattern, z and head outputs are exact: "
            "ModelAdapter.attention)"
        )
