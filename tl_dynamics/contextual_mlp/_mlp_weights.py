"""``ContextualMLP``'s weights: its query map, the keys in each query's frame and the neurons
``(a_i, b_i, c_i)`` of each destination (a base class of ``ContextualMLP``, which holds the
fields these read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.contextual_mlp import _core
from tl_dynamics.contextual_mlp._results import Neurons

if TYPE_CHECKING:
    from tl_dynamics.adapter import QueryNorm
    from tl_dynamics.contextual_mlp._frame import RotaryFrame

# The MLP is evaluated in float64 from the float32 activations: its error against the model is
# then the model's own float32 rounding alone (on a d_model=256 GPT-2 shape at 512 tokens: max
# 6.8e-6 against 1.1e-5 when evaluated in float32). Results are returned in float32.
WORK_DTYPE = torch.float64


class MLPWeights:
    """The query map, frame keys and neurons of a ``ContextualMLP`` (its base class)."""

    if TYPE_CHECKING:  # fields and methods of ContextualMLP
        layer: int
        head: int
        str_tokens: tuple[str, ...]
        x: Float[Tensor, "pos d_model"]
        keys: Float[Tensor, "pos d_head"]
        outgoing: Float[Tensor, "pos d_model"]
        W_Q: Float[Tensor, "d_model d_head"]
        b_Q: Float[Tensor, " d_head"]
        scale: float
        softcap: float | None
        allowed: Bool[Tensor, "pos pos"]
        bias: Float[Tensor, "pos pos"] | None
        frame: RotaryFrame
        query_norm: QueryNorm | None
        sink_logit: float | None
        n_pos: int
        d_model: int
        positions: list[int]

        def check_position(self, position: int) -> int: ...
        def sources(self, position: int) -> Int[Tensor, " src"]: ...

    # ------------------------------------------------------------------ structure

    def queries(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_head"]:
        """The head's query before rotary for layer inputs ``x``: ``x W_Q + b_Q``.

        Normalised by the model's own query norm on qk-norm architectures. Computed in ``x``'s dtype.

        Args:
            x: layer inputs ``[n, d_model]``.

        Returns:
            Queries ``[n, d_head]``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.queries(mlp.x).shape
            torch.Size([7, 16])
        """
        q = x @ self.W_Q.to(x.dtype) + self.b_Q.to(x.dtype)
        return q if self.query_norm is None else self.query_norm.apply(q, self.head, x)

    def _inputs(self, x: Tensor) -> Tensor:
        """What ``b_i`` is dotted with: ``x`` itself, or ``queries(x)`` on qk-norm layers."""
        return x if self.query_norm is None else self.queries(x)

    def query_frame_keys(self, position: int) -> Float[Tensor, "src d_head"]:
        """The allowed keys rotated back into the query's frame at ``position``.

        Args:
            position: a destination (negative counts from the end).

        Returns:
            Keys ``[src, d_head]`` (float32).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.query_frame_keys(2).shape
            torch.Size([3, 16])
        """
        return self._keys(self.check_position(position)).float()

    def _keys(self, pos: int) -> Tensor:
        return self.frame.to_query_frame(self.keys[self.sources(pos)].to(WORK_DTYPE), pos)

    def _bias(self, pos: int, src: Tensor) -> Tensor | None:
        return None if self.bias is None else self.bias[pos, src].to(WORK_DTYPE)

    def _weights(self, pos: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(sources, b, c, activations at x_T)`` in ``WORK_DTYPE``."""
        src = self.sources(pos)
        keys, bias = self._keys(pos), self._bias(pos, src)
        if self.query_norm is None:
            b, c = _core.incoming_weights(
                self.W_Q.to(WORK_DTYPE), self.b_Q.to(WORK_DTYPE), keys, self.scale, bias
            )
        else:  # b_i act on the normalised query: b_i = c k_i', c_i = p_iT
            b = self.scale * keys
            c = (
                torch.zeros(len(src), dtype=WORK_DTYPE, device=keys.device)
                if bias is None
                else bias
            )
        inputs = self._inputs(self.x[pos].to(WORK_DTYPE)[None])[0]
        acts = _core.hidden((b @ inputs + c)[None], self.softcap, self.sink_logit)[0]
        return src, b, c, acts

    # ------------------------------------------------------------------ weights

    def neurons(self, position: int) -> Neurons:
        """The weights ``a_i``, ``b_i``, ``c_i`` of every neuron at ``position``.

        Builds ``b``: ``[n_src, d_model]``, or ``[n_src, d_head]`` where
        ``input_space == "query"``.

        Args:
            position: a destination (negative counts from the end).

        Returns:
            ``Neurons``: ``a`` ``[src, d_model]``, ``b`` ``[src, d_in]``, ``c`` ``[src]``, the
            activations ``[src]`` at the real input, the sources and their tokens.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> n = mlp.neurons(3)
            >>> n.a.shape, n.b.shape, n.sources.tolist()
            (torch.Size([4, 64]), torch.Size([4, 64]), [0, 1, 2, 3])
        """
        pos = self.check_position(position)
        src, b, c, acts = self._weights(pos)
        return Neurons(
            layer=self.layer,
            head=self.head,
            position=pos,
            sources=src,
            source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
            a=self.outgoing[src],
            b=b.float(),
            c=c.float(),
            activations=acts.float(),
            softcap=self.softcap,
            sink_logit=self.sink_logit,
            sink_activation=None if self.sink_logit is None else float(1.0 - acts.sum()),
        )

    def incoming_all(self) -> tuple[Float[Tensor, "pos pos d_in"], Float[Tensor, "pos pos"]]:
        """All incoming weights and biases, for every destination at once.

        Zero where not allowed; ``d_in`` is ``d_model``, or ``d_head`` where
        ``input_space == "query"``. Memory: ``pos^2 * d_in`` floats; prefer ``neurons(T)`` one
        destination at a time for long prompts.

        Returns:
            ``(b, c)``: ``b`` ``[dest, src, d_in]`` and ``c`` ``[dest, src]``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> b, c = mlp.incoming_all()
            >>> b.shape, c.shape
            (torch.Size([7, 7, 64]), torch.Size([7, 7]))
        """
        d_in = self.d_model if self.query_norm is None else self.W_Q.shape[1]
        b_all = torch.zeros(self.n_pos, self.n_pos, d_in, device=self.x.device)
        c_all = torch.zeros(self.n_pos, self.n_pos, device=self.x.device)
        for pos in self.positions:
            n = self.neurons(pos)
            b_all[pos, n.sources], c_all[pos, n.sources] = n.b, n.c
        return b_all, c_all
