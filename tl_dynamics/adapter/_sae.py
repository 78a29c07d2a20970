"""SAELens: sparse autoencoders (and transcoders) spliced into a model's hook points.

SAELens's ``HookedSAETransformer.add_sae`` (TransformerLens 3.x) replaces the hook point it
splices into by a wrapper module; the wrapper's own hook points (``<hook>.hook_sae_input`` ...
``<hook>.hook_sae_output``) take its place, and what flows on is ``<hook>.hook_sae_output``: the
SAE's reconstruction (plus the error term with ``use_error_term``).

- In the residual stream, the embeddings or an MLP (``hook_resid_pre``, ``hook_mlp_out``, ...)
  every analysis is exact against the spliced forward: the attention it reads is computed from
  the spliced stream, and a read of the spliced point itself reads ``<hook>.hook_sae_output``
  (``spliced_output``).
- Inside attention (``attn.hook_q``/``hook_k``/``hook_v``, rotary q/k, scores, pattern,
  ``hook_z``, ``hook_result``, the attention input and output, ``ln1``) and at the final
  normalisation the analyses would not be exact, so the adapter refuses the model by the hook's
  name (``refuse_attention``): the head would write the SAE's reconstruction, which ``W_V W_O``
  does not reproduce, or attend by a pattern the QK weights do not produce.

Only HookedTransformer hosts are walked (SAELens splices into those); a TransformerBridge has
no spliced modules.
"""

from __future__ import annotations

from typing import Any

from transformer_lens.hook_points import HookPoint

from tl_dynamics.errors import TLDynamicsError

# What flows on from a spliced hook point (SAELens's wrapper hook).
SPLICED_OUTPUT = "hook_sae_output"
# Positions inside a block (relative names) whose SAE the analyses cannot reproduce, and why.
_WRITES = (
    "the head would write the SAE's reconstruction, which W_V W_O (the OV circuits, the "
    "per-head outputs and their sums) does not reproduce"
)
_ATTENDS = (
    "the heads would attend and write by activations the SAE reconstructs, which the "
    "QK and OV weights (W_Q, W_K, W_V W_O) and the odds-ratio split do not reproduce"
)
_BLOCK_PARTS = {
    "attn.hook_v": _WRITES,
    "attn.hook_z": _WRITES,
    "attn.hook_result": _WRITES,
    "hook_attn_out": _WRITES,
}
_BLOCK_PREFIXES = ("attn.", "ln1.", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")
_FINAL = (
    "the logit lens recomputes the final normalisation from the residual stream, which "
    "the SAE's reconstruction replaces"
)


def spliced(model: Any, host: str) -> dict[str, str]:
    """Hook positions of a HookedTransformer (``host == "hooked"``) whose HookPoint was
    replaced by another module, with that module's class name.

    Example:
        >>> import torch
        >>> spliced(torch.nn.Module(), "bridge")
        {}
    """
    if host != "hooked":
        return {}  # SAELens splices into HookedTransformer (HookedSAETransformer) only
    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1].startswith("hook_") and not isinstance(module, HookPoint)
    }


def _reason(name: str) -> str | None:
    """Why an SAE at ``name`` cannot be reproduced (None: it is outside attention)."""
    parts = name.split(".")
    if parts[0] == "ln_final":
        return _FINAL
    if parts[0] != "blocks" or len(parts) < 3:
        return None
    inner = ".".join(parts[2:])
    if inner in _BLOCK_PARTS:
        return _BLOCK_PARTS[inner]
    return _ATTENDS if inner.startswith(_BLOCK_PREFIXES) else None


def refuse_attention(model: Any, host: str, architecture: str) -> None:
    """Raise a ``TLDynamicsError`` naming the first spliced hook inside attention (or at the
    final normalisation) and why; SAEs elsewhere pass."""
    for name, kind in spliced(model, host).items():
        why = _reason(name)
        if why is not None:
            raise TLDynamicsError(
                f"this {architecture} model has an SAE ({kind}) spliced at {name!r}: {why}, so "
                f"tl_dynamics refuses it. Remove it (model.reset_saes()) or splice SAEs outside "
                f"attention (hook_resid_pre/mid/post, MLP hooks), where every analysis reads "
                f"the spliced stream"
            )


def spliced_output(hook_dict: Any, name: str) -> str | None:
    """The hook that carries what flows on from a spliced ``name`` (None: not spliced), in the
    model's ``hook_dict``."""
    out = f"{name}.{SPLICED_OUTPUT}"
    return out if out in hook_dict else None
