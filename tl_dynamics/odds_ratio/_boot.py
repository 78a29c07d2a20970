"""Bootstrap replicates of the sums a head's label rests on (docs/math.md §9).

Each prompt is a unit. Its label sums (``_stats.BOOT_KEYS``) enter every replicate ``b`` with a
Poisson(1) weight drawn from a counter-based generator keyed on the prompt's own tokens
(``evidence.unit_keys``, ``evidence.poisson_weights``), so the replicate sums are exact sums
like the statistics themselves: the same bits whatever the batching, the order of the passes or
the processes that saw the prompts (one process, torchrun, Ray).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.collect import ExactSum, to_host
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.evidence import poisson_weights, unit_keys
from tl_dynamics.odds_ratio._stats import BOOT_KEYS

FOLD = 32  # passes kept (references) before their replicate sums are formed and summed exactly


@dataclass(frozen=True)
class Replicates:
    """Bootstrap replicates of the label sums: ``exact`` ``[n_boot, layer, key, head]`` (keys
    ``keys``), drawn with generator key ``seed``."""

    exact: ExactSum
    keys: tuple[str, ...]
    seed: int

    @property
    def n_boot(self) -> int:
        """The number of replicates."""
        return int(self.exact.shape[0])

    def values(self) -> dict[str, np.ndarray]:
        """``{key: [n_boot, layer, head]}`` float64."""
        v = self.exact.value()
        return {k: v[:, :, i] for i, k in enumerate(self.keys)}

    def merge(self, other: "Replicates") -> "Replicates":
        """Both runs' replicates together, exactly."""
        if (self.keys, self.seed, self.exact.shape) != (other.keys, other.seed, other.exact.shape):
            raise TLDynamicsError(
                "cannot merge bootstrap replicates drawn differently: "
                f"{self.n_boot} replicates of {list(self.keys)} with seed {self.seed} against "
                f"{other.n_boot} of {list(other.keys)} with seed {other.seed}"
            )
        return Replicates(self.exact + other.exact, self.keys, self.seed)


class BootSums:
    """Accumulates the replicate sums of a collector's passes.

    A pass only keeps references (its prompts' tokens and their label sums, on the device: no
    work during the forward). Every ``FOLD`` passes, and at ``result()``, the kept tensors are
    read in one transfer (``collect.to_host``) and each pass's replicate sums formed on the host
    and added exactly (``ExactSum``)."""

    def __init__(self, n_boot: int, seed: int):
        poisson_weights([0], n_boot, seed)  # checks n_boot
        self.n_boot, self.seed = n_boot, seed
        self._pending: list[tuple[Tensor | None, Tensor | None, int, Tensor]] = []
        self._total: ExactSum | None = None
        self._seen = 0

    def add(
        self,
        tokens: Tensor | None,
        valid: Tensor | None,
        layers: Sequence[int],
        groups: list[tuple[list[int], Tensor]],
    ) -> None:
        """One pass: its ``tokens`` and ``valid`` ``[batch, pos]`` (None: unknown, the prompts'
        running indices key them), and its label sums as ``(layers, [batch, key, layers x
        head])`` groups, laid out as ``layers``."""
        first = groups[0][1]
        b, k = first.shape[0], first.shape[1]
        if len(groups) == 1 and list(groups[0][0]) == list(layers):  # no copy
            per = first.reshape(b, k, len(layers), -1)  # [b, key, layer, head]
        else:  # several groups (the CPU's plan, or layers split by scale or mask)
            parts = {}
            for group_layers, t in groups:
                for i, part in enumerate(t.reshape(b, k, len(group_layers), -1).unbind(2)):
                    parts[group_layers[i]] = part
            zero = torch.zeros_like(next(iter(parts.values())))
            per = torch.stack([parts.get(layer, zero) for layer in layers], 2)
        self._pending.append((tokens, valid, self._seen, per))
        self._seen += int(per.shape[0])
        if len(self._pending) >= FOLD:
            self._fold()

    def pending(self) -> dict[str, Tensor]:
        """The kept device tensors, named for ``absorb`` (read them in the caller's one read)."""
        named: dict[str, Tensor] = {}
        for i, (tokens, valid, _, per) in enumerate(self._pending):
            named[f"boot.p{i}"] = per
            if tokens is not None and valid is not None:  # float64 holds token ids exactly
                named[f"boot.t{i}"] = torch.where(valid.to(tokens.device), tokens, -1).to(per.dtype)
        return named

    def absorb(self, host: dict[str, Tensor]) -> None:
        """Form the pending passes' replicate sums from their host copies (``pending``) and add
        them exactly, each pass on its own (any grouping of passes gives the same bits)."""
        totals = []
        for i, (tokens, _, start, _) in enumerate(self._pending):
            per = host[f"boot.p{i}"].numpy()  # [b, key, layer, head]
            if tokens is not None:
                ids = host[f"boot.t{i}"].numpy()
                units = unit_keys(np.maximum(ids, 0).astype(np.int64), ids >= 0)
            else:
                units = np.arange(start, start + per.shape[0])
            w = poisson_weights(units, self.n_boot, self.seed)  # [b, B]
            exact = ExactSum.of(per.transpose(0, 2, 1, 3))  # [b, layer, key, head]
            if exact.special is None:  # integer weights: the limbs scaled, nothing rounded
                totals.append(exact.weighted(w))
            else:  # a non-finite sum: as float arithmetic has it (0 * inf = nan)
                reps = np.einsum("bB,bklh->Blkh", w, per.astype(np.float64), optimize=False)
                totals.append(ExactSum.of(reps))
        self._pending = []
        if totals:  # (one pass: its sums are canonical already)
            total = totals[0] if len(totals) == 1 else ExactSum.total(totals)
            self._total = total if self._total is None else self._total + total

    def _fold(self) -> None:
        if self._pending:
            self.absorb(to_host(self.pending()))

    def result(self, shape: tuple[int, int]) -> Replicates:
        """The replicates so far (zeros before any pass; ``absorb`` the pending passes first to
        read them with the caller's tensors); ``shape`` is ``(layers, heads)``."""
        self._fold()
        total = self._total
        if total is None:
            total = ExactSum.zeros((self.n_boot, shape[0], len(BOOT_KEYS), shape[1]))
        return Replicates(total, BOOT_KEYS, self.seed)
