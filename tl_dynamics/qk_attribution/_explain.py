"""``explain``: the chain of causes of one attention edge, QK attribution chained back through the
heads that wrote the query and the key to the tokens (docs/math.md §10.8)."""

from __future__ import annotations

from typing import Any

import torch

from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, ResidualSplit
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution._chain import Link, Pass, stream_link
from tl_dynamics.qk_attribution._edge import EdgeExplanation

# Relative error within which each link's parts must sum to its total (float32 sums reordered).
LINK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class _Keep(Collector):
    """Keeps what ``ResidualSplit.gather`` needs of every layer up to ``layer``, and every
    layer's pattern, queries, keys and scale."""

    inputs = True

    def __init__(self, split: ResidualSplit):
        self.split = split
        self.layers, self.points = split.layers, split.points
        self.kept: dict[int, dict[str, Any]] = {}
        self.attn: dict[int, Any] = {}

    def on_layer(self, state: Any) -> None:
        self.kept[state.layer] = self.split.keep(state)
        if state.attention is not None:
            self.attn[state.layer] = state.attention


def _check_position(value: Any, name: str, n: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise TLDynamicsError(
            f"qk_attribution.explain: {name} must be a position of the prompt, 0..{n - 1}, "
            f"got {value!r}"
        )
    return value


def _check_depth(depth: Any, top: Any) -> None:
    for name, value, low in (("depth", depth, 1), ("top", top, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TLDynamicsError(
                f"qk_attribution.explain: {name} must be an int >= {low}, got {value!r}"
            )


def trace(
    adapter: ModelAdapter, batch: Batch, layer: int
) -> tuple[dict[int, ResidualSplit], _Keep]:
    """One pass over ``batch`` keeping every layer up to ``layer`` (``_Keep``)."""
    splits = {layer: ResidualSplit(adapter, layer)}
    keep = _Keep(splits[layer])
    with torch.no_grad(), adapter.collecting(keep):
        adapter.forward(batch)
    return splits, keep


def pass_of(
    adapter: ModelAdapter,
    batch: Batch,
    splits: dict,
    keep: _Keep,
    row: int,
    cache: dict | None = None,
) -> Pass:
    """The ``Pass`` of prompt ``row``: residuals and maps formed once for the batch, on demand
    (``cache``, shared by the rows of one batch)."""
    cache = {} if cache is None else cache
    residuals: dict[int, Any] = cache.setdefault("residuals", {})
    maps: dict[tuple[int, int], Any] = cache.setdefault("maps", {})

    def split(layer: int) -> ResidualSplit:
        if layer not in splits:
            splits[layer] = ResidualSplit(adapter, layer)
        return splits[layer]

    def residual(layer: int) -> Any:
        if layer not in residuals:
            residuals[layer] = split(layer).gather(keep.kept, batch)
        return residuals[layer]

    def head_maps(layer: int, head: int) -> Any:
        if (layer, head) not in maps:
            maps[(layer, head)] = split(layer).maps(residual(layer), head)
        return maps[(layer, head)]

    attn = keep.attn
    return Pass(
        residual=residual,
        maps=head_maps,
        origins=lambda layer: split(layer).origins,
        pattern={l: la.pattern()[row].float() for l, la in attn.items()},
        gated={l: la.gate is not None for l, la in attn.items()},
        W_O={l: la.W_O for l, la in attn.items()},
        tokens=adapter.str_tokens(batch, row),
        row=row,
    )


def edge_links(
    p: Pass, la: Any, layer: int, head: int, dest: int, src: int, depth: int, top: int
) -> tuple[Link, Link, dict[str, float]]:
    """The key-side and query-side links of the score ``dest -> src`` (their lifts over the row's
    average key, both summing to ``c <q_i, k_j - k_bar>``) and the score's own numbers."""
    row = p.row
    q = la.q[row, dest, head].float()
    k = la.k[row, :, head].float()  # [pos, d]
    allowed = la.allowed[row, dest].float()
    u = allowed / allowed.sum().clamp(min=1.0)
    k_bar = u @ k
    c = float(la.scale)
    maps = p.maps(layer, head)
    w_key = c * (maps["key"][row] @ q)  # [pos, d_model]: each key position's readout
    w_query = c * (maps["query"][row, dest] @ (k[src] - k_bar))  # [d_model]
    lift = c * float(q @ (k[src] - k_bar))  # the model's own query and keys
    key = stream_link(p, layer, src, w_key[src], f"the key at {src}", depth, top)
    # the key side is a lift: the row's average key's reading subtracted, as one part; the part
    # no residual vector wrote (the norm's shift and b_K, rotated) formed on its own
    res = p.residual(layer)
    average = float(sum(u[j] * (res.stream[row, j].float() @ w_key[j]) for j in range(len(u))))
    kb = maps["key_bias"][row].float()
    key_bias = c * float(q @ (kb[src] - u @ kb))
    key = Link(
        f"the key at {src} (over the row's average key)",
        lift,
        key.parts + (("the row's average key", -average), ("key bias", key_bias)),
        key.keys + (("baseline", layer, head, dest), ("bias", layer, head, src)),
        key.children,
    )
    query = stream_link(p, layer, dest, w_query, f"the query at {dest}", depth, top)
    query_bias = c * float(maps["query_bias"][row, dest].float() @ (k[src] - k_bar))
    query = Link(
        f"the query at {dest}",
        lift,
        query.parts + (("query bias", query_bias),),
        query.keys + (("bias", layer, head, dest),),
        query.children,
    )
    bias = la.bias([head])
    position = 0.0 if bias is None else float(bias[row, 0].expand(la.allowed.shape[1:])[dest, src])
    numbers = {
        "lift": c * float(q @ (k[src] - k_bar)),
        "score": c * float(q @ k[src]) + position,
        "position_term": position,
        "attention": float(la.pattern()[row, head, dest, src]),
    }
    return key, query, numbers


def explain(
    model: Any,
    prompt: Prompt | Batch,
    layer: int,
    head: int,
    dest: int,
    src: int | None = None,
    *,
    depth: int = 2,
    top: int = 3,
    row: int = 0,
) -> EdgeExplanation:
    """Why head ``head`` of ``layer`` attends from ``dest`` to ``src``: the chain of causes of
    that one edge, each link exact (docs/math.md §10.8).

    The score's lift over the row's average key is split over the components that wrote the key
    at ``src`` and, separately, the query at ``dest`` (as ``compute`` does). Each of the ``top``
    leading components that is a head's output is split over that head's source positions (its
    output is a pattern-weighted sum of values), and each of its ``top`` leading sources over
    the components of the stream there; recursively, ``depth`` levels in all, ending at
    embeddings, MLPs and biases. Every link's parts sum to its total (``Link.error``; checked).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: anything ``adapter.tokenize`` takes; row ``row`` is explained.
        layer: the attention layer.
        head: the head.
        dest: the destination (query) position.
        src: the source (key) position; None: the row's most attended key.
        depth: levels: 1, the score's split only; 2, the heads among the leaders split into
            their sources and the components there; more, further back.
        top: how many leading parts of each link are expanded.
        row: the prompt of the batch.

    Returns:
        An ``EdgeExplanation``: ``sentence``, the links, ``to_dataframe()`` and ``show()``.

    Example:
        >>> from tl_dynamics import qk_attribution, zoo
        >>> e = qk_attribution.explain(zoo.load("induction-2l"), "ABCDEFGHABCDEFGH", 1, 1, dest=13)
        >>> e.src, max(link.error for link in e.links()) < 1e-4
        (6, True)
        >>> e.shape
        'key: L0H0 <- the token at src-1 | query: the token at dest'
        >>> e.sentence.startswith("L1H1 attends from 'E' (13) to 'F' (6)")
        True
    """
    adapter = ModelAdapter.of(model)
    layer = adapter.check_attention_layers([layer])[0]
    head = adapter.check_heads([head])[0]
    _check_depth(depth, top)
    batch = adapter.tokenize(prompt)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch.tokens.shape[0]:
        raise TLDynamicsError(f"qk_attribution.explain: row {row!r} is not a prompt of the batch")
    n = batch.tokens.shape[1]
    dest = _check_position(dest, "dest", n)
    splits, keep = trace(adapter, batch, layer)
    la = keep.attn[layer]
    if not bool(la.query_valid[row, dest]):
        raise TLDynamicsError(f"qk_attribution.explain: dest {dest} is a padding position")
    if src is None:
        src = int(la.pattern()[row, head, dest].argmax())
    src = _check_position(src, "src", n)
    if not bool(la.allowed[row, dest, src]):
        raise TLDynamicsError(
            f"qk_attribution.explain: L{layer}H{head} cannot attend from {dest} to {src} (masked)"
        )
    p = pass_of(adapter, batch, splits, keep, row)
    key, query, numbers = edge_links(p, la, layer, head, dest, src, depth, top)
    tol = LINK_RTOL.get(adapter.dtype, 5e-2)
    result = EdgeExplanation(layer, head, dest, src, tuple(p.tokens), key, query, numbers)
    worst = max(link.error for link in result.links())
    if worst > tol:
        raise TLDynamicsError(
            f"qk_attribution.explain: a link of L{layer}H{head} {dest}->{src} on "
            f"{adapter.info.architecture} does not sum to its total (relative error "
            f"{worst:.2e} > {tol:g})"
        )
    return result
