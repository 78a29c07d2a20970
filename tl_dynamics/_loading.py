"""The commands' model: checked by name first (no torch), then loaded, then checked against what
the command was asked (layers, heads, token ids, the prompt's length) before any analysis."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

from tl_dynamics import _args, _model_names, devices
from tl_dynamics.errors import TLDynamicsError, UnknownTokenWarning


def check_model(name: str | None) -> str:
    """``--model`` as far as it can be checked without loading (``tl_dynamics.models`` rules),
    a hub name that cannot load here (offline, not cached) refused at once; returns the name."""
    name = _model_names.check_name(name)
    if _model_names.is_hub_name(name):
        _model_names.check_hub(name)
    return name


def loaded_and_checked(
    name: str,
    where: tuple[str, str],
    prompt: Any = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
    head_indices: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
    default_prompt: bool = True,
) -> tuple[Any, Any, Any]:
    """Import torch and TransformerLens, load ``name`` on ``where`` (``--device``, ``--dtype``),
    then check what needs the model before any analysis: ``layers``, ``heads`` (``(layer,
    head)`` pairs), ``head_indices`` (in every layer), token ids and the prompt's length (the
    model's context). Returns the loaded model, its adapter and the prompt to use (the model's
    default where ``prompt`` is None and ``default_prompt``)."""
    from tl_dynamics import models
    from tl_dynamics.adapter import ModelAdapter

    placement = devices.placement(*where, cli=True)
    if progress:
        progress(f"loading {name} ...")
    loaded = models.resolve(name, placement)
    if prompt is None and default_prompt:
        prompt = loaded.default_prompt
    if isinstance(prompt, (str, tuple)) and not loaded.has_tokenizer:
        raise TLDynamicsError(
            f"{loaded.label} has no tokenizer: give the prompt as token ids, "
            'e.g. --prompt-ids "300 5 17"'
        )
    adapter = ModelAdapter.of(loaded.model)
    if isinstance(prompt, list):
        _args.check_vocab(prompt, int(loaded.model.cfg.d_vocab))
    for layer, head in heads or ():
        adapter.check_layer(layer)
        adapter.check_head(head, layer=layer)
    for head in head_indices or ():
        adapter.check_head(head)
    if layers is not None:
        adapter.check_layers(list(layers))
    if isinstance(prompt, (str, tuple)):  # lengths against the context (unknown tokens: later)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownTokenWarning)
            adapter.tokenize(prompt if isinstance(prompt, str) else list(prompt))
    elif isinstance(prompt, list) and len(prompt) > adapter.n_ctx:
        raise TLDynamicsError(
            f"--prompt-ids has {len(prompt)} tokens but this model's context is "
            f"{adapter.n_ctx} tokens (valid: 1..{adapter.n_ctx})"
        )
    return loaded, adapter, prompt
