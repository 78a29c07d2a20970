"""One-call overview (``compute``) and the report page section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.circuits._build import ov_circuit
from tl_dynamics.circuits._composition import CompositionScores, composition_scores
from tl_dynamics.circuits._prompt import PromptCircuit, prompt_circuit
from tl_dynamics.circuits._spectrum import HeadScores, copying_scores, qk_positivity_scores
from tl_dynamics.circuits._views import heatmaps


@dataclass(frozen=True)
class CircuitsOverview:
    """Copying and QK positivity of every head, all-pairs composition scores, and per-prompt
    circuits of the strongest copying head of each layer (when a prompt was given)."""

    copying: HeadScores
    qk_positivity: HeadScores
    composition: CompositionScores
    prompt: dict[tuple[int, int], PromptCircuit] = field(default_factory=dict)

    def to_dataframe(self):
        frame = self.copying.to_dataframe()[["layer", "head", "score"]].rename(columns={"score": "ov_copying"})
        frame["qk_positivity"] = self.qk_positivity.scores.reshape(-1).numpy()
        return frame

    def show(self):
        items = [head_scores_view(self.copying, self.qk_positivity, self.composition)]
        items += [pc.show() for pc in self.prompt.values()]
        return viz.group(*items, caption="QK/OV circuits")


def head_scores_view(copying: HeadScores, positivity: HeadScores,
                     composition: CompositionScores | None = None):
    panels = [copying.panel(), positivity.panel()] + ([] if composition is None else composition.panels())
    caption = ("Eigenvalue positivity sum(Re λ)/sum(|λ|) of each head's full OV circuit "
               "(W_E W_V W_O W_U: +1 copies) and QK circuit (W_E W_Q W_K^T W_E^T: +1 attends to "
               "the same token)")
    if composition is not None:
        caption += "; composition scores minus their random baseline. " + composition.summary().replace("\n", " ")
    return heatmaps(panels, caption=caption)


def compute(model: Any, prompt: Any = None, heads: Sequence[tuple[int, int]] | None = None,
            n_samples: int | None = None) -> CircuitsOverview:
    """Copying, QK positivity and composition scores; per-prompt circuits of ``heads``
    (default: the strongest copying head of each layer) when ``prompt`` is given.

    Example:
        >>> from tl_dynamics import circuits, zoo
        >>> overview = circuits.compute(zoo.load("induction-2l"), "ABCDABCD")  # doctest: +SKIP
        >>> overview.to_dataframe().columns.tolist()                          # doctest: +SKIP
        ['layer', 'head', 'ov_copying', 'qk_positivity']
    """
    adapter = ModelAdapter.of(model)
    copying = copying_scores(adapter)
    positivity = qk_positivity_scores(adapter)
    kwargs = {} if n_samples is None else {"n_samples": n_samples}
    composition = composition_scores(adapter, **kwargs)
    per_prompt = {}
    if prompt is not None:
        chosen = heads if heads is not None else [(l, copying.best(l)) for l in range(adapter.n_layers)]
        per_prompt = {(l, h): prompt_circuit(adapter, prompt, l, h) for l, h in chosen}
    return CircuitsOverview(copying, positivity, composition, per_prompt)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the circuits section: per-head copying and QK positivity, composition scores
    against their random baseline, and the strongest last-layer copying head on the prompt."""
    copying = copying_scores(adapter)
    positivity = qk_positivity_scores(adapter)
    composition = composition_scores(adapter)
    last = adapter.n_layers - 1
    head = copying.best(last)
    keep = batch.key_valid[0]
    ids = torch.unique(batch.tokens[0][keep])
    readout = ov_circuit(adapter, last, head).topk(7, ids)
    single = Batch(batch.tokens[:1], batch.key_valid[:1], batch.padding_side)
    pc = prompt_circuit(adapter, single, last, head)
    items = [viz.text(composition.summary()), head_scores_view(copying, positivity, composition),
             viz.text(f"L{last}H{head} has the highest OV copying score in the last layer "
                      f"({copying.score(last, head):.3f}). Its OV read-out for the prompt's tokens "
                      "(direct effect on the logits, full vocabulary, streamed):"),
             readout.show(),
             viz.attention_pattern(list(pc.tokens), pc.pattern(),
                                   caption=f"L{last}H{head}: the pattern its per-prompt QK circuit "
                                           "alone gives (token and position embeddings only)")]
    page.add_section("QK and OV circuits", items, intro=(
        "Weight-based circuits (Elhage et al. 2021), kept factored: no vocabulary x vocabulary "
        "matrix is formed. " + copying.notes[-1] + " " + composition.notes[-1]))


