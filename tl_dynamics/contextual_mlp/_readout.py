"""Counterfactual queries and read-outs: token / vocabulary inputs, what neurons write and read
(docs/math.md §3.4).

Token queries. A head reads its query from the layer's *normalised* input, and the adapter does
not expose each layer's input normalisation, so a token's query input is built as a documented
approximation: its embedding (plus the learned position embedding of the destination, where the
model has one) rescaled to the length of the real query input ``x_T`` (``normalise="match"``),
or taken as is (``"none"``). The direction is the token's; a layer norm's learned gain and bias
are not applied.

Written tokens. ``a_i`` is read as a *direction*, as TransformerLens's logit lens does for one
component: the model's own final normalisation without its bias, ``final_norm(a) -
final_norm(0)`` (centring, scaling by ``a``'s own scale, gain), then ``@ W_U`` without ``b_U``.
The values rank tokens per neuron; how much a neuron actually writes is its importance
``activation * |a_i|``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.contextual_mlp import _core
from tl_dynamics.contextual_mlp._results import Evaluation
from tl_dynamics.errors import TLDynamicsError

Normalise = Literal["match", "none"]
VOCAB_CHUNK = 4096
PROGRESS_MIN = 8  # show a progress bar from this many chunks on


class ContextualMLP(Protocol):
    """What the read-outs use of a ``contextual_mlp.ContextualMLP`` (named by its shape here so
    that the MLP, which offers these read-outs as methods, and this module import one way only).
    Read-only properties: the MLP is a frozen dataclass."""

    @property
    def layer(self) -> int: ...
    @property
    def head(self) -> int: ...
    @property
    def str_tokens(self) -> tuple[str, ...]: ...
    @property
    def x(self) -> Float[Tensor, "pos d_model"]: ...
    @property
    def outgoing(self) -> Float[Tensor, "pos d_model"]: ...
    @property
    def allowed(self) -> Bool[Tensor, "pos pos"]: ...
    @property
    def bias(self) -> Float[Tensor, "pos pos"] | None: ...
    @property
    def scale(self) -> float: ...

    def check_position(self, position: int) -> int: ...

    def sources(self, position: int) -> Int[Tensor, " src"]: ...

    def query_frame_keys(self, position: int) -> Float[Tensor, "src d_head"]: ...

    def queries(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_head"]: ...

    def evaluate(
        self,
        x: Float[Tensor, "... d_model"],
        position: int,
        chunk_size: int = ...,
        keep_outputs: bool = ...,
        labels: list[str] | None = ...,
    ) -> Evaluation: ...


def token_inputs(
    mlp: ContextualMLP,
    adapter: ModelAdapter,
    tokens: Int[Tensor, " n"],
    position: int,
    normalise: Normalise = "match",
    add_position: bool = True,
) -> Float[Tensor, "n d_model"]:
    """Query inputs for ``tokens`` at destination ``position`` (see the module docstring)."""
    if normalise not in ("match", "none"):
        raise TLDynamicsError(f"normalise must be 'match' or 'none', got {normalise!r}")
    pos = mlp.check_position(position)
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    vocab = adapter.W_E.shape[0]
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise TLDynamicsError(
            f"token ids must be a non-empty list in 0..{vocab - 1}, got {ids.tolist()[:8]}"
        )
    x = adapter.W_E[ids]
    if add_position and adapter.W_pos is not None:
        x = x + adapter.W_pos[pos]
    if normalise == "match":
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12) * mlp.x[pos].norm()
    return x


def evaluate_tokens(
    mlp: ContextualMLP,
    adapter: ModelAdapter,
    tokens: Sequence[int] | Tensor,
    position: int,
    normalise: Normalise = "match",
) -> Evaluation:
    """The MLP of ``position`` on the (normalised) embeddings of ``tokens``."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    x = token_inputs(mlp, adapter, ids, position, normalise)
    return mlp.evaluate(x, position, labels=adapter.decode(ids))


def evaluate_vocab(
    mlp: ContextualMLP,
    adapter: ModelAdapter,
    position: int,
    normalise: Normalise = "match",
    chunk_size: int = VOCAB_CHUNK,
    keep_outputs: bool = False,
) -> Evaluation:
    """The MLP of ``position`` on every vocabulary token, ``chunk_size`` at a time.

    Memory: ``vocab * n_src`` activations (plus ``vocab * d_model`` with ``keep_outputs``).
    Labels are token ids as strings (decode with ``adapter.decode`` when needed).
    """
    vocab = adapter.W_E.shape[0]
    parts = []
    starts = range(0, vocab, chunk_size)
    for start in tqdm(starts, disable=len(starts) < PROGRESS_MIN, desc="vocabulary", leave=False):
        ids = torch.arange(start, min(start + chunk_size, vocab), device=adapter.W_E.device)
        x = token_inputs(mlp, adapter, ids, position, normalise)
        parts.append(mlp.evaluate(x, position, chunk_size, keep_outputs))
    first = parts[0]
    return Evaluation(
        layer=mlp.layer,
        head=mlp.head,
        position=first.position,
        sources=first.sources,
        source_tokens=first.source_tokens,
        activations=torch.cat([p.activations for p in parts]),
        outputs=torch.cat([p.outputs for p in parts]) if keep_outputs else None,
        winners=torch.cat([p.winners for p in parts]),
        labels=tuple(str(i) for i in range(vocab)),
        sink=None
        if first.sink is None
        else torch.cat([p.sink for p in parts if p.sink is not None]),
    )


@dataclass(frozen=True)
class Readout(viz.Result):
    """Top and bottom vocabulary tokens per neuron (source position).

    ``kind`` is ``"writes"`` (``a_i`` read through the unembedding) or ``"reads"`` (pre-activation
    ``b_i . x(tok) + c_i`` of each token's query input at destination ``position``).
    """

    layer: int
    head: int
    kind: str
    position: int | None
    sources: Int[Tensor, " src"]
    source_tokens: tuple[str, ...]
    top_ids: Int[Tensor, "src k"]
    top_values: Float[Tensor, "src k"]
    bottom_ids: Int[Tensor, "src k"]
    bottom_values: Float[Tensor, "src k"]
    vocab_strings: dict[int, str]

    def top_tokens(self, source: int) -> list[str]:
        """The top tokens of the neuron at source position ``source``."""
        where = (self.sources == source).nonzero().flatten()
        if where.numel() == 0:
            raise TLDynamicsError(
                f"source {source} is not a neuron here; neurons: {self.sources.tolist()}"
            )
        return [self.vocab_strings[int(i)] for i in self.top_ids[int(where[0])]]

    def to_dataframe(self) -> pd.DataFrame:
        rows = []
        for n, (src, tok) in enumerate(zip(self.sources.tolist(), self.source_tokens)):
            for rank in range(self.top_ids.shape[1]):
                rows.append(
                    dict(
                        layer=self.layer,
                        head_index=self.head,
                        kind=self.kind,
                        position=self.position,
                        source=src,
                        source_token=tok,
                        top_rank=rank,
                        top_token=self.vocab_strings[int(self.top_ids[n, rank])],
                        top_value=float(self.top_values[n, rank]),
                        bottom_token=self.vocab_strings[int(self.bottom_ids[n, rank])],
                        bottom_value=float(self.bottom_values[n, rank]),
                    )
                )
        return pd.DataFrame(rows)

    def show(self, max_k: int = 7) -> viz.Component:
        """``topk_tokens``: neurons = source tokens, over the union of their top/bottom tokens."""
        ids = sorted(set(self.top_ids.flatten().tolist()) | set(self.bottom_ids.flatten().tolist()))
        index = {t: j for j, t in enumerate(ids)}
        # A token outside a neuron's top/bottom k sits between its k-th top and k-th bottom value.
        filler = (self.top_values[:, -1] + self.bottom_values[:, -1]) / 2
        acts = filler[None].repeat(len(ids), 1)
        for n in range(len(self.sources)):
            for tid, val in zip(
                self.top_ids[n].tolist() + self.bottom_ids[n].tolist(),
                self.top_values[n].tolist() + self.bottom_values[n].tolist(),
            ):
                acts[index[tid], n] = val
        what = "writes (a_i through W_U)" if self.kind == "writes" else "is switched on by"
        return viz.topk_tokens(
            [[self.vocab_strings[i] for i in ids]],
            [acts[None]],
            max_k=max_k,
            first_dimension_name="Head",
            third_dimension_name="Neuron (source)",
            caption=f"L{self.layer}H{self.head}: what each neuron {what}",
        )


def _topk(values: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    got = values.topk(min(k, values.shape[-1]), dim=-1, largest=largest)
    return got.values, got.indices


def _readout(
    mlp: ContextualMLP,
    adapter: ModelAdapter,
    kind: str,
    position: int | None,
    sources: Tensor,
    scores: Tensor,
    k: int,
) -> Readout:
    top_v, top_i = _topk(scores, k, True)
    bot_v, bot_i = _topk(scores, k, False)
    ids = sorted(set(top_i.flatten().tolist()) | set(bot_i.flatten().tolist()))
    return Readout(
        layer=mlp.layer,
        head=mlp.head,
        kind=kind,
        position=position,
        sources=sources,
        source_tokens=tuple(mlp.str_tokens[i] for i in sources.tolist()),
        top_ids=top_i,
        top_values=top_v,
        bottom_ids=bot_i,
        bottom_values=bot_v,
        vocab_strings=dict(zip(ids, adapter.decode(ids))),
    )


def direction_logits(
    adapter: ModelAdapter, vectors: Float[Tensor, "n d_model"]
) -> Float[Tensor, "n d_vocab"]:
    """Vectors read as directions through the final normalisation (no bias) and ``W_U``."""
    if adapter.is_encoder:
        raise TLDynamicsError(
            f"reading a_i through the unembedding needs a decoder language "
            f"model; {adapter.info.architecture} is an encoder whose masked-LM "
            "head is not a final normalisation followed by W_U"
        )
    normed = adapter.final_norm(vectors) - adapter.final_norm(torch.zeros_like(vectors[:1]))
    return normed @ adapter.W_U


def written_tokens(
    mlp: ContextualMLP, adapter: ModelAdapter, position: int | None = None, k: int = 10
) -> Readout:
    """Top/bottom tokens each neuron writes (``a_i`` read through the unembedding).

    Every key position is a neuron (``a_i`` does not depend on the destination) unless
    ``position`` restricts to that destination's neurons.
    """
    if position is None:
        sources = torch.nonzero(mlp.allowed.any(dim=0)).flatten()
    else:
        sources = mlp.sources(position)
        position = mlp.check_position(position)
    scores = direction_logits(adapter, mlp.outgoing[sources])
    return _readout(mlp, adapter, "writes", position, sources, scores, k)


def read_tokens(
    mlp: ContextualMLP,
    adapter: ModelAdapter,
    position: int,
    k: int = 10,
    normalise: Normalise = "match",
    chunk_size: int = VOCAB_CHUNK,
) -> Readout:
    """Tokens whose query input switches each neuron of ``position`` on most (and least):
    pre-activation ``b_i . x(tok) + c_i`` over the whole vocabulary, in chunks."""
    pos = mlp.check_position(position)
    src = mlp.sources(pos)
    keys = mlp.query_frame_keys(pos)
    bias = None if mlp.bias is None else mlp.bias[pos, src]
    vocab = adapter.W_E.shape[0]
    parts = []
    for start in range(0, vocab, chunk_size):
        ids = torch.arange(start, min(start + chunk_size, vocab), device=adapter.W_E.device)
        x = token_inputs(mlp, adapter, ids, pos, normalise)
        parts.append(_core.preactivations(mlp.queries(x), keys, mlp.scale, bias))
    return _readout(mlp, adapter, "reads", pos, src, torch.cat(parts).T, k)
