"""The contextual-MLP section of the ``tl-dynamics report`` page."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.contextual_mlp._collect import compute
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._mlps import ContextualMLPs
from tl_dynamics.contextual_mlp._readout import written_tokens

TITLE = "Attention as a contextual MLP"
REPORT_MAX_POSITIONS = 64  # the section reads at most this many leading positions
WRITTEN_K = 5  # tokens shown per neuron of what it writes


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the contextual-MLP section to ``page``: the last layer's heads on the first prompt.

    The prompt is unpadded and cut to at most ``REPORT_MAX_POSITIONS`` tokens; the most decisive
    head is shown, with every head's exactness. Where the MLP cannot be built exactly (the
    weights would be wrong) ``compute`` raises a ``TLDynamicsError`` saying why, and the report page
    shows that instead of the section.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); row 0 is used.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> contextual_mlp.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'Attention as a contextual MLP'
    """
    layer = adapter.n_layers - 1
    real = batch.real_tokens()[:REPORT_MAX_POSITIONS]  # row 0, unpadded
    result = compute(adapter, adapter.tokenize(real[None]), layers=layer)
    mlp = result.decisive()
    items: list[viz.Component | viz.Group] = list(result.show().components)
    if adapter.is_encoder:
        items.append(
            viz.text(
                "What neurons write is not shown: it reads a_i through the "
                "unembedding, and an encoder's masked-LM head is not a final "
                "normalisation followed by W_U."
            )
        )
    else:
        items.append(written_tokens(mlp, adapter, position=mlp.positions[-1], k=WRITTEN_K).show())
    incoming = (
        "incoming weights b_i = c W_Q k_i"
        if mlp.input_space == "residual"
        else "incoming weights b_i = c k_i acting on the model's normalised query N(x W_Q + b_Q) "
        "(this architecture normalises q after its projection)"
    )
    if mlp.query_norm is not None and mlp.query_norm.scope == "latent":
        incoming = (
            "incoming weights b_i = c k_i, the decoupled key seen from the query (its "
            "non-rotary part per head, its rotary part shared by every head), acting on "
            "the model's query (x W_Q + b_Q) / rho_q(x) (multi-head latent attention: "
            "the query latent's RMS divides it; docs/math.md §1.7)"
        )
    intro = (
        f"At each destination a head is a one-hidden-layer MLP whose neurons are the source "
        f"tokens: outgoing weights a_i = v_i W_O, {incoming}, biases c_i, softmax "
        f"activation (docs/math.md §3.1). Shown: layer {layer}, head {mlp.head} (the head "
        f"whose neurons win most clearly: its most active neuron takes "
        f"{_top_activation(mlp):.2f} of the attention on average, where uniform attention "
        f"would give {_uniform_activation(mlp):.2f}), first row of the batch. The winner of "
        "a destination is where the head looks; the importance h_i |a_i| is what drives "
        "its output (docs/math.md §3.5)." + _sink_sentence(result)
    )
    page.add_section(TITLE, items, intro=intro, math="docs/math.md §3")


def _top_activation(mlp: ContextualMLP) -> float:
    """Mean over real destinations of the largest neuron activation (``decisive``'s score)."""
    return float(mlp.pattern().max(dim=-1).values[mlp.query_valid].mean())


def _uniform_activation(mlp: ContextualMLP) -> float:
    """The same under uniform attention: the mean of ``1 / (number of neurons)`` (the sources,
    and the learned sink where the layer has one)."""
    extra = 0 if mlp.sink_logit is None else 1
    return sum(1.0 / (len(mlp.sources(p)) + extra) for p in mlp.positions) / max(
        1, len(mlp.positions)
    )


def _sink_sentence(result: ContextualMLPs) -> str:
    """Where the layer has learned sinks: the sink neuron and its mean activation per head."""
    sunk = [m for m in result if m.sink_logit is not None]
    if not sunk:
        return ""
    masses = ", ".join(
        f"H{m.head} {float(m.learned_sink()[m.query_valid].mean()):.2f}" for m in sunk
    )
    return (
        ' This layer has a learned sink per head: one more neuron ("learned sink") with '
        "pre-activation the sink logit, no incoming weight and outgoing weight zero, whose "
        f"activation is the attention it absorbs (mean over destinations: {masses}; "
        "docs/math.md §3.7)."
    )
