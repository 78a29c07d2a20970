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

import base64
import io
import re
from typing import Any, Sequence

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz._component import Component, escape_tokens, html_escape, visible_token


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


def attention_heads(attention: Any, tokens: Sequence[str], head_names: Sequence[str] | None = None,
                    max_value: float | None = None, min_value: float | None = None,
                    mask_upper_tri: bool | None = None, caption: str = "") -> Component:
    """Grid of attention patterns ``[head, dest, src]`` with a zoomed view (AttentionHeads)."""
    arr = _array(attention, 3, "attention")
    _check_tokens(tokens, arr.shape[-1], "attention_heads")
    names = None if head_names is None else [str(n) for n in head_names]
    if names is not None and len(names) != arr.shape[0]:
        raise TLDynamicsError(f"{len(names)} head names for {arr.shape[0]} heads")
    return Component("AttentionHeads", dict(
        attention=arr, tokens=[visible_token(t) for t in tokens], attentionHeadNames=names,
        maxValue=max_value, minValue=min_value, maskUpperTri=mask_upper_tri), caption=caption)


def attention_pattern(tokens: Sequence[str], attention: Any, caption: str = "",
                      **options: Any) -> Component:
    """One ``[dest, src]`` pattern (AttentionPattern)."""
    arr = _array(attention, 2, "attention")
    _check_tokens(tokens, arr.shape[-1], "attention_pattern")
    return Component("AttentionPattern", dict(tokens=[visible_token(t) for t in tokens], attention=arr,
                                              **_camel(options)), caption=caption)


def colored_tokens(tokens: Sequence[str], values: Any, min_value: float | None = None,
                   max_value: float | None = None, caption: str = "", **options: Any) -> Component:
    """Tokens coloured by one value each (ColoredTokens)."""
    arr = _array(values, 1, "values")
    _check_tokens(tokens, arr.shape[0], "colored_tokens")
    return Component("ColoredTokens", dict(tokens=escape_tokens(tokens), values=arr,
                                           minValue=min_value, maxValue=max_value,
                                           **_camel(options)), caption=caption)


def colored_tokens_multi(tokens: Sequence[str], values: Any, labels: Sequence[str] | None = None,
                         caption: str = "") -> Component:
    """Tokens with several values each ``[tokens, K]``, selectable (ColoredTokensMulti)."""
    arr = _array(values, 2, "values")
    _check_tokens(tokens, arr.shape[0], "colored_tokens_multi")
    return Component("ColoredTokensMulti", dict(
        tokens=escape_tokens(tokens), values=arr,
        labels=None if labels is None else [str(x) for x in labels]), caption=caption)


def text_neuron_activations(tokens: Sequence[str], activations: Any,
                            first_dimension_name: str = "Layer",
                            second_dimension_name: str = "Neuron",
                            first_dimension_labels: Sequence[str] | None = None,
                            second_dimension_labels: Sequence[str] | None = None,
                            caption: str = "") -> Component:
    """Per-token activations ``[tokens, first_dim, second_dim]`` (TextNeuronActivations)."""
    arr = _array(activations, 3, "activations")
    _check_tokens(tokens, arr.shape[0], "text_neuron_activations")

    def as_labels(xs: Sequence | None) -> list[str] | None:
        return None if xs is None else [str(x) for x in xs]

    return Component("TextNeuronActivations", dict(
        tokens=escape_tokens(tokens), activations=arr,
        firstDimensionName=str(first_dimension_name),
        secondDimensionName=str(second_dimension_name),
        firstDimensionLabels=as_labels(first_dimension_labels),
        secondDimensionLabels=as_labels(second_dimension_labels)), caption=caption)


def topk_tokens(tokens: Sequence[Sequence[str]], activations: Sequence[Any], max_k: int = 7,
                first_dimension_name: str = "Layer", third_dimension_name: str = "Neuron",
                sample_labels: Sequence[str] | None = None, caption: str = "") -> Component:
    """Top-k and bottom-k tokens per neuron; ``activations[s]`` is ``[layers, tokens, neurons]``."""
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
    return Component("TopkTokens", dict(
        tokens=[escape_tokens(t) for t in tokens], topkVals=top_v, topkIdxs=top_i,
        bottomkVals=bot_v, bottomkIdxs=bot_i,
        firstDimensionName=str(first_dimension_name),
        thirdDimensionName=str(third_dimension_name),
        sampleLabels=None if sample_labels is None else [str(s) for s in sample_labels]),
        caption=caption)


def figure(fig: Any, caption: str = "", close: bool = True) -> Component:
    """A matplotlib figure as an inline PNG (no network, no script)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    if close:
        import matplotlib.pyplot as plt

        plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return Component(html=f'<img class="tld-figure" alt="{html_escape(caption or "figure")}" '
                          f'src="data:image/png;base64,{data}">', caption=caption, kind="figure")


def heatmap(values: Any, row_labels: Sequence[str] | None = None,
            col_labels: Sequence[str] | None = None, title: str = "", row_title: str = "row",
            col_title: str = "column", value_name: str = "value", min_value: float | None = None,
            max_value: float | None = None, cmap: str | None = None,
            mask_upper_tri: bool = False, cell_px: int = 16, caption: str = "") -> Component:
    """A ``[rows, cols]`` map drawn on a canvas with a colour legend and hover read-out (e.g. a
    statistic over layer x head). Signed values get a diverging map centred on 0; ``cmap`` may
    be ``"blues"``, ``"viridis"`` or ``"rdbu"``. NaN cells are grey ("not defined"). Cells are
    ``cell_px`` pixels wide at most (smaller when the map would not fit).

    Example:
        >>> heatmap([[0.1, 0.9], [0.5, float("nan")]], ["L0", "L1"], ["H0", "H1"]).name
        'Heatmap'
    """
    arr = _array(values, 2, "values")
    for labels, n, what in ((row_labels, arr.shape[0], "row"), (col_labels, arr.shape[1], "column")):
        if labels is not None and len(labels) != n:
            raise TLDynamicsError(f"heatmap: {len(labels)} {what} labels for {n} {what}s")
    if cmap not in (None, "blues", "viridis", "rdbu"):
        raise TLDynamicsError(f"heatmap: cmap {cmap!r}; valid: 'blues', 'viridis', 'rdbu'")

    def as_labels(xs: Sequence | None) -> list[str] | None:
        return None if xs is None else [visible_token(x) for x in xs]

    return Component("Heatmap", dict(
        values=arr, rowLabels=as_labels(row_labels), colLabels=as_labels(col_labels), title=str(title),
        rowTitle=str(row_title), colTitle=str(col_title), valueName=str(value_name),
        minValue=min_value, maxValue=max_value, cmap=cmap, mask=bool(mask_upper_tri),
        cell=int(cell_px)),
        caption=caption)


def attention_grid(thumbs: Any, full: dict[int, Any], tokens: Sequence[str],
                   head_names: Sequence[str], columns: int, row_names: Sequence[str] | None = None,
                   selected: int = 0, mask_upper_tri: bool = False, caption: str = "") -> Component:
    """Many heads at once: a thumbnail ``thumbs[i]`` per head (already downsampled) in a grid of
    ``columns`` per row, and the full ``[pos, pos]`` pattern for the heads in ``full`` (index into
    ``thumbs``), shown large when clicked. Built by the report for all heads of a model.

    Example:
        >>> import numpy as np
        >>> grid = attention_grid(np.ones((2, 3, 3)) / 3, {0: np.ones((3, 3)) / 3}, ["a", "b", "c"],
        ...                       ["L0H0", "L0H1"], columns=2)
        >>> grid.name, sorted(grid.props["full"])
        ('AttentionGrid', [0])
    """
    arr = _array(thumbs, 3, "thumbs")
    if len(head_names) != arr.shape[0]:
        raise TLDynamicsError(f"{len(head_names)} head names for {arr.shape[0]} heads")
    kept = {}
    for index, pattern in full.items():
        if not 0 <= int(index) < arr.shape[0]:
            raise TLDynamicsError(f"full pattern for head index {index}; valid: 0..{arr.shape[0] - 1}")
        kept[int(index)] = _array(pattern, 2, "full pattern")
        _check_tokens(tokens, kept[int(index)].shape[-1], "attention_grid")
    return Component("AttentionGrid", dict(
        thumbs=arr, full=kept, tokens=[visible_token(t) for t in tokens],
        attentionHeadNames=[str(n) for n in head_names], columns=int(columns),
        rowNames=None if row_names is None else [str(r) for r in row_names],
        selected=int(selected), maskUpperTri=bool(mask_upper_tri)), caption=caption)


def table(df: Any, caption: str = "", max_rows: int = 60, float_format: str = "{:.4g}", *,
          colours: Any = None, titles: Any = None) -> Component:
    """A pandas DataFrame as an HTML table that scrolls inside its own box when wide.

    Every cell is escaped, whitespace-only strings are made visible, an unnamed integer index is
    dropped.

    Args:
        df: the ``[rows, columns]`` pandas DataFrame to show.
        caption: text shown above the table.
        max_rows: rows shown at most (a note says how many more there are).
        float_format: format of float cells.
        colours: optional DataFrame shaped like ``df``: each data cell's background as
            ``"#rrggbb"`` (anything else is refused), or None/empty for none.
        titles: optional DataFrame shaped like ``df``: each data cell's hover text (escaped).

    Returns:
        A ``Component`` of kind ``"table"``.

    Example:
        >>> import pandas as pd
        >>> f = pd.DataFrame({"H0": ["ind"]}, index=pd.Index(["L0"], name="layer"))
        >>> c = table(f, colours=pd.DataFrame({"H0": ["#e15759"]}, index=f.index),
        ...           titles=pd.DataFrame({"H0": ["L0H0 <induction>"]}, index=f.index))
        >>> 'title="L0H0 &lt;induction&gt;" style="background:#e15759"' in c.html
        True
    """
    shown = df.head(max_rows)
    # An unnamed integer index is row numbering, not data: it is left out.
    keep_index = shown.index.name is not None or shown.index.dtype.kind not in "iu"
    columns = ([shown.index.name or ""] if keep_index else []) + list(shown.columns)
    head = "".join(f"<th>{html_escape(c)}</th>" for c in columns)
    styles = _cell_attributes(shown, colours, titles)
    rows = []
    for i, (index, row) in enumerate(shown.iterrows()):
        lead = f"<td>{html_escape(_fmt(index, float_format))}</td>" if keep_index else ""
        rows.append("<tr>" + lead + "".join(
            f"<td{styles[i][j]}>{html_escape(_fmt(v, float_format))}</td>"
            for j, v in enumerate(row.values)) + "</tr>")
    more = f'<p class="caption">{len(df) - max_rows} more rows not shown</p>' if len(df) > max_rows else ""
    return Component(html=f'<div class="tld-scroll"><table class="tld-table"><thead><tr>{head}'
                          f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div>{more}',
                     caption=caption, kind="table")


_COLOUR = re.compile(r"#[0-9a-fA-F]{6}")


def _cell_attributes(shown: Any, colours: Any, titles: Any) -> list[list[str]]:
    """Each shown data cell's ``title``/``style`` attributes (escaped, colours checked)."""
    n_rows, n_cols = shown.shape
    out = [[""] * n_cols for _ in range(n_rows)]
    for what, frame in (("colours", colours), ("titles", titles)):
        if frame is None:
            continue
        if tuple(frame.shape[1:]) != (n_cols,) or len(frame) < n_rows:
            raise TLDynamicsError(f"table: {what} has shape {tuple(frame.shape)}; valid: the "
                                  f"table's shape {tuple(shown.shape)}")
        for i in range(n_rows):
            for j in range(n_cols):
                value = frame.iat[i, j]
                if value is None or value == "" or value != value:
                    continue
                if what == "titles":
                    out[i][j] = f' title="{html_escape(value)}"' + out[i][j]
                elif _COLOUR.fullmatch(str(value)):
                    out[i][j] += f' style="background:{value}"'
                else:
                    raise TLDynamicsError(f"table: colour {value!r} at row {i}, column {j}; "
                                          "valid: '#rrggbb'")
    return out


def text(body: str, caption: str = "") -> Component:
    """A paragraph of plain (escaped) text."""
    return Component(html=f"<p>{html_escape(body)}</p>", caption=caption, kind="text")


def _fmt(value: Any, float_format: str) -> str:
    if isinstance(value, (float, np.floating)):
        return float_format.format(value)
    if isinstance(value, str):
        return visible_token(value)
    return str(value)


def _camel(options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in options.items():
        head, *rest = key.split("_")
        out[head + "".join(word.title() for word in rest)] = value
    return out
