"""One-call overview (``compute``) and the report page section (weights only: no ``attach``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.circuits._build import latent_notes, ov_circuit
from tl_dynamics.circuits._composition import CompositionScores, composition_scores
from tl_dynamics.circuits._prompt import PromptCircuit, prompt_circuit
from tl_dynamics.circuits._spectrum import HeadScores, copying_scores, qk_positivity_scores
from tl_dynamics.circuits._views import Panel, heatmaps, score_maps, topk_table
from tl_dynamics.circuits._virtual import token_composition
from tl_dynamics.errors import TLDynamicsError


@dataclass(frozen=True)
class CircuitsOverview(viz.Result):
    """The one-call circuits overview: head scores, composition, and per-prompt circuits.

    Copying and QK positivity of every head of the selected layers, all-pairs composition
    scores, and, when a prompt was given, the per-prompt circuits of the selected heads
    (``prompt[(layer, head)]``). ``show()`` draws the head scores and, for each layer, the
    per-prompt circuit of its strongest copying head among those computed; ``to_dataframe()`` has
    one row per scored head. Built by ``circuits.compute``.

    Attributes:
        copying: OV copying scores ``[n_layers, n_heads]`` (``copying_scores``).
        qk_positivity: QK positivity scores ``[n_layers, n_heads]`` (``qk_positivity_scores``).
        composition: Q/K/V composition of all head pairs (``composition_scores``).
        prompt: ``{(layer, head): PromptCircuit}`` (empty without a prompt).

    Example:
        >>> from tl_dynamics import circuits, testing
        >>> overview = circuits.compute(testing.tiny_model("gpt2"), "a = b", layers=1, heads=0,
        ...                             n_samples=10)
        >>> sorted(overview.prompt)
        [(1, 0)]
    """

    copying: HeadScores
    qk_positivity: HeadScores
    composition: CompositionScores
    prompt: dict[tuple[int, int], PromptCircuit] = field(default_factory=dict)

    def to_dataframe(self):
        """One row per scored head: ``layer, head_index, ov_copying, qk_positivity``.

        Returns:
            frame (pandas.DataFrame): ``n_layers x n_heads`` rows of the selected layers.

        Example:
            >>> from tl_dynamics import circuits, testing
            >>> frame = circuits.compute(testing.tiny_model("gpt2"), n_samples=10).to_dataframe()
            >>> frame.shape, frame.columns.tolist()
            ((8, 4), ['layer', 'head_index', 'ov_copying', 'qk_positivity'])
        """
        frame = self.copying.to_dataframe().rename(columns={"score": "ov_copying"})
        frame = frame[["layer", "head_index", "ov_copying"]]
        frame["qk_positivity"] = self.qk_positivity.scores.reshape(-1).numpy()
        return frame

    def shown_prompt_heads(self) -> list[tuple[int, int]]:
        """The heads whose per-prompt circuits ``show()`` draws.

        The strongest copying head of each layer among those with a per-prompt circuit.

        Returns:
            ``(layer, head)`` pairs, one per layer, in layer order.

        Example:
            >>> from tl_dynamics import circuits, testing
            >>> overview = circuits.compute(testing.tiny_model("gpt2"), "a = b", layers=1,
            ...                             heads=[0, 2], n_samples=10)
            >>> overview.shown_prompt_heads()
            [(1, 0)]
        """
        best: dict[int, tuple[int, int]] = {}
        for layer, head in self.prompt:
            if layer not in best or self.copying.score(layer, head) > self.copying.score(
                *best[layer]
            ):
                best[layer] = (layer, head)
        return [best[layer] for layer in sorted(best)]

    def show(self) -> viz.Group:
        """Draw the head-score maps and the shown heads' per-prompt circuits.

        Returns:
            A ``viz.Group``: the score heat maps, then one per-prompt circuit view per shown head.

        Example:
            >>> from tl_dynamics import circuits, testing
            >>> overview = circuits.compute(testing.tiny_model("gpt2"), "a = b", layers=1, heads=0,
            ...                             n_samples=10)
            >>> len(overview.show().components)
            2
        """
        items = [head_scores_view(self.copying, self.qk_positivity, self.composition)]
        items += [self.prompt[key].show() for key in self.shown_prompt_heads()]
        return viz.group(*items, caption="QK/OV circuits")


def head_scores_view(
    copying: HeadScores, positivity: HeadScores, composition: CompositionScores | None = None
):
    panels = [copying.panel(), positivity.panel()] + (
        [] if composition is None else composition.panels()
    )
    caption = (
        "Eigenvalue positivity sum(Re λ)/sum(|λ|) of each head's full OV circuit "
        "(W_E W_V W_O W_U: +1 copies) and QK circuit (W_E W_Q W_K^T W_E^T: +1 attends to "
        "the same token)"
    )
    if composition is not None:
        caption += (
            "; composition scores minus their random baseline. "
            + composition.summary().replace("\n", " ")
        )
    return heatmaps(panels, caption=caption)


def compute(
    model: Any,
    prompt: Any = None,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    n_samples: int | None = None,
) -> CircuitsOverview:
    """One-call circuits overview: head scores, composition, and per-prompt circuits.

    Copying and QK positivity scores of every head in ``layers``, composition scores of all
    head pairs, and, when ``prompt`` (one prompt) is given, the per-prompt circuits of ``heads``
    in every layer of ``layers`` (the analysis convention: ``layers=[0, 2], heads=1`` is L0H1
    and L2H1; None means all). Weights only: ``prompt`` supplies tokens, no forward pass runs.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: one prompt (text, ``[1, pos]`` token ids or a one-row ``Batch``), or None.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads).
        n_samples: random-baseline samples of the composition scores (None: the default).

    Returns:
        A ``CircuitsOverview``.

    Example:
        >>> from tl_dynamics import circuits, testing
        >>> model = testing.tiny_model("gpt2")
        >>> overview = circuits.compute(model, "a = b", layers=1, heads=[0, 2], n_samples=10)
        >>> sorted(overview.prompt), overview.copying.layers
        ([(1, 0), (1, 2)], (1,))
        >>> overview.to_dataframe().columns.tolist()
        ['layer', 'head_index', 'ov_copying', 'qk_positivity']
    """
    adapter = ModelAdapter.of(model)
    layer_list = adapter.check_attention_layers(layers)
    head_list = adapter.check_heads(heads)
    batch = None if prompt is None else adapter.tokenize(prompt)
    if batch is not None and batch.tokens.shape[0] != 1:
        raise TLDynamicsError(
            f"circuits.compute takes one prompt, got a batch of {batch.tokens.shape[0]}"
        )
    if n_samples is not None and (
        isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1
    ):
        raise TLDynamicsError(
            f"n_samples must be a positive integer (baseline samples), got {n_samples!r}"
        )
    copying = copying_scores(adapter, layer_list)
    positivity = qk_positivity_scores(adapter, layer_list)
    composition = (
        composition_scores(adapter)
        if n_samples is None
        else composition_scores(adapter, n_samples=n_samples)
    )
    per_prompt = (
        {}
        if batch is None
        else {
            (layer, head): prompt_circuit(adapter, batch, layer, head)
            for layer in layer_list
            for head in head_list
        }
    )
    return CircuitsOverview(copying, positivity, composition, per_prompt)


REPORT_MAX_POSITIONS = 64  # the per-prompt circuit reads at most this many leading positions
READOUT_ROWS = 30  # prompt tokens listed in the OV read-out table
READOUT_K = 4  # vocabulary tokens per side and row of that table
SCORES_CAPTION = (
    "Eigenvalue positivity sum(Re λ)/sum(|λ|) of each head's full OV circuit "
    "(W_E W_V W_O W_U: +1 copies its input token) and QK circuit "
    "(W_E W_Q W_K^T W_E^T: +1 attends to the same token); rows: layers, columns: "
    "heads, hover for the value."
)
COMPOSITION_CAPTION = (
    "Composition score of every earlier head (row) into every later head "
    "(column) minus the mean of the random baseline above: blue pairs compose "
    "more than random heads of the same shapes, red less; one colour scale for "
    "the three kinds, grey where the pair is not earlier-to-later."
)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the "QK and OV circuits" section to ``page``.

    The weight-based head scores and composition against its random baseline (``compute``
    without a prompt), the token-level K-circuit of the last layer's strongest copying head
    through the layer before it, that head's per-prompt QK and OV circuits on the first prompt's
    first 64 tokens, and its OV read-out for the prompt's tokens, named a copying head only if it
    clears chance.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); row 0 is used.

    Example:
        >>> from tl_dynamics import circuits, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> circuits.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'QK and OV circuits'
    """
    result = compute(adapter)  # weights only: per-prompt circuits below, for the shown head only
    att = adapter.check_attention_layers(None)  # hybrids: the last two attention layers
    last = att[-1]
    head = result.copying.best(last)
    real = batch.real_tokens()  # first prompt, unpadded
    ids = torch.unique(real)
    readout = ov_circuit(adapter, last, head).topk(READOUT_K, ids[:READOUT_ROWS])
    items: list[viz.Component | viz.Group] = [
        viz.text(result.composition.summary().replace("\n", " ")),
        score_maps(
            [result.copying.panel(), result.qk_positivity.panel()], SCORES_CAPTION, cell_px=22
        ),
        score_maps(result.composition.panels(), COMPOSITION_CAPTION, cell_px=6),
    ]
    if len(att) > 1:  # token-level evidence beside the Frobenius verdict (docs/math.md §4.4, §4.5)
        earlier = [(att[-2], h) for h in range(adapter.n_heads)]
        tokens = token_composition(adapter, "K", (last, head), earlier, rows=ids)
        items.append(
            viz.text(
                "Token-level evidence (the Frobenius score can miss a real circuit): the K-circuit "
                f"of L{last}H{head} through every head of layer {att[-2]}, on the prompt's tokens: "
                + tokens.summary()
            )
        )
    shown = real[:REPORT_MAX_POSITIONS]
    circuit = prompt_circuit(adapter, adapter.tokenize(shown[None]), last, head)
    labels = [f"{k}:{viz.visible_token(t)}" for k, t in enumerate(circuit.tokens)]
    qk = circuit.qk.masked_fill(~circuit.allowed, float("nan")).numpy()
    cut = "" if len(shown) == len(real) else f" (the first {len(shown)} of {len(real)} tokens)"
    items.append(
        score_maps(
            [
                Panel(f"QK of L{last}H{head}", qk, labels, labels, "key", "query"),
                Panel(
                    f"OV of L{last}H{head}",
                    circuit.ov.numpy(),
                    labels,
                    labels,
                    "output token",
                    "source token",
                ),
            ],
            f"Per-prompt circuits of L{last}H{head} on the prompt's tokens{cut}: the QK score each "
            "query gives each key from the tokens and positions alone (grey: not allowed), and the "
            "logit of each prompt token that attending to each source writes (direct path).",
            cell_px=8,
        )
    )
    items += [
        viz.text(
            result.copying.verdict(last) + f" The OV read-out of L{last}H{head} for "
            "the prompt's tokens (direct effect on the logits, full vocabulary, "
            "streamed):"
        ),
        topk_table(
            readout.to_dataframe(),
            READOUT_ROWS,
            f"L{last}H{head}: for each prompt token (first {READOUT_ROWS} distinct), "
            f"the {READOUT_K} vocabulary tokens whose logits attending to it raises "
            "and lowers most, with the logit change.",
        ),
    ]
    page.add_section(
        "QK and OV circuits",
        items,
        intro=(
            "Weight-based circuits (Elhage et al. 2021), kept factored: no vocabulary x vocabulary "
            "matrix is formed. "
            + " ".join(
                [result.copying.notes[1], result.composition.notes[2], *latent_notes(adapter, att)]
            )
        ),
        math="docs/math.md §4",
    )
