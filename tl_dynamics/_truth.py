"""The truth checks behind the exactness tests, re-exported by ``tl_dynamics.testing``: the
adapter's recomputation against the model's own cached activations, and against the Hugging
Face model a bridge wraps (rebuilt with eager attention)."""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import torch

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import ModelAdapter, Prompt

PROMPTS = ("def f(x): return x + 1", "import os\nprint(os.path.join('a', 'b'))  # longer line")


def reconstruction_errors(
    adapter: ModelAdapter, prompt: Prompt = PROMPTS, padding_side: str = "right"
) -> dict[str, float]:
    """Largest differences between the adapter's recomputation and the model's cached activations.

    Over valid query rows: ``scores`` (where the scores hook holds logits; NaN otherwise),
    ``pattern``, ``z`` (NaN where the model hooks no ``z``), ``out`` (head outputs summed plus
    ``b_O`` against the attention output; NaN where the model hooks that output only after a
    post-norm), ``scores_hook_is_pattern``
    (1.0 where the cache's scores equal its pattern).

    Args:
        adapter: A ``ModelAdapter``.
        prompt: The prompts (default: ``PROMPTS``).
        padding_side: Where shorter prompts are padded.

    Returns:
        The largest absolute difference per quantity.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> errors = reconstruction_errors(ModelAdapter(testing.cached_model("gpt2")))
        >>> errors["pattern"] < 1e-5, errors["z"] < 1e-5, errors["scores_hook_is_pattern"]
        (True, True, 0.0)
    """
    worst = {
        "scores": float("nan"),
        "pattern": 0.0,
        "z": float("nan"),
        "out": float("nan"),
        "scores_hook_is_pattern": 0.0,
    }
    for la in adapter.attention(
        prompt, reference=True, padding_side=padding_side, sinks=True
    ).values():
        ref, rows = la.reference, la.query_valid
        pattern = la.pattern()
        worst["pattern"] = max(
            worst["pattern"], _masked_max(pattern - ref["pattern"], rows[:, None, :, None])
        )
        if la.spec.scores_hook == "logits":
            keep = la.allowed[:, None] & rows[:, None, :, None]
            err = (la.scores() - ref["scores"]).abs().masked_fill(~keep, 0.0).max().item()
            worst["scores"] = _nan_max(worst["scores"], err)
        elif torch.equal(ref["scores"], ref["pattern"]):
            worst["scores_hook_is_pattern"] = 1.0
        z = la.z(pattern=pattern)
        if "z" in ref:  # absent where the host hooks no z (JetMoE: its heads' z is not hooked)
            worst["z"] = _nan_max(worst["z"], _masked_max(z - ref["z"], rows[:, :, None, None]))
        if "out" in ref:  # absent where the attention output is only hooked after a post-norm
            out = la.head_outputs(z=z).sum(2) + la.b_O
            worst["out"] = _nan_max(worst["out"], _masked_max(out - ref["out"], rows[:, :, None]))
    return worst


def _nan_max(worst: float, err: float) -> float:
    """``max`` where NaN means "nothing compared yet"."""
    return err if math.isnan(worst) else max(worst, err)


def _masked_max(diff: torch.Tensor, keep: torch.Tensor) -> float:
    return (diff.abs() * keep).max().item()


def hf_twin(model: Any) -> Any:
    """The Hugging Face model a raw-mode bridge wraps, rebuilt with eager attention.

    The very same weights; the bridge's own ``original_model`` returns no attention weights.

    Args:
        model: A ``TransformerBridge`` in raw mode (compatibility mode is refused).

    Returns:
        The Hugging Face model, in eval mode.

    Example:
        >>> from tl_dynamics import testing
        >>> hf_twin(testing.cached_model("gpt2")).config._attn_implementation
        'eager'
    """
    if bool(getattr(model, "compatibility_mode", False)):
        raise TLDynamicsError(
            "hf_twin needs a raw-mode bridge: compatibility mode folds and "
            "centres the weights the Hugging Face model would need"
        )
    orig = model.original_model
    config = copy.deepcopy(orig.config)
    config._attn_implementation = (
        "eager"  # some models (Falcon) keep sdpa after set_attn_implementation
    )
    twin = type(orig)(config).eval()
    wanted = twin.state_dict()
    weights = {
        k: v for k, v in ((_strip(k), v) for k, v in orig.state_dict().items()) if k in wanted
    }
    if set(wanted) - set(weights):
        raise TLDynamicsError(
            f"hf_twin: weights not found in the bridge: {sorted(set(wanted) - set(weights))}"
        )
    twin.load_state_dict(weights)
    twin.set_attn_implementation("eager")
    if twin.config._attn_implementation != "eager":
        raise TLDynamicsError(f"hf_twin: {type(orig).__name__} would not switch to eager attention")
    return twin


def _strip(name: str) -> str:
    return name.replace("._original_component", "").replace("_original_component.", "")


def hf_truth_errors(
    adapter: ModelAdapter, twin: Any, prompt: Prompt = PROMPTS, padding_side: str = "right"
) -> dict[str, float]:
    """Largest differences between the adapter's recomputation and the Hugging Face twin's own.

    Over valid query rows: the recomputed ``pattern`` and summed head outputs (``out``, the output
    projection's result) against the twin's (``output_attentions=True``; position ids derived
    from the mask as the bridge derives them). ``out`` is NaN on compatibility-mode bridges (their
    weights are centred, so their head sum differs from Hugging Face's by design).

    Args:
        adapter: A ``ModelAdapter`` over a bridge.
        twin: ``hf_twin(adapter.model)``.
        prompt: The prompts (default: ``PROMPTS``).
        padding_side: Where shorter prompts are padded.

    Returns:
        ``{"pattern": ..., "out": ...}``, the largest absolute differences.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> model = testing.cached_model("gpt2")
        >>> errors = hf_truth_errors(ModelAdapter(model), hf_twin(model))
        >>> errors["pattern"] < 1e-5, errors["out"] < 1e-5
        (True, True)
    """
    batch = adapter.tokenize(prompt, padding_side)
    mask = batch.key_valid.long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    twin_modules = dict(twin.named_modules())
    names = {
        id(mod): _strip(name)
        for name, mod in adapter.model.original_model.named_modules(  # the path the twin has, of the bridge's aliases
            remove_duplicate=False
        )
        if _strip(name) in twin_modules
    }
    outs: dict[int, torch.Tensor] = {}
    handles = []
    for layer in adapter.attention_layers:  # hybrids: the softmax-attention layers only
        target = twin_modules[names[id(_output_projection(adapter, layer))]]
        handles.append(
            target.register_forward_hook(
                lambda _m, _i, out, layer=layer: outs.__setitem__(
                    layer, (out[0] if isinstance(out, tuple) else out).detach().float()
                )
            )
        )
    try:
        with torch.no_grad():
            hf = twin(
                batch.tokens, attention_mask=mask, position_ids=positions, output_attentions=True
            )
    finally:
        for handle in handles:
            handle.remove()
    compat = bool(getattr(adapter.model, "compatibility_mode", False))
    worst = {"pattern": 0.0, "out": float("nan") if compat else 0.0}
    # hybrids: Hugging Face returns the weights of its attention layers only, in order
    attentions = [a for a in hf.attentions if a is not None]
    if len(attentions) == adapter.n_layers:
        attentions = [attentions[layer] for layer in adapter.attention_layers]
    for index, (layer, la) in enumerate(adapter.attention(batch, sinks=True).items()):
        rows = la.query_valid
        worst["pattern"] = max(
            worst["pattern"],
            _masked_max(la.pattern() - attentions[index].float(), rows[:, None, :, None]),
        )
        if not compat:
            out = la.head_outputs().sum(2) + la.b_O
            worst["out"] = max(worst["out"], _masked_max(out - outs[layer], rows[:, :, None]))
    return worst


def _output_projection(adapter: ModelAdapter, layer: int) -> Any:
    """The Hugging Face output projection of ``layer``: the bridge's ``attn.o`` wraps it; where
    the bridge wraps the attention without hooks (RecurrentGemma, NemotronH) it is the module's
    own ``o_proj``, reached through the same paths."""
    attn = getattr(adapter.model.blocks[layer], "attn", None)
    if attn is not None:  # JetMoE: no o projection, the module's own output
        o_proj = getattr(attn, "o", None)
        return (attn if o_proj is None else o_proj).original_component
    inside = f"model.layers.{layer}."
    found = [
        module
        for name, module in adapter.model.original_model.named_modules()
        if _strip(name).startswith(inside) and _strip(name).endswith(".o_proj")
    ]
    if not found:
        raise TLDynamicsError(f"hf_truth_errors: no output projection found in layer {layer}")
    return found[0]
