"""Views: circuitsvis components with escaped tokens, plots, tables, and offline pages.

The only part of tl_dynamics that imports circuitsvis (lazily, for its browser bundle).
"""

from tl_dynamics.viz._builders import (
    attention_heads,
    attention_pattern,
    colored_tokens,
    colored_tokens_multi,
    text_neuron_activations,
    topk_tokens,
)
from tl_dynamics.viz._arcs import arc_diagram
from tl_dynamics.viz._own_views import attention_grid, figure, heatmap, table, text
from tl_dynamics.viz._component import Component, html_escape, notebook_bundle, visible_token
from tl_dynamics.viz._group import Group, group
from tl_dynamics.viz._page import Page
from tl_dynamics.viz._plots import line_plot, small_multiples
from tl_dynamics.viz._result import Result
from tl_dynamics.viz import _export  # noqa: F401  (registers view.save and Page.save_figures)

__all__ = [
    "Component",
    "Group",
    "Page",
    "Result",
    "arc_diagram",
    "attention_grid",
    "attention_heads",
    "attention_pattern",
    "colored_tokens",
    "colored_tokens_multi",
    "figure",
    "group",
    "heatmap",
    "html_escape",
    "line_plot",
    "notebook_bundle",
    "small_multiples",
    "table",
    "text",
    "text_neuron_activations",
    "topk_tokens",
    "visible_token",
]
