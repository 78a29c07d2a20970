"""What a run of trajectory statistics records about itself (``stats_meta``, ``lens_note``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tl_dynamics.trajectories._cloud import N_BINS
from tl_dynamics.trajectories._points import Config, Standardizer, point_labels, point_roles

if TYPE_CHECKING:
    from tl_dynamics.adapter import Batch, ModelAdapter


def lens_applies(adapter: "ModelAdapter") -> bool:
    """The logit lens (and next-token approach) is defined for decoder language models only."""
    return not adapter.is_encoder


# What a run with lens="view" says in place of the rank statistics it does not have.
VIEW_NOTE = (
    "the logit lens was read at the cells the view shows only (lens='view'); the dataset "
    "statistics of the rank (mean rank, top-1 rate, settling) need lens='full'"
)


def lens_note(adapter: "ModelAdapter", lens: str | None, batch: "Batch | None") -> str:
    """Why the next-token statistics are absent ("" when present)."""
    if not lens:
        return "next-token statistics switched off (lens=False)"
    if not lens_applies(adapter):
        return (
            f"not applicable: {adapter.info.architecture} is an encoder (bidirectional); "
            "it has no next token and its masked-LM head is not a final norm plus unembedding"
        )
    if batch is None:
        return "not computed: no tokens were given for these forward passes (pass batch=...)"
    return ""


def stats_meta(adapter: "ModelAdapter", cfg: Config, note: str) -> dict[str, Any]:
    """What a run of statistics records about how it was computed (runs merge when equal)."""
    std = cfg.standardize
    return dict(
        architecture=adapter.info.architecture,
        d_model=adapter.d_model,
        labels=point_labels(point_roles(adapter, cfg.flattened, cfg.layers)),
        eps=tuple(cfg.eps),
        n_bins=N_BINS,
        flattened=cfg.flattened,
        skip_first=cfg.skip_first,
        standardize="dataset"
        if isinstance(std, Standardizer)
        else ("prompt" if std in (True, "prompt") else "none"),
        lens_note=VIEW_NOTE if cfg.lens == "view" and not note else note,
    )
