"""A TransformerLens checkpoint folder (``tl_config.json`` or ``config.json`` with
``HookedTransformerConfig`` fields, weights in ``model.safetensors``): every field of its config is
kept, or refused by name before anything is built.

- TransformerLens 3.x builds ``HookedTransformer`` from every ``HookedTransformerConfig`` field
  (it honours its own config); a field that is not one of them is refused unless it holds the
  default of the ``TransformerBridgeConfig`` field of that name.
- TransformerLens 4.x builds ``TransformerBridge.boot_native``, whose model implements
  ``NATIVE``: those fields are kept (``attention_dir``, rotary width and base, ``d_vocab_out``,
  the attention scale, the soft-caps, grouped keys, ...). GPT-NeoX-style rotary
  (``rotary_adjacent_pairs`` false) is kept by permuting each head's query and key dimensions
  into the native model's adjacent pairs (the scores are unchanged), once the weights' own
  rotary tables are checked against the config. Every other field that changes the forward
  pass is refused by name where it is not at its default: local windows, parallel blocks,
  ``scale_attn_by_inverse_layer_idx``, unscaled attention, q/k norms, shortformer or ALiBi
  positions, NTK and YaRN rotary, attention sinks, experts, ...
- ``INERT`` fields change no number of the forward pass (names, provenance, initialisation,
  hook switches, tokenizer flags); ``dtype`` and ``device`` are ``load_model``'s to set.

tests/test_tl_checkpoint.py round-trips each forward-changing field against TransformerLens 3.x's
own ``HookedTransformer`` on the same config and weights (scripts/tl_config_cases.py), to 1e-5.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path
from typing import Any

from tl_dynamics import compat
from tl_dynamics.errors import TLDynamicsError

PLACEMENT = ("dtype", "device")  # load_model(device=, dtype=) sets these
INERT = frozenset(
    "model_name original_architecture from_checkpoint checkpoint_index checkpoint_label_type "
    "checkpoint_value tokenizer_name init_mode initializer_range init_weights seed n_params "
    "trust_remote_code attn_implementation use_hook_tokens use_attn_result use_split_qkv_input "
    "use_hook_mlp_in use_attn_in default_prepend_bos tokenizer_prepends_bos tokenizer_appends_eos "
    "default_padding_side layer_norm_folding uses_rms_norm tie_word_embeddings "
    "decoder_start_token_id".split()
)
# what TransformerLens 4.x's native model (boot_native) implements, with the values it takes
NATIVE = frozenset(
    "d_model d_head n_layers n_ctx n_heads d_mlp d_vocab d_vocab_out act_fn eps normalization_type "
    "final_rms attn_only gated_mlp n_key_value_heads positional_embedding_type rotary_dim "
    "rotary_base rotary_adjacent_pairs attention_dir use_attn_scale attn_scale "
    "attn_scores_soft_cap output_logits_soft_cap".split()
)
NATIVE_VALUES: dict[str, tuple[Any, ...]] = {
    "positional_embedding_type": ("standard", "rotary"),
    "normalization_type": ("LN", "LNPre", "RMS", "RMSPre", None),
    "act_fn": ("gelu", "gelu_new", "relu", "silu", "solu_ln", None),
    "attention_dir": ("causal", "bidirectional"),
    "use_attn_scale": (True,),
}
# HookedTransformerConfig (3.9) fields TransformerBridgeConfig (4.x) has not, with their defaults
HOOKED_ONLY: dict[str, Any] = dict(
    clip_qkv=None,
    use_logn_attn=False,
    train_seq_length=None,
    use_dynamic_ntk_rope=False,
    ungroup_grouped_query_attention=False,
    rotary_base_local=None,
    rotary_scaling_factor=1.0,
    quantization_method=None,
    NTK_original_ctx_len=8192,
    use_yarn_rope=False,
    yarn_factor=1.0,
    yarn_attention_factor=1.0,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_original_max_position_embeddings=4096,
    yarn_truncate=True,
    yarn_global_attn_only=False,
    use_attention_sinks=False,
    norm_topk_prob=False,
)


def _defaults(cls: Any) -> dict[str, Any]:
    """A config class's fields with their defaults (``inspect.Parameter.empty`` if required)."""
    out = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            out[f.name] = (
                f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
            )
    init: Any = cls  # a class: its signature is its __init__'s
    for name, p in inspect.signature(init).parameters.items():  # subclasses add __init__ params
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            out[name] = p.default
    return out


def _same(value: Any, default: Any) -> bool:
    if (
        isinstance(value, float)
        and isinstance(default, (int, float))
        and not isinstance(default, bool)
    ):
        return math.isclose(value, default, rel_tol=0.0, abs_tol=1e-12)
    return value == default


def check_fields(fields: dict[str, Any], hooked: bool) -> dict[str, Any]:
    """The config to build from ``fields`` on this host (``hooked``: TransformerLens 3.x's
    ``HookedTransformer``, else 4.x's ``boot_native``), or ``TLDynamicsError`` naming every field
    it cannot honour and why.

    Args:
        fields: the checkpoint's config (``tl_config.json``).
        hooked: whether the model is built as a ``HookedTransformer``.

    Returns:
        The fields to pass to the host's config class (placement fields removed).

    Example:
        >>> check_fields({"d_model": 8, "d_head": 4, "n_layers": 1, "n_ctx": 8,
        ...               "attention_dir": "bidirectional", "dtype": "float32"}, hooked=False)
        {'d_model': 8, 'd_head': 4, 'n_layers': 1, 'n_ctx': 8, 'attention_dir': 'bidirectional'}
        >>> check_fields({"d_model": 8, "d_head": 4, "n_layers": 1, "n_ctx": 8,
        ...               "parallel_attn_mlp": True}, hooked=False)
        Traceback (most recent call last):
        tl_dynamics.errors.TLDynamicsError: ... parallel_attn_mlp=True (...)
    """
    from transformer_lens.config import TransformerBridgeConfig

    bridge = _defaults(TransformerBridgeConfig)
    own = _defaults(_hooked_config()) if hooked else bridge
    known = own.keys() | bridge.keys() | HOOKED_ONLY.keys() | set(PLACEMENT)
    kept, refused = {}, []
    for name, value in fields.items():
        if name in PLACEMENT:
            continue
        if name not in known:
            refused.append(f"{name} (not a TransformerLens config field)")
        elif name == "n_devices" and value != 1:
            refused.append(f"n_devices={value!r} (tl_dynamics places a model on one device)")
        elif hooked and name in own:
            kept[name] = value
        elif hooked:  # a 4.x field on 3.x: only its default means nothing to lose
            if not _same(value, bridge.get(name, HOOKED_ONLY.get(name))):
                refused.append(f"{name}={value!r} (not a HookedTransformerConfig field)")
        elif name in NATIVE or name in INERT:
            why = _native_value(name, value, fields)
            if why:
                refused.append(f"{name}={value!r} ({why})")
            elif name in own:
                kept[name] = value
        elif name == "architecture":
            if value not in (None, "TransformerLensNative"):
                refused.append(f"architecture={value!r} (a checkpoint builds the native model)")
        elif not _same(value, own.get(name, HOOKED_ONLY.get(name))):
            refused.append(
                f"{name}={value!r} (TransformerLens 4.x's native model does not implement it)"
            )
    if refused:
        host = "TransformerLens 3.x's HookedTransformer" if hooked else "TransformerLens 4.x"
        raise TLDynamicsError(
            f"this checkpoint's config has fields {host} cannot honour, so it is not loaded "
            f"rather than loaded as another model: {'; '.join(refused)}"
        )
    return kept


def _native_value(name: str, value: Any, fields: dict[str, Any]) -> str:
    """Why the native model cannot take ``value`` for ``name`` ("" where it can)."""
    if name in NATIVE_VALUES and value not in NATIVE_VALUES[name]:
        if name == "use_attn_scale":
            return "the native model always scales attention scores"
        return f"the native model takes {list(NATIVE_VALUES[name])}"
    if name == "rotary_base" and float(value) != int(value):
        return "TransformerLens 4.x keeps an integer rotary base"
    if name == "attn_scale" and fields.get("d_head", 1) > 1 and math.isclose(value, 1.0):
        return "the native model refuses unscaled attention"
    return ""


def _hooked_config() -> Any:
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig


def check_rotary(state: dict[str, Any], fields: dict[str, Any]) -> None:
    """Refuse weights whose stored rotary tables are not the ones the config gives (a
    ``HookedTransformer`` would run with the stored tables while its config says otherwise).

    Args:
        state: the checkpoint's state dict (``HookedTransformer`` keys).
        fields: its config.

    Returns:
        None; raises ``TLDynamicsError`` naming the table and the fields.

    Example:
        >>> import torch
        >>> fields = {"positional_embedding_type": "rotary", "rotary_dim": 2, "rotary_base": 100}
        >>> check_rotary({"blocks.0.attn.rotary_cos": torch.ones(4, 2)}, fields)
        Traceback (most recent call last):
        tl_dynamics.errors.TLDynamicsError: blocks.0.attn.rotary_cos in the weights is not ...
    """
    import torch

    rd = int(fields.get("rotary_dim") or fields.get("d_head", 0))
    adjacent = bool(fields.get("rotary_adjacent_pairs", False))
    for key in [k for k in state if k.endswith((".rotary_sin", ".rotary_cos"))]:
        want = _rotary_table(key.endswith("sin"), state[key].shape[0], rd, fields, adjacent)
        if want.shape != state[key].shape or not torch.allclose(
            state[key].float(), want, atol=1e-5
        ):
            raise TLDynamicsError(
                f"{key} in the weights is not the rotary table rotary_dim={rd} and "
                f"rotary_base={fields.get('rotary_base', 10000)} give: the config does not "
                "describe these weights"
            )


def native_state(state: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``HookedTransformer`` weights made ready for the native model: the (checked) rotary
    tables dropped, as the native model computes its own, GPT-NeoX-style rotary permuted into
    adjacent pairs, a gated MLP's zero biases dropped (it has none).

    Args:
        state: the checkpoint's state dict (``HookedTransformer`` keys).
        fields: its config.

    Returns:
        The state dict ``convert_tl_checkpoint`` takes for the native model.

    Example:
        >>> import torch
        >>> w = torch.arange(16.0).reshape(1, 4, 4)  # one head, d_model 4, d_head 4
        >>> out = native_state({"blocks.0.attn.W_Q": w}, {"positional_embedding_type": "rotary",
        ...                     "rotary_dim": 4, "d_head": 4})
        >>> out["blocks.0.attn.W_Q"][0, 0].tolist()  # dimensions (0, 2) and (1, 3) now adjacent
        [0.0, 2.0, 1.0, 3.0]
    """
    out = {k: v for k, v in state.items() if not k.endswith((".rotary_sin", ".rotary_cos"))}
    if fields.get("positional_embedding_type") == "rotary" and not fields.get(
        "rotary_adjacent_pairs", False
    ):
        rd = int(fields.get("rotary_dim") or fields["d_head"])
        perm = [i for pair in zip(range(rd // 2), range(rd // 2, rd)) for i in pair]
        perm += list(range(rd, int(fields["d_head"])))
        for key in list(out):
            if key.endswith((".W_Q", ".W_K", "._W_K", ".b_Q", ".b_K", "._b_K")):
                out[key] = out[key][..., perm].contiguous()
    if fields.get("gated_mlp"):
        for key in [k for k in out if k.endswith((".mlp.b_in", ".mlp.b_out"))]:
            if bool(out[key].any()):
                raise TLDynamicsError(
                    f"gated_mlp=True with a nonzero {key}: TransformerLens 4.x's native gated "
                    "MLP has no biases"
                )
            del out[key]
    return out


def _rotary_table(sin: bool, n: int, rd: int, fields: dict[str, Any], adjacent: bool) -> Any:
    """``HookedTransformer``'s rotary table (its formula, float32): ``n`` positions."""
    import torch

    base = float(fields.get("rotary_base", 10000))
    freq = base ** (torch.arange(rd // 2, dtype=torch.float32) / (rd / 2))
    freq = freq.repeat_interleave(2) if adjacent else torch.cat([freq, freq])
    angles = torch.arange(n, dtype=torch.float32)[:, None] / freq[None, :]
    return torch.sin(angles) if sin else torch.cos(angles)


def build(folder: Path, config: Path, fields: dict[str, Any], state: dict, tokenizer: Any) -> Any:
    """The model of a checkpoint folder, on this host (``models.load_model`` checks the folder).

    Args:
        folder: the checkpoint folder.
        config: its config file (for messages).
        fields: the config's fields.
        state: the weights (``HookedTransformer`` keys).
        tokenizer: its tokenizer, or None.

    Returns:
        A ``HookedTransformer`` (TransformerLens 3.x) or ``TransformerBridge`` (4.x), in eval mode.

    Example:
        >>> from pathlib import Path
        >>> build(Path("x"), Path("x/tl_config.json"), {"d_model": 8, "frobnicate": 1}, {}, None)
        Traceback (most recent call last):
        tl_dynamics.errors.TLDynamicsError: ... frobnicate (not a TransformerLens config field)
    """
    hooked = compat.has_hooked_transformer()
    kept = check_fields(fields, hooked)
    check_rotary(state, fields)
    try:
        if hooked:
            from transformer_lens import HookedTransformer

            cfg = _hooked_config()(**kept)  # built in float32, then cast
            # TransformerLens 3.x's class; pyright sees 4.x, where the name is the bridge
            model = HookedTransformer(cfg, tokenizer=tokenizer)  # pyright: ignore[reportCallIssue]
            missing, unexpected = model.load_state_dict(state, strict=False)
        else:
            model, missing, unexpected = _boot_native(
                folder, kept, native_state(state, fields), tokenizer
            )
    except TLDynamicsError:
        raise
    except Exception as err:  # bad fields or shapes
        raise TLDynamicsError(
            f"TransformerLens checkpoint {folder}: {config.name} and model.safetensors "
            f"do not make a model: {type(err).__name__}: {err}"
        ) from err
    if unexpected or [k for k in missing if not k.endswith((".mask", ".IGNORE"))]:
        raise TLDynamicsError(
            f"TransformerLens checkpoint {folder}: model.safetensors does not match "
            f"{config.name}: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    lost = _lost(model.cfg, kept, hooked)
    if lost:  # the host changed a field on the way: say so rather than run another model
        raise TLDynamicsError(
            f"TransformerLens checkpoint {folder}: the built model does not keep "
            + ", ".join(f"{k}={kept[k]!r} (it has {getattr(model.cfg, k)!r})" for k in lost)
        )
    return model.eval()


def _lost(cfg: Any, kept: dict[str, Any], hooked: bool) -> list[str]:
    """The forward-changing fields the built model holds at another value than the config gave
    (a sentinel, such as ``attn_scale=-1`` or ``d_mlp=None``, is the host's to resolve)."""
    from transformer_lens.config import TransformerBridgeConfig

    defaults = _defaults(_hooked_config() if hooked else TransformerBridgeConfig)
    skip = {"d_mlp"} if kept.get("attn_only") else set()
    return [
        k
        for k, v in kept.items()
        if k in NATIVE
        and k not in skip
        and not _same(v, defaults.get(k))
        and not _same(getattr(cfg, k, v), v)
    ]


def _boot_native(folder: Path, kept: dict[str, Any], state: dict, tokenizer: Any) -> tuple:
    """TransformerLens 4.x: ``boot_native`` and TransformerLens's own checkpoint converter."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint

    fields = {k: v for k, v in kept.items() if k not in ("architecture", "init_weights")}
    cfg = TransformerBridgeConfig(
        architecture="TransformerLensNative", init_weights=False, **fields
    )
    model = compat.bridge_class().boot_native(
        cfg, tokenizer=tokenizer, model_name=kept.get("model_name", folder.name)
    )
    converted = convert_tl_checkpoint(state, model.cfg)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    return model, list(missing), list(unexpected)
