"""``ContextualMLPs``: what ``compute`` returns, the contextual MLPs of the selected heads on one
prompt row, keyed by ``(layer, head)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.contextual_mlp import _views
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.errors import TLDynamicsError


class LazyMLPs(Mapping[tuple[int, int], ContextualMLP]):
    """``{(layer, head): ContextualMLP}`` whose values are formed on first look-up (and kept)."""

    def __init__(self, keys: Sequence[tuple[int, int]], form: Callable[[int, int], ContextualMLP]):
        self._keys, self._form = list(keys), form
        self._formed: dict[tuple[int, int], ContextualMLP] = {}

    def __getitem__(self, key: tuple[int, int]) -> ContextualMLP:
        if key not in self._formed:
            if key not in self._keys:
                raise KeyError(key)
            self._formed[key] = self._form(*key)
        return self._formed[key]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


@dataclass(frozen=True)
class ContextualMLPs(viz.Result):
    """The contextual MLP of every selected head on prompt row ``row``.

    ``result[layer, head]`` (or ``result.mlp(layer, head)``) is one head's ``ContextualMLP``;
    iterating gives them in ``(layer, head)`` order. ``to_dataframe()`` has one line per layer,
    head and destination; ``show()`` the most decisive head (``decisive()``) and, where the model's
    own activations were kept (``reference=True``), every head's exactness.

    Attributes:
        architecture: the model's architecture name.
        row: the prompt row of the batch.
        str_tokens: the row's token strings.
        mlps: ``{(layer, head): ContextualMLP}`` (built on first look-up).

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
        >>> res.keys(), res[1, 2].head
        ([(1, 0), (1, 2)], 2)
    """

    architecture: str
    row: int
    str_tokens: tuple[str, ...]
    mlps: Mapping[tuple[int, int], ContextualMLP]

    def __repr__(self) -> str:
        return (
            f"ContextualMLPs({self.architecture}, row={self.row}, layers={self.layers}, "
            f"heads={self.heads}, positions={len(self.str_tokens)})"
        )

    @property
    def layers(self) -> list[int]:
        """The layers held, sorted.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> res.layers
            [1]
        """
        return sorted({layer for layer, _ in self.mlps})

    @property
    def heads(self) -> list[int]:
        """The heads held (in any layer), sorted.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> res.heads
            [0, 2]
        """
        return sorted({head for _, head in self.mlps})

    def keys(self) -> list[tuple[int, int]]:
        """The ``(layer, head)`` pairs held, sorted.

        Returns:
            A list of ``(layer, head)`` pairs.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> res.keys()
            [(1, 0), (1, 2)]
        """
        return sorted(self.mlps)

    def mlp(self, layer: int, head: int) -> ContextualMLP:
        """The ``ContextualMLP`` of head ``head`` in layer ``layer``.

        Args:
            layer: a layer held.
            head: a head held in that layer.

        Returns:
            The head's ``ContextualMLP``; a pair not held raises ``TLDynamicsError``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> res.mlp(1, 2) is res[1, 2]
            True
        """
        if (layer, head) not in self.mlps:
            raise TLDynamicsError(
                f"no contextual MLP for layer {layer!r}, head {head!r}: computed "
                f"(layer, head) pairs: {self.keys()}"
            )
        return self.mlps[(layer, head)]

    def __getitem__(self, key: tuple[int, int]) -> ContextualMLP:
        if not isinstance(key, tuple) or len(key) != 2:
            raise TLDynamicsError(
                f"index a ContextualMLPs with [layer, head], got {key!r}; "
                f"computed (layer, head) pairs: {self.keys()}"
            )
        return self.mlp(*key)

    def __iter__(self) -> Iterator[ContextualMLP]:
        return iter(self.mlps[key] for key in self.keys())

    def __len__(self) -> int:
        return len(self.mlps)

    def decisive(self) -> ContextualMLP:
        """The head whose neurons win most clearly: highest mean top activation over destinations.

        Returns:
            That head's ``ContextualMLP``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> (res.decisive().layer, res.decisive().head) in res.keys()
            True
        """

        def score(m: ContextualMLP) -> float:
            return float(m.pattern().max(dim=-1).values[m.query_valid].mean())

        return max(self, key=score)

    def to_dataframe(self) -> pd.DataFrame:
        """One line per layer, head and destination, with the winning neuron.

        Neurons, the winning neuron (its source position, token, activation and importance
        ``activation * |a_i|``; docs/math.md §3.5), the learned-sink neuron's activation where the
        layer has one (``sink_activation``), and, where the references were kept, the errors
        against the model's own head output and pattern.

        Returns:
            A pandas DataFrame with columns ``layer, head, position, token, n_neurons, winner,
            winner_token, winner_activation, winner_importance, top_importance`` (then
            ``sink_activation``, ``output_error, pattern_error``).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> res.to_dataframe().shape  # 2 heads x 7 destinations
            (14, 12)
        """
        frames = []
        for m in self:
            pattern = m.pattern()  # [dest, src], zero off the allowed sources
            importance = pattern * m.outgoing.norm(dim=-1)[None]
            rows = torch.tensor(m.positions, dtype=torch.long)
            winners = pattern[rows].argmax(-1)
            frame = pd.DataFrame(
                {
                    "layer": m.layer,
                    "head_index": m.head,
                    "position": rows.tolist(),
                    "token": [m.str_tokens[p] for p in m.positions],
                    "n_neurons": m.allowed[rows].sum(-1).tolist(),
                    "winner": winners.tolist(),
                    "winner_token": [m.str_tokens[w] for w in winners.tolist()],
                    "winner_activation": pattern[rows, winners].tolist(),
                    "winner_importance": importance[rows, winners].tolist(),
                    "top_importance": importance[rows].max(-1).values.tolist(),
                }
            )
            if m.sink_logit is not None:  # the learned-sink neuron (docs/math.md §3.7)
                frame["sink_activation"] = m.learned_sink()[rows].tolist()
            if m.reference_output is not None and m.reference_pattern is not None:
                exact = m.exactness()
                frame["output_error"] = exact.output_error.tolist()
                frame["pattern_error"] = exact.pattern_error.tolist()
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    def exactness(self) -> pd.DataFrame:
        """Per head, the largest error of the explicit MLP against the model's own output and pattern.

        Needs ``reference=True`` (``compute``'s default).

        Returns:
            A pandas DataFrame with columns ``layer, head, output_error, pattern_error``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> bool((res.exactness()["output_error"] < 1e-5).all())
            True
        """
        return pd.DataFrame(
            [
                dict(
                    layer=m.layer,
                    head=m.head,
                    output_error=m.exactness().max_output_error,
                    pattern_error=m.exactness().max_pattern_error,
                )
                for m in self
            ]
        )

    def show(self) -> viz.Group:
        """Draw the most decisive head, then every head's exactness where references exist.

        The decisive head's hidden activations at every destination and the neurons of its last
        destination.

        Returns:
            A ``viz.Group``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> res = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=[0, 2])
            >>> type(res.show()).__name__
            'Group'
        """
        mlp = self.decisive()
        referenced = all(
            m.reference_output is not None and m.reference_pattern is not None for m in self
        )
        return _views.heads_view(
            [mlp.show(), mlp.show(mlp.positions[-1])],
            self.exactness() if referenced else None,
            self.layers,
            self.architecture,
        )
