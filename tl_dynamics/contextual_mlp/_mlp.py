"""``ContextualMLP``: one head of one prompt, written as an MLP per destination position."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import QueryNorm
from tl_dynamics.contextual_mlp import _core, _files, _readout, _views
from tl_dynamics.contextual_mlp._frame import RotaryFrame
from tl_dynamics.contextual_mlp._results import Evaluation, Exactness, Neurons
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import ModelAdapter

# /3: safetensors tensors + a JSON description (no pickle); /2 and /1 (torch.save pickles) are
# refused without being unpickled.
SAVE_FORMAT = "tl_dynamics.contextual_mlp/3"
# The MLP is evaluated in float64 from the float32 activations: its error against the model is
# then the model's own float32 rounding alone (on a d_model=256 GPT-2 shape at 512 tokens: max
# 6.8e-6 against 1.1e-5 when evaluated in float32). Results are returned in float32.
WORK_DTYPE = torch.float64
DEFAULT_CHUNK = 4096  # query inputs evaluated at once: chunk x (n_src + d_head + d_model) floats


@_files.register
@dataclass(frozen=True)
class ContextualMLP:
    """Head ``head`` of layer ``layer`` on one prompt row, as a contextual MLP per destination.

    Stored (memory ``O(pos * (d_model + d_head) + pos^2)`` floats): the query inputs ``x``, the
    scored keys, the outgoing weights ``a_i = v_i W_O`` (independent of the destination), the
    head's ``W_Q``/``b_Q``, masks and position bias, and the rotary frame. The incoming weights
    ``b_i`` (``[n_src, d_model]`` per destination) are built only by ``neurons(T)`` or, for all
    destinations at once (``[pos, pos, d_model]``), by ``incoming_all()``; evaluation never
    forms them.

    On qk-norm architectures (Gemma 3, OLMo 2) the query is ``N(x W_Q + b_Q)`` for the model's
    own normalisation ``N`` (``query_norm``), not a linear function of ``x``. There the MLP's
    input layer is that fixed map: ``input_space == "query"``, the incoming weights
    ``b_i = c k_i'`` are ``[n_src, d_head]`` and act on ``queries(x)``, and ``c_i = p_iT``.
    Everything else (outgoing weights, activations, exactness, counterfactuals on residual
    inputs) is unchanged.

    Attributes:
        layer: the head's layer.
        head: the head's index.
        row: the prompt row of the batch.
        architecture: the model's architecture name.
        tokens: token ids ``[pos]`` (None without them).
        str_tokens: the prompt's token strings.
        x: query inputs ``[pos, d_model]`` (the layer input after its normalisation).
        keys: scored keys ``[pos, d_head]`` (rotated, on rotary layers).
        outgoing: outgoing weights ``a_i = v_i W_O``, ``[pos, d_model]``.
        W_Q: the head's ``[d_model, d_head]`` query weights.
        b_Q: the head's ``[d_head]`` query bias.
        scale: the score scale ``c``.
        softcap: the layer's score soft-cap, or None.
        allowed: ``[pos, pos]`` which sources each destination may attend to.
        query_valid: ``[pos]`` real (non-padding) destinations.
        bias: position bias ``[pos, pos]`` (ALiBi), or None.
        frame: the rotary frame that rotates keys into each query's frame.
        reference_pattern: the model's own pattern ``[pos, pos]`` (with ``reference=True``).
        reference_output: the model's own head output ``[pos, d_model]`` (idem).
        query_norm: the model's query normalisation on qk-norm layers, or None.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
        >>> n = mlp.neurons(3)                      # the MLP at destination 3: 4 neurons
        >>> n.a.shape, n.b.shape, n.c.shape
        (torch.Size([4, 64]), torch.Size([4, 64]), torch.Size([4]))
        >>> bool((mlp.evaluate(mlp.x[3], 3).outputs[0] - mlp.output(3)).abs().max() < 1e-5)
        True
    """

    layer: int
    head: int
    row: int
    architecture: str
    tokens: Int[Tensor, " pos"] | None
    str_tokens: tuple[str, ...]
    x: Float[Tensor, "pos d_model"]
    keys: Float[Tensor, "pos d_head"]
    outgoing: Float[Tensor, "pos d_model"]
    W_Q: Float[Tensor, "d_model d_head"]
    b_Q: Float[Tensor, " d_head"]
    scale: float
    softcap: float | None
    allowed: Bool[Tensor, "pos pos"]
    query_valid: Bool[Tensor, " pos"]
    bias: Float[Tensor, "pos pos"] | None
    frame: RotaryFrame
    reference_pattern: Float[Tensor, "pos pos"] | None = None
    reference_output: Float[Tensor, "pos d_model"] | None = None
    query_norm: QueryNorm | None = None

    def __repr__(self) -> str:
        return (f"ContextualMLP({self.architecture}, layer={self.layer}, head={self.head}, "
                f"row={self.row}, positions={self.n_pos}, d_model={self.d_model})")

    # ------------------------------------------------------------------ structure
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
            raise TLDynamicsError(f"position {position} is out of range: this prompt has "
                                  f"{self.n_pos} positions (valid: 0..{self.n_pos - 1} or "
                                  f"-{self.n_pos}..-1)")
        if not bool(self.query_valid[pos]):
            raise TLDynamicsError(f"position {position} is padding (its query attends nowhere); "
                                  f"valid destinations: {self.positions}")
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
            b, c = _core.incoming_weights(self.W_Q.to(WORK_DTYPE), self.b_Q.to(WORK_DTYPE), keys,
                                          self.scale, bias)
        else:  # b_i act on the normalised query: b_i = c k_i', c_i = p_iT
            b = self.scale * keys
            c = torch.zeros(len(src), dtype=WORK_DTYPE, device=keys.device) if bias is None else bias
        inputs = self._inputs(self.x[pos].to(WORK_DTYPE)[None])[0]
        acts = _core.hidden((b @ inputs + c)[None], self.softcap)[0]
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
        return Neurons(layer=self.layer, head=self.head, position=pos, sources=src,
                       source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
                       a=self.outgoing[src], b=b.float(), c=c.float(), activations=acts.float(),
                       softcap=self.softcap)

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

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, x: Float[Tensor, "... d_model"], position: int,
                 chunk_size: int = DEFAULT_CHUNK, keep_outputs: bool = True,
                 labels: list[str] | None = None) -> Evaluation:
        """Run the MLP of ``position`` (its context fixed) on arbitrary query inputs ``x``.

        ``x`` is in the space the layer's W_Q reads (after the layer's input normalisation).
        Evaluated ``chunk_size`` rows at a time.

        Args:
            x: query inputs ``[d_model]`` or ``[n, d_model]``.
            position: the destination whose context (sources, keys) is used.
            chunk_size: rows evaluated at once.
            keep_outputs: keep the outputs ``[n, d_model]`` (else only activations).
            labels: a name per input row (default ``x0, x1, ...``).

        Returns:
            ``Evaluation``: activations ``[n, src]``, outputs ``[n, d_model]`` (or None) and the
            winning source per input ``[n]``.

        Example:
            >>> import torch
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> ev = mlp.evaluate(torch.randn(5, 64), 3)
            >>> ev.activations.shape, ev.outputs.shape, ev.winners.shape
            (torch.Size([5, 4]), torch.Size([5, 64]), torch.Size([5]))
        """
        pos = self.check_position(position)
        xs = torch.as_tensor(x, dtype=torch.float32)
        xs = xs[None] if xs.ndim == 1 else xs
        if xs.ndim != 2 or xs.shape[1] != self.d_model:
            raise TLDynamicsError(f"query inputs must be [d_model] or [n, d_model] with d_model="
                                  f"{self.d_model}, got {tuple(torch.as_tensor(x).shape)}")
        if chunk_size < 1:
            raise TLDynamicsError(f"chunk_size must be >= 1, got {chunk_size}")
        src = self.sources(pos)
        keys, bias = self._keys(pos), self._bias(pos, src)
        a = self.outgoing[src].to(WORK_DTYPE)
        acts, outs = [], []
        for start in range(0, xs.shape[0], chunk_size):
            q = self.queries(xs[start:start + chunk_size].to(WORK_DTYPE))
            h = _core.hidden(_core.preactivations(q, keys, self.scale, bias), self.softcap)
            acts.append(h.float())
            if keep_outputs:
                outs.append(_core.output(h, a).float())
        h = torch.cat(acts)
        return Evaluation(
            layer=self.layer, head=self.head, position=pos, sources=src,
            source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
            activations=h, outputs=torch.cat(outs) if keep_outputs else None,
            winners=src[h.argmax(-1)], labels=tuple(labels) if labels is not None else
            tuple(f"x{i}" for i in range(h.shape[0])))

    def activations(self, position: int) -> Float[Tensor, " src"]:
        """Hidden activations at the real query input (the pattern row over ``sources``).

        Args:
            position: a destination (negative counts from the end).

        Returns:
            Activations ``[src]``, summing to one (without learned sinks).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> acts = mlp.activations(3)
            >>> acts.shape, round(float(acts.sum()), 5)
            (torch.Size([4]), 1.0)
        """
        return self.evaluate(self.x[self.check_position(position)], position,
                             keep_outputs=False).activations[0]

    def output(self, position: int) -> Float[Tensor, " d_model"]:
        """``g(x_T)``: the head's output at ``position`` (before ``b_O``).

        Args:
            position: a destination (negative counts from the end).

        Returns:
            The output ``[d_model]``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> bool((mlp.output(3) - mlp.reference_output[3]).abs().max() < 1e-5)  # the model's
            True
        """
        outputs = self.evaluate(self.x[self.check_position(position)], position).outputs
        if outputs is None:  # evaluate keeps the outputs unless told not to
            raise RuntimeError("ContextualMLP.evaluate returned no outputs")
        return outputs[0]

    def pattern(self) -> Float[Tensor, "pos pos"]:
        """Activations at the real inputs for every destination, as a ``[dest, src]`` pattern.

        Returns:
            The pattern ``[pos, pos]`` (zero off the allowed sources).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> bool((mlp.pattern() - mlp.reference_pattern).abs().max() < 1e-5)  # the model's
            True
        """
        out = torch.zeros(self.n_pos, self.n_pos, device=self.x.device)
        for pos in self.positions:
            out[pos, self.sources(pos)] = self.activations(pos)
        return out

    def importance(self, position: int) -> Float[Tensor, " src"]:
        """How much of the head's output each source can carry: ``activation_i * |a_i|``.

        At the real query input of ``position`` (docs/math.md §3.5). Use it, not ``winner``, to say
        which source drives what the head writes (a sink can take the attention and write almost
        nothing).

        Args:
            position: a destination (negative counts from the end).

        Returns:
            Importance ``[src]`` (non-negative).

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> imp = mlp.importance(3)
            >>> imp.shape, bool((imp >= 0).all())
            (torch.Size([4]), True)
        """
        return _core.importance(self.activations(position), self.outgoing[self.sources(position)])

    def winner(self, position: int) -> int:
        """The source position of the most active neuron at the real query input.

        Where the head looks (the pattern row's argmax). For which source drives the output, use
        ``importance`` (docs/math.md §3.5).

        Args:
            position: a destination (negative counts from the end).

        Returns:
            The winning source position.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.winner(3) == int(mlp.pattern()[3].argmax())
            True
        """
        return int(self.sources(position)[self.activations(position).argmax()])

    # ------------------------------------------------------------------ counterfactuals, read-outs
    def evaluate_tokens(self, adapter: "ModelAdapter", tokens, position: int,
                        normalise: _readout.Normalise = "match") -> Evaluation:
        """The MLP of ``position`` on the (normalised) embeddings of ``tokens``.

        Each token's query input is its embedding (plus the destination's learned position), scaled to
        the norm of the real input with ``normalise="match"``.

        Args:
            adapter: the model's ``ModelAdapter``.
            tokens: token ids ``[n]``.
            position: the destination whose context is used.
            normalise: ``"match"`` (the real input's norm) or ``"none"``.

        Returns:
            ``Evaluation`` with activations ``[n, src]`` and outputs ``[n, d_model]``.

        Example:
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.evaluate_tokens(ModelAdapter.of(testing.tiny_model("gpt2")), [5, 6], 3).activations.shape
            torch.Size([2, 4])
        """
        return _readout.evaluate_tokens(self, adapter, tokens, position, normalise)

    def evaluate_vocab(self, adapter: "ModelAdapter", position: int,
                       normalise: _readout.Normalise = "match",
                       chunk_size: int = DEFAULT_CHUNK, keep_outputs: bool = False) -> Evaluation:
        """The MLP of ``position`` on every vocabulary token, in chunks.

        Memory: ``vocab * n_src`` activations (plus ``vocab * d_model`` with ``keep_outputs``).
        Labels are token ids as strings.

        Args:
            adapter: the model's ``ModelAdapter``.
            position: the destination whose context is used.
            normalise: ``"match"`` (the real input's norm) or ``"none"``.
            chunk_size: tokens evaluated at once.
            keep_outputs: keep the outputs ``[d_vocab, d_model]``.

        Returns:
            ``Evaluation`` with activations ``[d_vocab, src]``.

        Example:
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.evaluate_vocab(ModelAdapter.of(testing.tiny_model("gpt2")), 3).activations.shape
            torch.Size([512, 4])
        """
        return _readout.evaluate_vocab(self, adapter, position, normalise, chunk_size, keep_outputs)

    def written_tokens(self, adapter: "ModelAdapter", position: int | None = None,
                       k: int = 10) -> "_readout.Readout":
        """Tokens each neuron's ``a_i`` writes, read through the unembedding.

        Every key position is a neuron (``a_i`` does not depend on the destination) unless
        ``position`` restricts to that destination's neurons.

        Args:
            adapter: the model's ``ModelAdapter``.
            position: a destination, or None (every source).
            k: tokens per side (top and bottom).

        Returns:
            ``Readout`` (``kind="writes"``): top and bottom ``k`` tokens per source.

        Example:
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> out = mlp.written_tokens(ModelAdapter.of(testing.tiny_model("gpt2")), 3, k=3)
            >>> out.kind, out.sources.tolist()
            ('writes', [0, 1, 2, 3])
        """
        return _readout.written_tokens(self, adapter, position, k)

    def read_tokens(self, adapter: "ModelAdapter", position: int, k: int = 10,
                    normalise: _readout.Normalise = "match") -> "_readout.Readout":
        """Tokens whose query input switches each neuron of ``position`` on (``b_i`` vs ``W_E``).

        The pre-activation ``b_i . x(tok) + c_i`` over the whole vocabulary, in chunks.

        Args:
            adapter: the model's ``ModelAdapter``.
            position: a destination.
            k: tokens per side (top and bottom).
            normalise: ``"match"`` (the real input's norm) or ``"none"``.

        Returns:
            ``Readout`` (``kind="reads"``): top and bottom ``k`` tokens per neuron.

        Example:
            >>> from tl_dynamics.adapter import ModelAdapter
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> out = mlp.read_tokens(ModelAdapter.of(testing.tiny_model("gpt2")), 3, k=3)
            >>> out.kind, out.position
            ('reads', 3)
        """
        return _readout.read_tokens(self, adapter, position, k, normalise)

    # ------------------------------------------------------------------ checks and views
    def exactness(self) -> Exactness:
        """Compare the explicit MLP with the model's own head output and pattern row.

        At every real destination, the MLP built from explicit ``(a_i, b_i, c_i)`` against
        ``z_h W_O[h]`` and the model's pattern (needs ``reference=True``).

        Returns:
            ``Exactness``: ``output_error`` and ``pattern_error`` ``[positions]`` (max absolute
            errors), with their maxima.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.exactness().max_output_error < 1e-5
            True
        """
        if self.reference_output is None or self.reference_pattern is None:
            raise TLDynamicsError("this ContextualMLP holds no reference activations; build it "
                                  "with reference=True to check exactness")
        positions = self.positions
        out_err, pat_err = torch.zeros(len(positions)), torch.zeros(len(positions))
        for n, pos in enumerate(positions):
            src, b, c, acts = self._weights(pos)  # explicit b_i . x_T + c_i
            g = acts @ self.outgoing[src].to(WORK_DTYPE)
            row = torch.zeros(self.n_pos, dtype=WORK_DTYPE, device=self.x.device)
            row[src] = acts
            out_err[n] = (g - self.reference_output[pos]).abs().max()
            pat_err[n] = (row - self.reference_pattern[pos]).abs().max()
        return Exactness(layer=self.layer, head=self.head, architecture=self.architecture,
                         positions=tuple(positions), output_error=out_err, pattern_error=pat_err)

    def to_dataframe(self, positions: list[int] | None = None) -> pd.DataFrame:
        """One row per (destination, neuron): activation, importance, ``|a_i|``, ``|b_i|``, ``c_i``.

        Args:
            positions: destinations to include (None: all real ones).

        Returns:
            A pandas DataFrame with columns ``layer, head, position, source, token, activation,
            importance, a_norm, b_norm, c``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.to_dataframe([3]).shape  # 4 neurons at destination 3
            (4, 10)
        """
        frames = [self.neurons(p).to_dataframe() for p in (positions or self.positions)]
        return pd.concat(frames, ignore_index=True)

    def save(self, path: str | os.PathLike) -> Path:
        """Write this MLP (tensors and provenance) to ``path``, atomically.

        Safetensors tensors plus a JSON description (no pickle, so loading runs no code).

        Args:
            path: the file to write (e.g. ``"mlp.safetensors"``).

        Returns:
            The written path.

        Example:
            >>> import tempfile, pathlib, torch
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     back = contextual_mlp.ContextualMLP.load(mlp.save(pathlib.Path(tmp) / "m.safetensors"))
            >>> torch.equal(back.x, mlp.x), back.str_tokens == mlp.str_tokens
            (True, True)
        """
        return _files.save(self, path, SAVE_FORMAT)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ContextualMLP":
        """Read an MLP written by ``save``.

        Refuses pickles (the old ``torch.save`` format, /2 and before) without unpickling them.

        Args:
            path: a file written by ``ContextualMLP.save``.

        Returns:
            The ``ContextualMLP``, every tensor bit for bit.

        Example:
            >>> import tempfile, pathlib
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     path = mlp.save(pathlib.Path(tmp) / "m.safetensors")
            ...     back = contextual_mlp.ContextualMLP.load(path)
            >>> (back.layer, back.head, back.n_pos)
            (1, 0, 7)
        """
        return _files.load(path, SAVE_FORMAT)

    def show(self, position: int | None = None) -> viz.Group:
        """Draw the MLP: neurons are source tokens.

        Without ``position``: every destination's hidden activations
        (``text_neuron_activations``); with it: that destination's neurons and their importance.

        Args:
            position: a destination, or None (all).

        Returns:
            A ``viz.Group``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> type(mlp.show()).__name__, type(mlp.show(3)).__name__
            ('Group', 'Group')
        """
        name = f"L{self.layer}H{self.head}"
        if position is None:
            return _views.mlp_view(name, list(self.str_tokens), self.pattern())
        pos = self.check_position(position)
        neurons = self.neurons(pos)
        importance = torch.zeros(self.n_pos, device=self.x.device)
        importance[neurons.sources] = neurons.importance
        return _views.destination_view(name, list(self.str_tokens), pos, importance,
                                       neurons.to_dataframe())
