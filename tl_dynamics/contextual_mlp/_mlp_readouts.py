"""``ContextualMLP``'s read-outs, table, files and views (a base class of ``ContextualMLP``:
each method reads the MLP's fields and weights, or hands it to ``_readout``, ``_files``,
``_views``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TypeVar, cast

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.contextual_mlp import _core, _files, _readout, _views
from tl_dynamics.contextual_mlp._results import Evaluation, Neurons

if TYPE_CHECKING:
    from tl_dynamics.adapter import ModelAdapter

# /3: safetensors tensors + a JSON description (no pickle); /2 and /1 (torch.save pickles) are
# refused without being unpickled.
SAVE_FORMAT = "tl_dynamics.contextual_mlp/3"
DEFAULT_CHUNK = 4096  # query inputs evaluated at once: chunk x (n_src + d_head + d_model) floats
T = TypeVar("T", bound="MLPReadouts")


class MLPReadouts(viz.Result):
    """Read-outs, table, files and views of a ``ContextualMLP`` (its base class)."""

    if TYPE_CHECKING:  # fields and methods of ContextualMLP
        layer: int
        head: int
        str_tokens: tuple[str, ...]
        x: Float[Tensor, "pos d_model"]
        n_pos: int
        positions: list[int]

        def check_position(self, position: int) -> int: ...
        def neurons(self, position: int) -> Neurons: ...

        sink_logit: float | None
        outgoing: Float[Tensor, "pos d_model"]

        def sources(self, position: int) -> Int[Tensor, " src"]: ...
        def activations(self, position: int) -> Float[Tensor, " src"]: ...
        def evaluate(
            self,
            x: Tensor,
            position: int,
            chunk_size: int = ...,
            keep_outputs: bool = ...,
            labels: list[str] | None = ...,
        ) -> Evaluation: ...

        def pattern(self) -> Float[Tensor, "pos pos"]: ...

    def _mlp(self) -> Any:
        """This MLP as the read-outs and files see it (``_readout.ContextualMLP``)."""
        return cast(Any, self)

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

    def sink_activation(self, position: int) -> float:
        """The learned-sink neuron's activation at the real query input of ``position``.

        The mass the head's learned sink absorbs there (docs/math.md §3.7); 0.0 on layers without one.

        Args:
            position: a destination (negative counts from the end).

        Returns:
            The activation, in ``[0, 1]``.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.sink_activation(3)  # GPT-2 has no learned sink
            0.0
        """
        ev = self.evaluate(self.x[self.check_position(position)], position, keep_outputs=False)
        return 0.0 if ev.sink is None else float(ev.sink[0])

    def learned_sink(self) -> Float[Tensor, " pos"]:
        """``sink_activation`` at every real destination.

        Zero on padding and on layers without a learned sink.

        Returns:
            ``[pos]`` activations of the learned-sink neuron.

        Example:
            >>> from tl_dynamics import contextual_mlp, testing
            >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=1, heads=0)[1, 0]
            >>> mlp.learned_sink().tolist()  # GPT-2 has no learned sink
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        """
        out = torch.zeros(self.n_pos, device=self.x.device)
        if self.sink_logit is not None:
            for pos in self.positions:
                out[pos] = self.sink_activation(pos)
        return out

    def evaluate_tokens(
        self,
        adapter: "ModelAdapter",
        tokens: Sequence[int] | Tensor,
        position: int,
        normalise: _readout.Normalise = "match",
    ) -> Evaluation:
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
        return _readout.evaluate_tokens(self._mlp(), adapter, tokens, position, normalise)

    def evaluate_vocab(
        self,
        adapter: "ModelAdapter",
        position: int,
        normalise: _readout.Normalise = "match",
        chunk_size: int = DEFAULT_CHUNK,
        keep_outputs: bool = False,
    ) -> Evaluation:
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
        return _readout.evaluate_vocab(
            self._mlp(), adapter, position, normalise, chunk_size, keep_outputs
        )

    def written_tokens(
        self, adapter: "ModelAdapter", position: int | None = None, k: int = 10
    ) -> "_readout.Readout":
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
        return _readout.written_tokens(self._mlp(), adapter, position, k)

    def read_tokens(
        self,
        adapter: "ModelAdapter",
        position: int,
        k: int = 10,
        normalise: _readout.Normalise = "match",
    ) -> "_readout.Readout":
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
        return _readout.read_tokens(self._mlp(), adapter, position, k, normalise)

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
        return _files.save(self._mlp(), path, SAVE_FORMAT)

    @classmethod
    def load(cls: type[T], path: str | os.PathLike) -> T:
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
            return _views.mlp_view(
                name,
                list(self.str_tokens),
                self.pattern(),
                None if self.sink_logit is None else self.learned_sink(),
            )
        pos = self.check_position(position)
        neurons = self.neurons(pos)
        importance = torch.zeros(self.n_pos, device=self.x.device)
        importance[neurons.sources] = neurons.importance
        return _views.destination_view(
            name, list(self.str_tokens), pos, importance, neurons.to_dataframe()
        )
