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
    inputs) is unchanged. Multi-head latent attention (DeepSeek-V2/V3) is the same case with
    ``N(y) = y / rho_q(x)``, the RMS of the query latent (``QueryNorm`` scope ``"latent"``): its
    ``b_i = c k_i'`` are the decoupled keys, ``[k_i^nope ; R_T^T R_i k_i^rope]`` with the rotary
    part shared by every head (docs/math.md §1.7).

    On layers with learned attention sinks (GPT-OSS) ``sink_logit`` is the head's sink: one
    more neuron with pre-activation ``sink_logit``, no incoming weight and outgoing weight
    zero, whose activation is the mass the sink absorbs (``sink_activation``, ``learned_sink``;
    docs/math.md §3.7). The source neurons' activations are the model's pattern row, summing to
    less than one; the output is unchanged by the sink neuron, which writes nothing.

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
    sink_logit: float | None = None

    def __repr__(self) -> str:
        return (f"ContextualMLP({self.architecture}, layer={self.layer}, head={self.head}, "
                f"row={self.row}, positions={self.n_pos}, d_model={self.d_model})")

    # ------------------------------------------------------------------ structure
    @property
    def n_pos(self) -> int:
        return self.x.shape[0]

    @property
    def d_model(self) -> int:
        return self.x.shape[1]

    @property
    def input_space(self) -> str:
        """What the incoming weights ``b_i`` act on: ``"residual"`` (the layer input ``x``,
        ``[d_model]``) or, on qk-norm architectures, ``"query"`` (``queries(x)``, ``[d_head]``)."""
        return "residual" if self.query_norm is None else "query"

    def queries(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_head"]:
        """The head's query before rotary for layer inputs ``x``: ``x W_Q + b_Q``, normalised by
        the model's own query norm on qk-norm architectures. Computed in ``x``'s dtype."""
        q = x @ self.W_Q.to(x.dtype) + self.b_Q.to(x.dtype)
        return q if self.query_norm is None else self.query_norm.apply(q, self.head, x)

    def _inputs(self, x: Tensor) -> Tensor:
        """What ``b_i`` is dotted with: ``x`` itself, or ``queries(x)`` on qk-norm layers."""
        return x if self.query_norm is None else self.queries(x)

    @property
    def positions(self) -> list[int]:
        """Destinations with a real query (padding rows excluded)."""
        return [int(p) for p in torch.nonzero(self.query_valid).flatten()]

    def check_position(self, position: int) -> int:
        """``position`` as a valid destination index (negative counts from the end)."""
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
        """The hidden neurons at ``position``: the source positions its query may attend to."""
        return torch.nonzero(self.allowed[self.check_position(position)]).flatten()

    def query_frame_keys(self, position: int) -> Float[Tensor, "src d_head"]:
        """The allowed keys rotated back into the query's frame at ``position``."""
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
        acts = _core.hidden((b @ inputs + c)[None], self.softcap, self.sink_logit)[0]
        return src, b, c, acts

    # ------------------------------------------------------------------ weights
    def neurons(self, position: int) -> Neurons:
        """``a_i``, ``b_i``, ``c_i`` of every neuron at ``position`` (builds ``b``: ``[n_src, d_model]``,
        or ``[n_src, d_head]`` where ``input_space == "query"``)."""
        pos = self.check_position(position)
        src, b, c, acts = self._weights(pos)
        return Neurons(layer=self.layer, head=self.head, position=pos, sources=src,
                       source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
                       a=self.outgoing[src], b=b.float(), c=c.float(), activations=acts.float(),
                       softcap=self.softcap, sink_logit=self.sink_logit,
                       sink_activation=None if self.sink_logit is None
                       else float(1.0 - acts.sum()))

    def incoming_all(self) -> tuple[Float[Tensor, "pos pos d_in"], Float[Tensor, "pos pos"]]:
        """All incoming weights and biases ``[dest, src, d_in]``, ``[dest, src]`` (zero where not
        allowed; ``d_in`` is ``d_model``, or ``d_head`` where ``input_space == "query"``).
        Memory: ``pos^2 * d_in`` floats; prefer ``neurons(T)`` one destination at a time for
        long prompts."""
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

        ``x`` is ``[d_model]`` or ``[n, d_model]`` in the space the layer's W_Q reads (after the
        layer's input normalisation). Evaluated ``chunk_size`` rows at a time; outputs
        (``[n, d_model]``) are kept only with ``keep_outputs``.
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
        acts, outs, sinks = [], [], []
        for start in range(0, xs.shape[0], chunk_size):
            q = self.queries(xs[start:start + chunk_size].to(WORK_DTYPE))
            pre = _core.preactivations(q, keys, self.scale, bias)
            if self.sink_logit is None:
                h = _core.hidden(pre, self.softcap)
            else:  # the learned-sink neuron, last: activation kept, outgoing weight zero
                full = _core.with_sink(pre, self.softcap, self.sink_logit)
                h = full[:, :-1]
                sinks.append(full[:, -1].float())
            acts.append(h.float())
            if keep_outputs:
                outs.append(_core.output(h, a).float())
        h = torch.cat(acts)
        return Evaluation(
            layer=self.layer, head=self.head, position=pos, sources=src,
            source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
            activations=h, outputs=torch.cat(outs) if keep_outputs else None,
            winners=src[h.argmax(-1)], labels=tuple(labels) if labels is not None else
            tuple(f"x{i}" for i in range(h.shape[0])),
            sink=torch.cat(sinks) if sinks else None)

    def activations(self, position: int) -> Float[Tensor, " src"]:
        """Hidden activations at the real query input (the pattern row over ``sources``)."""
        return self.evaluate(self.x[self.check_position(position)], position,
                             keep_outputs=False).activations[0]

    def sink_activation(self, position: int) -> float:
        """The learned-sink neuron's activation at the real query input of ``position``: the
        mass the head's learned sink absorbs there (0.0 on layers without one)."""
        ev = self.evaluate(self.x[self.check_position(position)], position, keep_outputs=False)
        return 0.0 if ev.sink is None else float(ev.sink[0])

    def learned_sink(self) -> Float[Tensor, " pos"]:
        """``sink_activation`` at every real destination (zero on padding and on layers
        without a learned sink)."""
        out = torch.zeros(self.n_pos, device=self.x.device)
        if self.sink_logit is not None:
            for pos in self.positions:
                out[pos] = self.sink_activation(pos)
        return out

    def output(self, position: int) -> Float[Tensor, " d_model"]:
        """``g(x_T)``: the head's output at ``position`` (before ``b_O``)."""
        outputs = self.evaluate(self.x[self.check_position(position)], position).outputs
        if outputs is None:  # evaluate keeps the outputs unless told not to
            raise RuntimeError("ContextualMLP.evaluate returned no outputs")
        return outputs[0]

    def pattern(self) -> Float[Tensor, "pos pos"]:
        """Activations at the real inputs for every destination, as a ``[dest, src]`` pattern."""
        out = torch.zeros(self.n_pos, self.n_pos, device=self.x.device)
        for pos in self.positions:
            out[pos, self.sources(pos)] = self.activations(pos)
        return out

    def importance(self, position: int) -> Float[Tensor, " src"]:
        """``activation_i * |a_i|`` at the real query input of ``position``: how much of the
        head's output each source can carry (docs/math.md §3.5). Use it, not ``winner``, to
        say which source drives what the head writes (a sink can take the attention and write
        almost nothing)."""
        return _core.importance(self.activations(position), self.outgoing[self.sources(position)])

    def winner(self, position: int) -> int:
        """The source position of the most active neuron at the real query input: where the
        head looks (the pattern row's argmax). For which source drives the output, use
        ``importance`` (docs/math.md §3.5)."""
        return int(self.sources(position)[self.activations(position).argmax()])

    # ------------------------------------------------------------------ counterfactuals, read-outs
    def evaluate_tokens(self, adapter: "ModelAdapter", tokens, position: int,
                        normalise: _readout.Normalise = "match") -> Evaluation:
        """The MLP of ``position`` on the (normalised) embeddings of ``tokens``
        (see ``contextual_mlp.evaluate_tokens``)."""
        return _readout.evaluate_tokens(self, adapter, tokens, position, normalise)

    def evaluate_vocab(self, adapter: "ModelAdapter", position: int,
                       normalise: _readout.Normalise = "match",
                       chunk_size: int = DEFAULT_CHUNK, keep_outputs: bool = False) -> Evaluation:
        """The MLP of ``position`` on every vocabulary token, in chunks."""
        return _readout.evaluate_vocab(self, adapter, position, normalise, chunk_size, keep_outputs)

    def written_tokens(self, adapter: "ModelAdapter", position: int | None = None,
                       k: int = 10) -> "_readout.Readout":
        """Tokens each neuron's ``a_i`` writes, read through the unembedding."""
        return _readout.written_tokens(self, adapter, position, k)

    def read_tokens(self, adapter: "ModelAdapter", position: int, k: int = 10,
                    normalise: _readout.Normalise = "match") -> "_readout.Readout":
        """Tokens whose query input switches each neuron of ``position`` on (``b_i`` vs ``W_E``)."""
        return _readout.read_tokens(self, adapter, position, k, normalise)

    # ------------------------------------------------------------------ checks and views
    def exactness(self) -> Exactness:
        """Compare, at every real destination, the MLP built from explicit ``(a_i, b_i, c_i)``
        with the model's own head output (``z_h W_O[h]``) and pattern row."""
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
        """One row per (destination, neuron): activation, importance, ``|a_i|``, ``|b_i|``, ``c_i``."""
        frames = [self.neurons(p).to_dataframe() for p in (positions or self.positions)]
        return pd.concat(frames, ignore_index=True)

    def save(self, path: str | os.PathLike) -> Path:
        """Write this MLP (tensors and provenance) to ``path``: safetensors tensors plus a JSON
        description (no pickle, so loading runs no code), written atomically."""
        return _files.save(self, path, SAVE_FORMAT)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ContextualMLP":
        """Read an MLP written by ``save``; refuses pickles (the old ``torch.save`` format,
        /2 and before) without unpickling them."""
        return _files.load(path, SAVE_FORMAT)

    def show(self, position: int | None = None) -> viz.Group:
        """Neurons = source tokens. Without ``position``: every destination's hidden activations
        (``text_neuron_activations``); with it: that destination's neurons and their importance."""
        name = f"L{self.layer}H{self.head}"
        if position is None:
            return _views.mlp_view(name, list(self.str_tokens), self.pattern(),
                                   None if self.sink_logit is None else self.learned_sink())
        pos = self.check_position(position)
        neurons = self.neurons(pos)
        importance = torch.zeros(self.n_pos, device=self.x.device)
        importance[neurons.sources] = neurons.importance
        return _views.destination_view(name, list(self.str_tokens), pos, importance,
                                       neurons.to_dataframe())
