"""The views tl_dynamics draws itself, not circuitsvis: heat maps and attention grids (on the
page runtime's canvases, labels set as text), tables, text and matplotlib figures (HTML, every
text escaped).
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any, Sequence

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.viz._builders import _array, _check_tokens
from tl_dynamics.viz._component import Component, html_escape, visible_token


def figure(fig: Any, caption: str = "", close: bool = True) -> Component:
    """A matplotlib figure as an inline PNG (no network, no script).

    Args:
        fig: A ``matplotlib.figure.Figure``.
        caption: Text under the view (also the image's alt text).
        close: Close the figure after encoding it (so a notebook does not draw it twice).

    Returns:
        A ``Component`` of kind ``"figure"`` (an ``<img>`` with the PNG as a data URL).

    Example:
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots(figsize=(1, 1))
        >>> figure(fig, caption="demo").html[:34]
        '<img class="tld-figure" alt="demo"'
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    if close:
        import matplotlib.pyplot as plt

        plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return Component(
        html=f'<img class="tld-figure" alt="{html_escape(caption or "figure")}" '
        f'src="data:image/png;base64,{data}">',
        caption=caption,
        kind="figure",
    )


def heatmap(
    values: Any,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    title: str = "",
    row_title: str = "row",
    col_title: str = "column",
    value_name: str = "value",
    min_value: float | None = None,
    max_value: float | None = None,
    cmap: str | None = None,
    mask_upper_tri: bool = False,
    cell_px: int = 16,
    caption: str = "",
) -> Component:
    """A ``[rows, cols]`` map on a canvas with a colour legend and a hover read-out.

    E.g. a statistic over layer x head. Signed values get a diverging map centred on 0. NaN cells
    are grey ("not defined"). Cells are ``cell_px`` pixels wide at most (smaller when the map would
    not fit).

    Args:
        values: The map, ``[rows, cols]``.
        row_labels: One label per row.
        col_labels: One label per column.
        title: Title above the map.
        row_title: Name of the row axis.
        col_title: Name of the column axis.
        value_name: Name of the value in the hover read-out.
        min_value: Lower end of the colour scale (default: from the values).
        max_value: Upper end of the colour scale.
        cmap: ``"blues"``, ``"viridis"`` or ``"rdbu"`` (default: by the values' signs).
        mask_upper_tri: Grey out the cells above the diagonal.
        cell_px: Largest cell width in pixels.
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"Heatmap"``.

    Example:
        >>> heatmap([[0.1, 0.9], [0.5, float("nan")]], ["L0", "L1"], ["H0", "H1"]).name
        'Heatmap'
    """
    arr = _array(values, 2, "values")
    for labels, n, what in (
        (row_labels, arr.shape[0], "row"),
        (col_labels, arr.shape[1], "column"),
    ):
        if labels is not None and len(labels) != n:
            raise TLDynamicsError(f"heatmap: {len(labels)} {what} labels for {n} {what}s")
    if cmap not in (None, "blues", "viridis", "rdbu"):
        raise TLDynamicsError(f"heatmap: cmap {cmap!r}; valid: 'blues', 'viridis', 'rdbu'")

    def as_labels(xs: Sequence | None) -> list[str] | None:
        return None if xs is None else [visible_token(x) for x in xs]

    return Component(
        "Heatmap",
        dict(
            values=arr,
            rowLabels=as_labels(row_labels),
            colLabels=as_labels(col_labels),
            title=str(title),
            rowTitle=str(row_title),
            colTitle=str(col_title),
            valueName=str(value_name),
            minValue=min_value,
            maxValue=max_value,
            cmap=cmap,
            mask=bool(mask_upper_tri),
            cell=int(cell_px),
        ),
        caption=caption,
    )


def attention_grid(
    thumbs: Any,
    full: dict[int, Any],
    tokens: Sequence[str],
    head_names: Sequence[str],
    columns: int,
    row_names: Sequence[str] | None = None,
    selected: int = 0,
    mask_upper_tri: bool = False,
    caption: str = "",
) -> Component:
    """Many heads at once: a thumbnail per head in a grid, full patterns shown large when clicked.

    Built by the report for all heads of a model.

    Args:
        thumbs: One downsampled pattern per head, ``[heads, h, w]``.
        full: Full ``[pos, pos]`` patterns by head index (into ``thumbs``).
        tokens: One label per position of the full patterns.
        head_names: One name per head.
        columns: Thumbnails per row.
        row_names: One name per row of thumbnails.
        selected: The head shown large at first.
        mask_upper_tri: Grey out the future keys.
        caption: Text under the view.

    Returns:
        A ``Component`` named ``"AttentionGrid"``.

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
            raise TLDynamicsError(
                f"full pattern for head index {index}; valid: 0..{arr.shape[0] - 1}"
            )
        kept[int(index)] = _array(pattern, 2, "full pattern")
        _check_tokens(tokens, kept[int(index)].shape[-1], "attention_grid")
    return Component(
        "AttentionGrid",
        dict(
            thumbs=arr,
            full=kept,
            tokens=[visible_token(t) for t in tokens],
            attentionHeadNames=[str(n) for n in head_names],
            columns=int(columns),
            rowNames=None if row_names is None else [str(r) for r in row_names],
            selected=int(selected),
            maskUpperTri=bool(mask_upper_tri),
        ),
        caption=caption,
    )


def table(
    df: Any,
    caption: str = "",
    max_rows: int = 60,
    float_format: str = "{:.4g}",
    *,
    colours: Any = None,
    titles: Any = None,
) -> Component:
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
        rows.append(
            "<tr>"
            + lead
            + "".join(
                f"<td{styles[i][j]}>{html_escape(_fmt(v, float_format))}</td>"
                for j, v in enumerate(row.values)
            )
            + "</tr>"
        )
    more = (
        f'<p class="caption">{len(df) - max_rows} more rows not shown</p>'
        if len(df) > max_rows
        else ""
    )
    return Component(
        html=f'<div class="tld-scroll"><table class="tld-table"><thead><tr>{head}'
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>{more}",
        caption=caption,
        kind="table",
    )


_COLOUR = re.compile(r"#[0-9a-fA-F]{6}")


def _cell_attributes(shown: Any, colours: Any, titles: Any) -> list[list[str]]:
    """Each shown data cell's ``title``/``style`` attributes (escaped, colours checked)."""
    n_rows, n_cols = shown.shape
    out = [[""] * n_cols for _ in range(n_rows)]
    for what, frame in (("colours", colours), ("titles", titles)):
        if frame is None:
            continue
        if tuple(frame.shape[1:]) != (n_cols,) or len(frame) < n_rows:
            raise TLDynamicsError(
                f"table: {what} has shape {tuple(frame.shape)}; valid: the "
                f"table's shape {tuple(shown.shape)}"
            )
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
                    raise TLDynamicsError(
                        f"table: colour {value!r} at row {i}, column {j}; valid: '#rrggbb'"
                    )
    return out


def text(body: str, caption: str = "") -> Component:
    """A paragraph of plain (escaped) text.

    Args:
        body: The text.
        caption: Text under it.

    Returns:
        A ``Component`` of kind ``"text"``.

    Example:
        >>> text("a < b").html
        '<p>a &lt; b</p>'
    """
    return Component(html=f"<p>{html_escape(body)}</p>", caption=caption, kind="text")


def _fmt(value: Any, float_format: str) -> str:
    if isinstance(value, (float, np.floating)):
        return float_format.format(value)
    if isinstance(value, str):
        return visible_token(value)
    return str(value)
