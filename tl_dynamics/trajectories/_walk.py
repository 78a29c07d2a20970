"""Hook plumbing: route each residual point of a forward pass to a ``PointComputer``; what a
run records about itself (``stats_meta``, ``lens_note``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._cloud import N_BINS
from tl_dynamics.trajectories._points import (Config, PointComputer, Standardizer, check_config,
                                              next_tokens, point_labels, point_roles)

if TYPE_CHECKING:
    from tl_dynamics.adapter import Batch, ModelAdapter


def lens_applies(adapter: "ModelAdapter") -> bool:
    """The logit lens (and next-token approach) is defined for decoder language models only."""
    return not adapter.is_encoder


def lens_note(adapter: "ModelAdapter", lens: bool, batch: "Batch | None") -> str:
    """Why the next-token statistics are absent ("" when present)."""
    if not lens:
        return "next-token statistics switched off (lens=False)"
    if not lens_applies(adapter):
        return (f"not applicable: {adapter.info.architecture} is an encoder (bidirectional); "
                "it has no next token and its masked-LM head is not a final norm plus unembedding")
    if batch is None:
        return "not computed: no tokens were given for these forward passes (pass batch=...)"
    return ""


def stats_meta(adapter: "ModelAdapter", cfg: Config, note: str) -> dict[str, Any]:
    """What a run of statistics records about how it was computed (runs merge when equal)."""
    std = cfg.standardize
    return dict(architecture=adapter.info.architecture, d_model=adapter.d_model,
                labels=point_labels(point_roles(adapter, cfg.flattened, cfg.layers)),
                eps=tuple(cfg.eps), n_bins=N_BINS, flattened=cfg.flattened,
                skip_first=cfg.skip_first,
                standardize="dataset" if isinstance(std, Standardizer) else
                ("prompt" if std in (True, "prompt") else "none"),
                lens_note=note)


class Walker:
    """Owns one ``PointComputer`` per forward pass and hands its stacked output to ``sink``.

    ``batch`` gives the padding mask and the tokens (for the next-token targets); without it
    every position counts as real and the next-token statistics are skipped.
    """

    def __init__(self, adapter: "ModelAdapter", cfg: Config,
                 sink: Callable[[dict[str, Tensor], "Batch | None"], None],
                 batch: "Batch | None" = None):
        check_config(adapter, cfg)
        self.adapter, self.cfg, self.sink, self.batch = adapter, cfg, sink, batch
        self.roles = point_roles(adapter, cfg.flattened, cfg.layers)
        self.computer: PointComputer | None = None

    def set_batch(self, batch: "Batch | None") -> None:
        """The batch of the next forward pass (for ``attach`` around the user's own calls)."""
        self.batch = batch

    def _start(self, z: Tensor) -> PointComputer:
        batch = self.batch
        if batch is not None and tuple(batch.tokens.shape) != tuple(z.shape[:2]):
            raise TLDynamicsError(f"the forward pass runs tokens of shape {tuple(z.shape[:2])} but "
                                  f"the batch given has {tuple(batch.tokens.shape)}")
        if batch is None:
            key_valid = torch.ones(z.shape[:2], dtype=torch.bool, device=z.device)
            targets = None
        else:
            key_valid = batch.key_valid.to(z.device)
            targets = None
            if self.cfg.lens and lens_applies(self.adapter):
                targets = next_tokens(batch.tokens.to(z.device), key_valid)
        return PointComputer(self.adapter, self.cfg, key_valid, targets, len(self.roles))

    def hooks(self) -> list[tuple[str, int, Callable[[Tensor], None]]]:
        def make(p: int) -> Callable[[Tensor], None]:
            def fn(z: Tensor) -> None:
                if p == 0:
                    self.computer = self._start(z)
                if self.computer is None:
                    raise TLDynamicsError("a residual point fired before the first one")
                self.computer.add(p, z)
            return fn
        return [(role, layer, make(p)) for p, (role, layer) in enumerate(self.roles)]

    def end(self) -> None:
        computer, self.computer = self.computer, None
        if computer is not None:
            batch = self.batch
            if batch is not None:  # summaries come back on the CPU; so does their mask
                from tl_dynamics.adapter import Batch

                batch = Batch(batch.tokens.cpu(), batch.key_valid.cpu(), batch.padding_side)
            self.sink(computer.finish(), batch)

    @contextmanager
    def attached(self) -> Iterator["Walker"]:
        with self.adapter.hooks(self.hooks(), on_forward_end=self.end):
            yield self

    def run(self, batch: "Batch") -> None:
        self.batch = batch
        with self.attached():
            self.adapter.forward(batch)
