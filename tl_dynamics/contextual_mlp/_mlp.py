"""``ContextualMLP``: one head of one prompt, written as an MLP per destination position."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.adapter import QueryNorm
from tl_dynamics.contextual_mlp import _core, _files
from tl_dynamics.contextual_mlp._frame import RotaryFrame
from tl_dynamics.contextual_mlp._mlp_readouts import DEFAULT_CHUNK, MLPReadouts
from tl_dynamics.contextual_mlp._mlp_readouts import SAVE_FORMAT as SAVE_FORMAT
from tl_dynamics.contextual_mlp._mlp_shape import MLPShape
from tl_dynamics.contextual_mlp._mlp_weights import WORK_DTYPE, MLPWeights
from tl_dynamics.contextual_mlp._results import Evaluation, Exactness
from tl_dynamics.errors import TLDynamicsError


@_files.register
@dataclass(frozen=True)
class ContextualMLP(MLPShape, MLPWeights, MLPReadouts):
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

    Attributes:
        layer, head, row: the head and the prompt row; architecture: the model's name.
        tokens, str_tokens: the row's token ids ``[pos]`` (or None) and strings.
        x: query inputs ``[pos, d_model]`` (the layer input after its normalisation).
        keys: scored keys ``[pos, d_head]``; outgoing: ``a_i = v_i W_O``, ``[pos, d_model]``.
        W_Q, b_Q: the head's ``[d_model, d_head]`` and ``[d_head]`` query weights.
        scale, softcap: the score scale ``c`` and the layer's soft-cap (or None).
        allowed, query_valid: ``[pos, pos]`` allowed sources, ``[pos]`` real destinations.
        bias: position bias ``[pos, pos]`` (ALiBi) or None; frame: the rotary frame.
        reference_pattern, reference_output: the model's own ``[pos, pos]`` pattern and
            ``[pos, d_model]`` head output (``reference=True``).
        query_norm: the model's query normalisation on qk-norm layers, or None.
        sink_logit: the head's learned sink logit (GPT-OSS), or None.

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
        return (
            f"ContextualMLP({self.architecture}, layer={self.layer}, head={self.head}, "
            f"row={self.row}, positions={self.n_pos}, d_model={self.d_model})"
        )

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self,
        x: Float[Tensor, "... d_model"],
        position: int,
        chunk_size: int = DEFAULT_CHUNK,
        keep_outputs: bool = True,
        labels: list[str] | None = None,
    ) -> Evaluation:
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
            raise TLDynamicsError(
                f"query inputs must be [d_model] or [n, d_model] with d_model="
                f"{self.d_model}, got {tuple(torch.as_tensor(x).shape)}"
            )
        if chunk_size < 1:
            raise TLDynamicsError(f"chunk_size must be >= 1, got {chunk_size}")
        src = self.sources(pos)
        keys, bias = self._keys(pos), self._bias(pos, src)
        a = self.outgoing[src].to(WORK_DTYPE)
        acts, outs, sinks = [], [], []
        for start in range(0, xs.shape[0], chunk_size):
            q = self.queries(xs[start : start + chunk_size].to(WORK_DTYPE))
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
            layer=self.layer,
            head=self.head,
            position=pos,
            sources=src,
            source_tokens=tuple(self.str_tokens[i] for i in src.tolist()),
            activations=h,
            outputs=torch.cat(outs) if keep_outputs else None,
            winners=src[h.argmax(-1)],
            labels=tuple(labels)
            if labels is not None
            else tuple(f"x{i}" for i in range(h.shape[0])),
            sink=torch.cat(sinks) if sinks else None,
        )

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
        return self.evaluate(
            self.x[self.check_position(position)], position, keep_outputs=False
        ).activations[0]

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
            raise TLDynamicsError(
                "this ContextualMLP holds no reference activations; build it "
                "with reference=True to check exactness"
            )
        positions = self.positions
        out_err, pat_err = torch.zeros(len(positions)), torch.zeros(len(positions))
        for n, pos in enumerate(positions):
            src, b, c, acts = self._weights(pos)  # explicit b_i . x_T + c_i
            g = acts @ self.outgoing[src].to(WORK_DTYPE)
            row = torch.zeros(self.n_pos, dtype=WORK_DTYPE, device=self.x.device)
            row[src] = acts
            out_err[n] = (g - self.reference_output[pos]).abs().max()
            pat_err[n] = (row - self.reference_pattern[pos]).abs().max()
        return Exactness(
            layer=self.layer,
            head=self.head,
            architecture=self.architecture,
            positions=tuple(positions),
            output_error=out_err,
            pattern_error=pat_err,
        )
