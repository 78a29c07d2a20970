"""``ContextualMLP``'s shape and positions: sizes, destinations and each destination's sources
(a base class of ``ContextualMLP``, which holds the fields these read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import QueryNorm


class MLPShape:
    """Sizes and valid positions of a ``ContextualMLP`` (its base class)."""

    if TYPE_CHECKING:  # fields of the ContextualMLP dataclass
        x: Float[Tensor, "pos d_model"]
        allowed: Bool[Tensor, "pos pos"]
        query_valid: Bool[Tensor, " pos"]
        query_norm: QueryNorm | None

    @property
    def n_pos(self) -> int:
        """Number of positions of the prompt row (padding included).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.n_pos, len(mlp.str_tokens)  # <|endoftext|> a = b + c
            (7, 7)
        """
        return self.x.shape[0]

    @property
    def d_model(self) -> int:
        """Width of the residual stream (the MLP's input and output size).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.d_model
            64
        """
        return self.x.shape[1]

    @property
    def input_space(self) -> str:
        """What the incoming weights ``b_i`` act on: ``"residual"`` or ``"query"``.

        ``"residual"``: the layer input ``x`` (``[d_model]``); on qk-norm architectures
        ``"query"``: ``queries(x)`` (``[d_head]``).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.input_space
            'residual'
        """
        return "residual" if self.query_norm is None else "query"

    @property
    def positions(self) -> list[int]:
        """Destinations with a real query (padding rows excluded).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.positions
            [0, 1, 2, 3, 4, 5, 6]
        """
        return [int(p) for p in torch.nonzero(self.query_valid).flatten()]

    def check_position(self, position: int) -> int:
        """``position`` as a valid destination index (negative counts from the end).

        Args:
            position: a destination index, negative from the end.

        Returns:
            The index in ``0..n_pos - 1``; a padding or out-of-range position raises
            ``TLDynamicsError``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.check_position(-1)
            6
        """
        if isinstance(position, bool) or not isinstance(position, int):
            raise TLDynamicsError(f"position must be an int, got {position!r}")
        pos = position + self.n_pos if position < 0 else position
        if not 0 <= pos < self.n_pos:
            raise TLDynamicsError(
                f"position {position} is out of range: this prompt has "
                f"{self.n_pos} positions (valid: 0..{self.n_pos - 1} or "
                f"-{self.n_pos}..-1)"
            )
        if not bool(self.query_valid[pos]):
            raise TLDynamicsError(
                f"position {position} is padding (its query attends nowhere); "
                f"valid destinations: {self.positions}"
            )
        return pos

    def sources(self, position: int) -> Int[Tensor, " src"]:
        """The hidden neurons at ``position``: the source positions its query may attend to.

        Args:
            position: a destination (negative counts from the end).

        Returns:
            Source positions ``[src]``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.sources(2).tolist()  # causal: positions 0..2
            [0, 1, 2]
        """
        return torch.nonzero(self.allowed[self.check_position(position)]).flatten()
