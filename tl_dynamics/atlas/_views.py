"""The atlas as a layer x head grid coloured by role, the evidence on hover (plain HTML)."""

from __future__ import annotations

from typing import Sequence

from tl_dynamics import viz

COLOURS = {
    "previous-token": "#4e79a7", "duplicate-token": "#76b7b2", "induction": "#e15759",
    "copying": "#f28e2b", "copy-suppression": "#b07aa1",
    "negative copying": "#d4a6c8", "sink": "#9c755f",
    "positional/local": "#59a14f", "learned sink": "#bab0ac", "unclassified": "#d9d9d9",
    "not analysed": "#ffffff",
}
SHORT = {
    "previous-token": "prev", "duplicate-token": "dup", "induction": "ind", "copying": "copy",
    "copy-suppression": "supp",
    "negative copying": "neg", "sink": "sink", "positional/local": "local",
    "learned sink": "lsink", "unclassified": "-", "not analysed": "",
}


def grid_view(n_layers: int, n_heads: int, cells: dict[tuple[int, int], dict], title: str,
              notes: Sequence[str] = ()) -> viz.Component:
    """``cells[(layer, head)]`` holds ``roles`` (ranked), ``evidence`` and ``delta_loss``."""
    head_row = "".join(f"<th>H{h}</th>" for h in range(n_heads))
    rows = []
    for layer in range(n_layers):
        tds = []
        for head in range(n_heads):
            cell = cells.get((layer, head), {"roles": ("not analysed",), "evidence": "", "delta_loss": None})
            roles = [str(r) for r in cell["roles"]]
            colour = COLOURS.get(roles[0], "#ffffff")
            label = "+".join(SHORT.get(r, r) for r in roles[:2])
            delta = cell["delta_loss"]
            delta_text = "" if delta is None or delta != delta else f"<br><small>{delta:+.2f}</small>"
            hover = f"L{layer}H{head}: {', '.join(roles)}. {cell['evidence']}"
            if delta is not None and delta == delta:
                hover += f" Mean-ablation delta loss {delta:+.3f} nats."
            tds.append(f'<td title="{viz.html_escape(hover)}" style="background:{colour};'
                       f'text-align:center;padding:4px 6px;min-width:44px">'
                       f"{viz.html_escape(label)}{delta_text}</td>")
        rows.append(f"<tr><th>L{layer}</th>{''.join(tds)}</tr>")
    present = {r for cell in cells.values() for r in cell["roles"]}
    legend = " ".join(f'<span style="background:{c};padding:1px 6px;margin-right:4px">'
                      f"{viz.html_escape(r)}</span>" for r, c in COLOURS.items()
                      if r != "not analysed" and (r != "learned sink" or r in present))
    extra = "".join(f"<li>{viz.html_escape(n)}</li>" for n in notes)
    html = (f'<div class="tld-scroll"><table class="tld-table tld-atlas"><thead><tr><th></th>{head_row}'
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
            f"<p><small>{legend}</small></p>" + (f"<ul><small>{extra}</small></ul>" if extra else ""))
    return viz.Component(html=html, caption=title)


def atlas_view(grid: viz.Component, frame, caption: str) -> viz.Group:
    """The grid, then the per-head table (``frame``: a pandas DataFrame)."""
    return viz.group(grid, viz.table(frame, max_rows=200), caption=caption)
