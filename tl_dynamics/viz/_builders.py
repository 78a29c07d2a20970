"""Builders mirroring circuitsvis's Python API, with token strings escaped.

circuitsvis inserts token strings as raw HTML in ColoredTokens, ColoredTokensMulti, TopkTokens
and TextNeuronActivations, so those builders escape them. Labels and dimension names are React
text there (escaping them would show ``&lt;``), so they pass as they are. AttentionHeads and AttentionPattern
(and ``heatmap``, ``attention_grid``) are drawn by the page's own runtime on canvases, with
labels set as text, never parsed as HTML: escaping there would display ``&lt;BOS&gt;``, so their
tokens are passed as they are (checked in the browser tests: hostile tokens neither execute nor
break the page, and read as written). Every token label shows whitespace (``visible_token``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz._component import Component, escape_tokens, visible_token


def _array(values: Any, ndim: int, what: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().float().numpy()
    arr = np.asarray(values, dtype=np.float32)
    if arr.ndim != ndim:
        raise TLDynamicsError(f"{what} must have {ndim} dimensions, got shape {arr.shape}")
    return arr


def _check_tokens(tokens: Sequence[str], n: int, what: str) -> None:
    if len(tokens) != n:
        raise TLDynamicsError(f"{what}: {len(tokens)} tokens but the values cover {n} positions")


def attention_heads(
    attention: Any,
    tokens: Sequence[str],
    head_names: Sequence[str] | None = None,
    max_value: float | None = None,
    min_value: float | None = None,
    mask_upper_tri: bool | None = None,
    caption: str = "",
) -> Component:
    """Grid of attention patterns, one per head, with a zoomed view (circuitsvis AttentionHeads).

    Args:
        attention: The patterns, ``[head, dest, src]`` (a tensor or array).
        tokens: One label per position (``src``), shown as written (``visible_token``).
        head_names: One name per head (default: circuitsvis's "Head 0", ...).
        max_value: Upper end of the colour scale (default: circuitsvis's).
        min_value: Lower end of the colour scale.
        mask_upper_tri: Grey out the future keys (default: circuitsvis's choice).
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"AttentionHeads"``.

    Example:
        >>> import torch
        >>> view = attention_heads(torch.ones(2, 3, 3) / 3, ["a", "b", "c"], ["L0H0", "L0H1"])
        >>> view.name, view.props["attentionHeadNames"]
        ('AttentionHeads', ['L0H0', 'L0H1'])
    """
    arr = _array(attention, 3, "attention")
    _check_tokens(tokens, arr.shape[-1], "attention_heads")
    names = None if head_names is None else [str(n) for n in head_names]
    if names is not None and len(names) != arr.shape[0]:
        raise TLDynamicsError(f"{len(names)} head names for {arr.shape[0]} heads")
    return Component(
        "AttentionHeads",
        dict(
            attention=arr,
            tokens=[visible_token(t) for t in tokens],
            attentionHeadNames=names,
            maxValue=max_value,
            minValue=min_value,
            maskUpperTri=mask_upper_tri,
        ),
        caption=caption,
    )


def attention_pattern(
    tokens: Sequence[str], attention: Any, caption: str = "", **options: Any
) -> Component:
    """One head's attention pattern (circuitsvis AttentionPattern).

    Args:
        tokens: One label per position.
        attention: The pattern, ``[dest, src]``.
        caption: Text under the view.
        **options: Further AttentionPattern props in snake case (``max_value`` -> ``maxValue``).

    Returns:
        A ``Component`` named ``"AttentionPattern"``.

    Example:
        >>> view = attention_pattern(["a", "b"], [[1.0, 0.0], [0.5, 0.5]], max_value=1.0)
        >>> view.name, view.props["maxValue"]
        ('AttentionPattern', 1.0)
    """
    arr = _array(attention, 2, "attention")
    _check_tokens(tokens, arr.shape[-1], "attention_pattern")
    return Component(
        "AttentionPattern",
        dict(tokens=[visible_token(t) for t in tokens], attention=arr, **_camel(options)),
        caption=caption,
    )


def colored_tokens(
    tokens: Sequence[str],
    values: Any,
    min_value: float | None = None,
    max_value: float | None = None,
    caption: str = "",
    **options: Any,
) -> Component:
    """Tokens coloured by one value each (circuitsvis ColoredTokens); token strings are escaped.

    Args:
        tokens: The token strings, ``[pos]``.
        values: One value per token, ``[pos]``.
        min_value: Value of the scale's lower end (default: the smallest value).
        max_value: Value of the scale's upper end (default: the largest value).
        caption: Text under the view.
        **options: Further ColoredTokens props in snake case.

    Returns:
        A ``Component`` named ``"ColoredTokens"``.

    Example:
        >>> colored_tokens(["<b>", " x"], [0.0, 1.0]).props["tokens"]
        ['&lt;b&gt;', ' x']
    """
    arr = _array(values, 1, "values")
    _check_tokens(tokens, arr.shape[0], "colored_tokens")
    return Component(
        "ColoredTokens",
        dict(
            tokens=escape_tokens(tokens),
            values=arr,
            minValue=min_value,
            maxValue=max_value,
            **_camel(options),
        ),
        caption=caption,
    )


def colored_tokens_multi(
    tokens: Sequence[str], values: Any, labels: Sequence[str] | None = None, caption: str = ""
) -> Component:
    """Tokens with several values each, one selectable at a time (circuitsvis ColoredTokensMulti).

    Args:
        tokens: The token strings, ``[pos]``.
        values: The values, ``[pos, K]``.
        labels: One name per value column (``K`` of them).
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"ColoredTokensMulti"``.

    Example:
        >>> colored_tokens_multi(["a", "b"], [[0, 1], [1, 0]], labels=["x", "y"]).props["labels"]
        ['x', 'y']
    """
    arr = _array(values, 2, "values")
    _check_tokens(tokens, arr.shape[0], "colored_tokens_multi")
    return Component(
        "ColoredTokensMulti",
        dict(
            tokens=escape_tokens(tokens),
            values=arr,
            labels=None if labels is None else [str(x) for x in labels],
        ),
        caption=caption,
    )


def text_neuron_activations(
    tokens: Sequence[str],
    activations: Any,
    first_dimension_name: str = "Layer",
    second_dimension_name: str = "Neuron",
    first_dimension_labels: Sequence[str] | None = None,
    second_dimension_labels: Sequence[str] | None = None,
    caption: str = "",
) -> Component:
    """Per-token activations over two dimensions, e.g. layer x neuron (TextNeuronActivations).

    Args:
        tokens: The token strings, ``[pos]``.
        activations: The activations, ``[pos, first_dim, second_dim]``.
        first_dimension_name: Name of the first dimension.
        second_dimension_name: Name of the second dimension.
        first_dimension_labels: One label per entry of the first dimension.
        second_dimension_labels: One label per entry of the second dimension.
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"TextNeuronActivations"``.

    Example:
        >>> import numpy as np
        >>> text_neuron_activations(["a", "b"], np.zeros((2, 1, 3))).name
        'TextNeuronActivations'
    """
    arr = _array(activations, 3, "activations")
    _check_tokens(tokens, arr.shape[0], "text_neuron_activations")

    def as_labels(xs: Sequence | None) -> list[str] | None:
        return None if xs is None else [str(x) for x in xs]

    return Component(
        "TextNeuronActivations",
        dict(
            tokens=escape_tokens(tokens),
            activations=arr,
            firstDimensionName=str(first_dimension_name),
            secondDimensionName=str(second_dimension_name),
            firstDimensionLabels=as_labels(first_dimension_labels),
            secondDimensionLabels=as_labels(second_dimension_labels),
        ),
        caption=caption,
    )


def topk_tokens(
    tokens: Sequence[Sequence[str]],
    activations: Sequence[Any],
    max_k: int = 7,
    first_dimension_name: str = "Layer",
    third_dimension_name: str = "Neuron",
    sample_labels: Sequence[str] | None = None,
    caption: str = "",
) -> Component:
    """The top-k and bottom-k tokens of each neuron, per sample (circuitsvis TopkTokens).

    Args:
        tokens: One list of token strings per sample.
        activations: One array per sample, ``[layers, pos, neurons]``.
        max_k: How many tokens to show at each end (at most the sample's length).
        first_dimension_name: Name of the first dimension.
        third_dimension_name: Name of the third dimension.
        sample_labels: One label per sample.
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"TopkTokens"``.

    Example:
        >>> import numpy as np
        >>> view = topk_tokens([["a", "b", "c"]], [np.arange(6.0).reshape(1, 3, 2)], max_k=2)
        >>> view.props["topkIdxs"][0][0].tolist()
        [[2, 2], [1, 1]]
    """
    if len(tokens) != len(activations):
        raise TLDynamicsError(f"{len(tokens)} token lists for {len(activations)} samples")
    top_v, top_i, bot_v, bot_i = [], [], [], []
    for toks, act in zip(tokens, activations):
        arr = _array(act, 3, "activations[sample]")
        _check_tokens(toks, arr.shape[1], "topk_tokens")
        k = min(arr.shape[1], max_k)
        order = np.argsort(-arr, axis=1, kind="stable")
        top = order[:, :k]
        bottom = order[:, ::-1][:, :k]
        top_v.append(np.take_along_axis(arr, top, 1))
        top_i.append(top)
        bot_v.append(np.take_along_axis(arr, bottom, 1))
        bot_i.append(bottom)
    return Component(
        "TopkTokens",
        dict(
            tokens=[escape_tokens(t) for t in tokens],
            topkVals=top_v,
            topkIdxs=top_i,
            bottomkVals=bot_v,
            bottomkIdxs=bot_i,
            firstDimensionName=str(first_dimension_name),
            thirdDimensionName=str(third_dimension_name),
            sampleLabels=None if sample_labels is None else [str(s) for s in sample_labels],
        ),
        caption=caption,
    )


def _camel(options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in options.items():
        head, *rest = key.split("_")
        out[head + "".join(word.title() for word in rest)] = value
    return out
