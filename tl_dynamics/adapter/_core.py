"""``AdapterCore``: what a model is, read once: host, layer specs, dimensions, the checks of
layer and head indices, hook names, and the cache of what is read from the weights
(``AdapterBase``, ``_base.py``, reads weights and rotations on top of it)."""

from __future__ import annotations

from os import PathLike
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter import _sae, _weights
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._checks import (
    check_attention,
    check_index,
    check_indices,
    check_materialised,
)
from tl_dynamics.adapter._flags import query_scaling_context, warn_host_differences
from tl_dynamics.adapter._host import host_info, hooked_post_norm, layer_specs
from tl_dynamics.adapter._jetmoe import ROUTED_HOOKS, ROUTED_NAMES
from tl_dynamics.adapter._gemma4 import normed_hook
from tl_dynamics.adapter._postrope import POSTROPE_HOOKS
from tl_dynamics.adapter._spec import HostInfo
from tl_dynamics.adapter._unhooked import point_name
from tl_dynamics.errors import TLDynamicsError

# role -> hook name template per host; the only place hook strings are spelled.
_BLOCK_HOOKS = {
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "rot_q": "attn.hook_rot_q",
    "rot_k": "attn.hook_rot_k",
    "cos": "attn.hook_cos",
    "sin": "attn.hook_sin",
    "scores": "attn.hook_attn_scores",
    "pattern": "attn.hook_pattern",
    "z": "attn.hook_z",
    "gate": "attn.hook_q_gate",
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    **POSTROPE_HOOKS,
    **ROUTED_HOOKS,
}  # gate: gate logits (_gate); _postrope; _jetmoe
_HOST_HOOKS = {
    "bridge": {"out": "attn.o.hook_out", "x": "attn.q.hook_in"},
    "hooked": {"out": "hook_attn_out", "x": "ln1.hook_normalized"},
}


def refuse_non_model(model: Any) -> None:
    """A ``TLDynamicsError`` for anything but a TransformerLens model, naming what was given and
    how to load one (``ModelAdapter("induction-2l")`` is refused: ``tl_dynamics.load_model``
    loads by name or folder)."""
    if hasattr(model, "cfg") and hasattr(model, "named_parameters"):
        return
    hint = (
        f"; to load one by name or folder: tl_dynamics.load_model({str(model)!r})"
        if isinstance(model, (str, PathLike))
        else "; load one with tl_dynamics.load_model(name_or_folder)"
    )
    kind = type(model)
    what = (
        kind.__name__
        if kind.__module__ == "builtins" or isinstance(model, PathLike)
        else f"an object of type {kind.__module__}.{kind.__name__}"
    )
    raise TLDynamicsError(
        f"expected a TransformerLens model (HookedTransformer or TransformerBridge) or a "
        f"ModelAdapter, got {what}{hint}"
    )


class AdapterCore:
    """What the model is: host, layer specs, dimensions, index checks and hook names, and the
    weights cache (``AdapterBase`` adds weights and rotations, see ``ModelAdapter``)."""

    def __init__(self, model: Any):
        refuse_non_model(model)  # a name or folder: load it first (the same words as ``of``)
        self.model = model
        check_materialised(model)
        self._info = host_info(model)
        _sae.refuse_attention(model, self._info.host, self._info.architecture)  # SAELens
        self.specs = layer_specs(model, self._info)
        warn_host_differences(model, self._info.host, self._info.family, self._info.architecture)
        self.post_norm: str | None = hooked_post_norm(model) if self.info.host == "hooked" else None
        cfg = model.cfg
        self.n_layers: int = int(cfg.n_layers)
        self.n_heads: int = int(cfg.n_heads)
        self.d_head: int = int(cfg.d_head)
        self.d_model: int = int(cfg.d_model)
        self.n_kv_heads: int = int(getattr(cfg, "n_key_value_heads", None) or self.n_heads)
        # Ministral 3 rescales queries from its original context on: exact below it (_flags)
        self.n_ctx: int = min(int(cfg.n_ctx), query_scaling_context(model) or int(cfg.n_ctx))
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self._cache: dict[tuple, Any] = {}
        self._params: list[Tensor] | None = None  # for weights_version (see _cached)
        self._pass_version: int | None = None  # the weights' version while a pass runs
        self._hooks_seen: tuple[int, int] | None = None  # hook_dict checked for SAEs (_sae)

    @property
    def info(self) -> HostInfo:
        """What the model is; re-read, cached weights dropped, when the bridge's compatibility
        mode (``enable_compatibility_mode`` folds and centres weights in place) was switched on."""
        compat = bool(getattr(self.model, "compatibility_mode", False))
        if self._info.host == "bridge" and compat != self._info.compat:
            self._info = host_info(self.model)
            self.specs = layer_specs(self.model, self._info)
            self._cache.clear()
            self._params = None
        return self._info

    def __repr__(self) -> str:
        return (
            f"ModelAdapter({self.info.architecture}, host={self.info.host} "
            f"TL {self.info.tl_version}, compat={self.info.compat}, layers={self.n_layers}, "
            f"heads={self.n_heads}, kv_heads={self.n_kv_heads})"
        )

    # ----------------------------------------------------------------- validation
    def check_layer(self, layer: int) -> int:
        """``layer`` as an index, or a TLDynamicsError saying what is expected."""
        return check_index(layer, "layer", self.n_layers)

    def check_head(self, head: int, layer: int | None = None) -> int:
        """``head`` as an index, or a TLDynamicsError saying what is expected."""
        return check_index(
            head, "head", self.n_heads, "" if layer is None else f" in layer {layer}"
        )

    def check_layers(self, layers: int | Sequence[int] | None) -> list[int]:
        """None (all layers), one layer index or a non-empty sequence of them."""
        return check_indices(layers, "layer", self.n_layers)

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers with softmax attention the host hooks (every layer but the
        state-space, linear-attention, convolution ... layers of hybrids; none on Mamba)."""
        return [spec.layer for spec in self.specs if spec.is_attention]

    def check_attention_layers(self, layers: int | Sequence[int] | None) -> list[int]:
        """Like ``check_layers`` for attention analyses: None means every attention layer, and a
        layer of another type (or a model with none) is a TLDynamicsError naming it."""
        chosen = self.attention_layers if layers is None else self.check_layers(layers)
        return check_attention(self.specs, chosen, self.info.architecture)

    def check_heads(self, heads: int | Sequence[int] | None) -> list[int]:
        """None (all heads), one head index or a non-empty sequence of them."""
        return check_indices(heads, "head", self.n_heads)

    def _check_padding(self, batch: Batch | None) -> None:
        """Refuse a padded ``batch`` on the hosts whose padding mask is not exact."""
        if batch is not None and batch.padded and self.info.family == "openai_gpt":
            raise TLDynamicsError(
                "padded batch on OpenAIGPTLMHeadModel: TransformerLens's bridge replaces the "
                "causal mask by the padding mask when one is passed, so its queries attend to "
                "later tokens (the Hugging Face model keeps both); pass prompts one at a time"
            )
        if batch is None or not batch.padded or self.info.host != "hooked":
            return
        if any(not spec.causal for spec in self.specs):
            raise TLDynamicsError(
                "padded batch on a bidirectional HookedTransformer: it does not mask padding "
                "keys (its mask is applied only for causal attention), so its patterns include "
                "the pads; pass prompts one at a time, or use a TransformerBridge encoder"
            )

    # ----------------------------------------------------------------- hooks
    def hook_name(self, role: str, layer: int) -> str | None:
        """The model's hook point for ``role`` in ``layer``, or None where it has none."""
        return self.hook_names([(role, layer)])[0]

    def hook_names(self, wanted: Sequence[tuple[str, int]]) -> list[str | None]:
        """``hook_name`` of each ``(role, layer)``, reading the model's hook table once."""
        self._check_spliced()
        hooks, names = self.model.hook_dict, []
        for role, layer in wanted:
            template = _HOST_HOOKS[self.info.host].get(role) or _BLOCK_HOOKS.get(role)
            template = normed_hook(self.specs[layer], role) or template  # Gemma 4: normed q/k/v
            if template is None:
                raise TLDynamicsError(
                    f"unknown hook role {role!r}; valid: "
                    f"{sorted(set(_BLOCK_HOOKS) | set(_HOST_HOOKS['bridge']))}"
                )
            if self.specs[layer].unhooked and not role.startswith("resid"):  # torch hooks
                names.append(point_name(role, layer))  # on the Hugging Face module (_unhooked)
                continue
            name = f"blocks.{layer}.{template}"
            unnormalised = self.post_norm == "post" or name not in hooks
            if role == "x" and self.info.host == "hooked" and unnormalised:
                name = f"blocks.{layer}.hook_resid_pre"  # no input norm: W_Q reads the stream
            if role == "x" and self.specs[layer].latent:  # latent attention: no q projection
                name = f"blocks.{layer}.attn.hook_in"
            if role in ROUTED_NAMES and self.specs[layer].gate == "router":  # no q, o (_jetmoe)
                name = f"blocks.{layer}.{ROUTED_NAMES[role]}"
            name = _sae.spliced_output(hooks, name) or name  # an SAE in the stream: what flows on
            post_normed = role == "out" and self.post_norm is not None  # no head-output sum hook
            names.append(None if post_normed or name not in hooks else name)
        return names

    def _check_spliced(self) -> None:
        """Refuse an SAE spliced inside attention since the adapter was made (SAELens rebuilds
        ``hook_dict`` when it splices: the walk runs again only then)."""
        if self.info.host != "hooked":
            return
        seen = (id(self.model.hook_dict), len(self.model.hook_dict))
        if seen != self._hooks_seen:
            _sae.refuse_attention(self.model, self.info.host, self.info.architecture)
            self._hooks_seen = seen

    def named_hooks(self, entries: Sequence[tuple[str, int, Any]]) -> list[tuple[str, Any]]:
        """``(role, layer, fn)`` entries as ``(hook name, fn)``; every role must exist, checked
        before any hook is attached."""
        names = self.hook_names([(role, self.check_layer(layer)) for role, layer, _ in entries])
        for (role, layer, _), name in zip(entries, names):
            if name is None:
                raise TLDynamicsError(
                    f"this {self.info.architecture} model has no {role!r} hook in layer {layer}"
                )
        return [(str(name), fn) for name, (_, _, fn) in zip(names, entries)]

    # ----------------------------------------------------------------- cache
    def _weights_version(self) -> int:
        if self._params is None:  # listed once: walking a bridge's module tree is slow
            self._params = list(self.model.parameters())
        return _weights.weights_version(self._params)

    def pass_weights(self, open_: bool) -> None:
        """A forward pass opens (``open_``) or closes: while it runs, cached weights are read
        against the version taken at its start (the hub's passes; weights are not edited inside
        a forward)."""
        self._pass_version = self._weights_version() if open_ else None

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, an analysis's value derived from the weights alone, computed once under
        ``key`` and again only after the weights change (edited in place, or the bridge's
        compatibility mode switched). The report's sections share the weights-only head scores
        this way instead of computing them once per section.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> ad = ModelAdapter(testing.cached_model("gpt2"))
            >>> calls = []
            >>> first = ad.memo(("norm of W_E",), lambda: calls.append(1) or float(ad.W_E.norm()))
            >>> ad.memo(("norm of W_E",), lambda: calls.append(1) or 0.0) == first, len(calls)
            (True, 1)
        """
        return self._cached(("memo", *key), compute)

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, read once under ``key`` and read again only when the weights changed
        (edited in place, or the bridge's compatibility mode switched)."""
        self.info  # noqa: B018 (drops the cache when the compatibility mode changed)
        version = self._pass_version
        if version is None:
            version = self._weights_version()
        if version != self._cache.get(("weights_version",)):  # weights edited in place: re-read
            self._cache.clear()
            self._cache[("weights_version",)] = version
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]
