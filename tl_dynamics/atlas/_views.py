"""The atlas as a layer x head grid coloured by role, the evidence on hover (``viz`` tables)."""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from tl_dynamics import viz

COLOURS = {
    "previous-token": "#4e79a7",
    "duplicate-token": "#76b7b2",
    "induction": "#e15759",
    "copying": "#f28e2b",
    "copy-suppression": "#b07aa1",
    "negative copying": "#d4a6c8",
    "sink": "#9c755f",
    "positional/local": "#59a14f",
    "learned sink": "#bab0ac",
    "unclassified": "#d9d9d9",
    "undecided": "#f1e4b3",
    "not analysed": "#ffffff",
}
SHORT = {
    "previous-token": "prev",
    "duplicate-token": "dup",
    "induction": "ind",
    "copying": "copy",
    "copy-suppression": "supp",
    "negative copying": "neg",
    "sink": "sink",
    "positional/local": "local",
    "learned sink": "lsink",
    "unclassified": "-",
    "undecided": "?",
    "not analysed": "",
}


def grid_view(
    n_layers: int,
    n_heads: int,
    cells: dict[tuple[int, int], dict],
    title: str,
    notes: Sequence[str] = (),
) -> list[viz.Component]:
    """The role grid, its legend and the notes, as ``viz`` tables and text (viz escapes).

    ``cells[(layer, head)]`` holds ``roles`` (ranked), ``evidence`` and ``delta_loss``; heads
    missing from ``cells`` are "not analysed".
    """
    index = pd.Index([f"L{layer}" for layer in range(n_layers)], name="layer")
    columns = [f"H{head}" for head in range(n_heads)]
    labels, colours, titles = ([[""] * n_heads for _ in range(n_layers)] for _ in range(3))
    for layer in range(n_layers):
        for head in range(n_heads):
            cell = cells.get(
                (layer, head), {"roles": ("not analysed",), "evidence": "", "delta_loss": None}
            )
            roles = [str(r) for r in cell["roles"]]
            delta = cell["delta_loss"]
            known = delta is not None and delta == delta
            labels[layer][head] = "+".join(SHORT.get(r, r) for r in roles[:2]) + (
                f" {delta:+.2f}" if known else ""
            )
            colours[layer][head] = COLOURS.get(roles[0], "#ffffff")
            titles[layer][head] = f"L{layer}H{head}: {', '.join(roles)}. {cell['evidence']}" + (
                f" Mean-ablation delta loss {delta:+.3f} nats." if known else ""
            )
    grid = viz.table(
        pd.DataFrame(labels, index=index, columns=columns),
        caption=title,
        max_rows=n_layers,
        colours=pd.DataFrame(colours, index=index, columns=columns),
        titles=pd.DataFrame(titles, index=index, columns=columns),
    )
    present = {r for cell in cells.values() for r in cell["roles"]}
    roles = [r for r in COLOURS if r != "not analysed" and (r != "learned sink" or r in present)]
    legend = viz.table(
        pd.DataFrame([[SHORT[r] for r in roles]], columns=roles),
        colours=pd.DataFrame([[COLOURS[r] for r in roles]], columns=roles),
    )
    return [grid, legend] + [viz.text(note) for note in notes]


def atlas_view(grid: Sequence[viz.Component], frame, caption: str) -> viz.Group:
    """The grid views, then the per-head table (``frame``: a pandas DataFrame)."""
    return viz.group(*grid, viz.table(frame, max_rows=200), caption=caption)
