"""Entry points and the collector: ``compute`` (one call), ``attach`` (collect during the user's
own runs) and ``OddsRatioCollector`` (what ``attach`` yields; the adapter drives it)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from tl_dynamics.adapter import Batch, LayerAttention, LayerState, ModelAdapter, Prompt
from tl_dynamics.collect import Collector, ExactSum, to_host, torch_threads
from tl_dynamics.evidence import N_BOOT
from tl_dynamics.odds_ratio import _stats
from tl_dynamics.odds_ratio._boot import BootSums
from tl_dynamics.odds_ratio._decompose import decompose_layer
from tl_dynamics.odds_ratio._fast import MaskFacts
from tl_dynamics.odds_ratio._fused import pass_group_sums, stacked
from tl_dynamics.odds_ratio._lazy import LazyDecompositions
from tl_dynamics.odds_ratio._result import SINK_SUM_KEYS, Decomposition, HeadStats, OddsRatioResult


# Intra-op threads for the statistics (None keeps torch's own setting): pass threads=1 on a
# machine other work keeps busy (benchmarks/README.md measures both).
STAT_THREADS: int | None = None


class OddsRatioCollector(Collector):
    """Accumulates per-head statistics over every forward pass run while attached.

    During a pass each layer's ``q`` and ``k`` are kept (references, no copy); when the pass
    ends, the layers that share a scale and mask are split together, their heads side by side,
    in a few launches whatever the number of heads, and their sums stay on the device until
    ``result()``. Only ``[layer, head]`` sums are kept unless ``keep_tensors`` (then every
    pass's ``Decomposition`` per layer and per-prompt sink facts are kept too). Layers with
    learned attention sinks (GPT-OSS) are split with the sink as a virtual key (docs/math.md
    §2.6), one layer at a time.
    """

    sinks = True  # learned sinks are modelled (a virtual key): the adapter need not refuse them
    gates = True  # reads q and k only: an output gate on z (gated attention) does not enter

    def __init__(
        self,
        adapter: ModelAdapter,
        layers: list[int],
        heads: list[int],
        keep_tensors: bool = False,
        dtype: torch.dtype = torch.float32,
        threads: int | None = STAT_THREADS,
        n_boot: int = N_BOOT,
        seed: int = 0,
    ):
        self.adapter, self.layers, self.heads = adapter, tuple(layers), list(heads)
        self.keep_tensors, self.dtype, self.threads = keep_tensors, dtype, threads
        self._pass_sums: list[torch.Tensor] = []  # per pass, [layer, key, head] float64 (device)
        self._boot = BootSums(n_boot, seed)  # replicate sums of the label sums (docs/math.md §9)
        self._prompts = 0
        self._passes: list[LazyDecompositions] = []  # per pass, formed when looked up
        self._sinks: list[dict[int, dict[str, torch.Tensor]]] = []
        self._layers: list[tuple[LayerAttention, MaskFacts]] = []  # this pass's, so far
        self._batch: Batch | None = None

    def start_pass(self, batch: Batch | None) -> None:
        self._layers, self._batch = [], batch
        if self.keep_tensors:
            self._passes.append(LazyDecompositions())
            self._sinks.append({})

    def on_layer(self, state: LayerState) -> None:
        la = state.attention
        if la is None or la.layer not in self.layers:
            return
        key = ("odds_ratio.masks", id(la.allowed))
        if key not in state.shared:  # once per pass and mask kind, for every layer
            state.shared[key] = MaskFacts.of(
                la.allowed, la.query_valid, la.spec.causal, la.spec.window
            )
        self._layers.append((la, state.shared[key]))
        if self.keep_tensors:  # keep q, k, scale, bias and masks; form the split when asked
            self._passes[-1].add(la.layer, self._maker(la, list(self.heads), self._batch))

    def end_pass(self) -> None:
        if not self._layers:
            return
        with torch_threads(self.threads):
            self._end_pass()

    def _end_pass(self) -> None:
        layers, self._layers = self._layers, []
        h = self.heads
        n_h = len(h)
        pick = slice(None) if h == list(range(layers[0][0].n_heads)) else h  # all heads: no copy
        whole: list[tuple[list[int], torch.Tensor]] = []  # each group's [layer, key, head] sums
        by_prompt: list[tuple[list[int], torch.Tensor]] = []  # per group: its label sums
        groups: dict[tuple, list[LayerAttention]] = {}
        facts: dict[tuple, MaskFacts] = {}
        for la, masks in layers:  # split together: same scale and masks, no bias or soft-cap
            fast = la.position_bias is None and la.softcap is None and la.sink_logit is None
            key = (la.scale, id(masks)) if fast else ("one", la.layer)
            groups.setdefault(key, []).append(la)
            facts[key] = masks
        # a GPU joins the layers' heads into one tensor; the CPU hands them over side by side
        # and joins one group of heads at a time (the whole pass's q and k were a fresh 37 MB
        # mapping each at 1 x 1,024 tokens)
        join = Collector.launch_bound(layers[0][0].q.device)
        for key, group in groups.items():
            first, masks = group[0], facts[key]
            q = [la.q if pick == slice(None) else la.q[:, :, pick] for la in group]
            k = [la.k if pick == slice(None) else la.k[:, :, pick] for la in group]
            if join or len(group) == 1:
                q = torch.cat(q, 2) if len(group) > 1 else q[0]
                k = torch.cat(k, 2) if len(group) > 1 else k[0]
            # a GPU: one pure function of the joined tensors (_fused.py)
            if (
                join
                and key[0] != "one"
                and isinstance(q, torch.Tensor)
                and isinstance(k, torch.Tensor)
            ):
                part, sinks, per = pass_group_sums(q, k, masks, first.scale, n_h, len(group))
                self._keep(group, part, sinks, per, whole, by_prompt)
                continue
            sums, sinks = _stats.layer_sums(
                q,
                k,
                first.scale,
                first.bias(h),
                first.allowed,
                first.query_valid,
                first.softcap,
                masks=masks,
                layer_heads=n_h,
                sink=None if first.sink_logit is None else first.sink_logit[pick],
            )
            per = sums.pop("per_prompt")
            part = stacked(sums, sinks, len(group), n_h)
            self._keep(group, part, sinks, per, whole, by_prompt)
        if len(whole) == 1 and whole[0][0] == list(self.layers):  # one group, every layer
            self._pass_sums.append(whole[0][1])
        else:
            by_layer = {la: part[i] for ls, part in whole for i, la in enumerate(ls)}
            zero = torch.zeros_like(next(iter(by_layer.values())))
            self._pass_sums.append(
                torch.stack([by_layer.get(layer, zero) for layer in self.layers])
            )
        n_rows = int(layers[0][0].q.shape[0])
        b = self._batch  # its prompts key their bootstrap weights (else their running indices)
        known = b is not None and b.tokens.shape[0] == n_rows
        self._boot.add(
            b.tokens if known and b is not None else None,
            b.key_valid if known and b is not None else None,
            self.layers,
            by_prompt,
        )
        self._prompts += n_rows

    def _keep(
        self,
        group: list[LayerAttention],
        part: torch.Tensor,
        sinks: dict[str, torch.Tensor],
        per_prompt: torch.Tensor,
        whole: list[tuple[list[int], torch.Tensor]],
        by_prompt: list[tuple[list[int], torch.Tensor]],
    ) -> None:
        """A group's ``[layer, key, head]`` sums, its ``[batch, key, layer x head]`` label sums,
        and its sink facts if kept."""
        n_h = len(self.heads)
        whole.append(([la.layer for la in group], part))
        by_prompt.append(([la.layer for la in group], per_prompt))
        for i, la in enumerate(group):
            if self.keep_tensors:
                self._sinks[-1][la.layer] = {
                    name: v.reshape(v.shape[0], len(group), n_h)[:, i].cpu()
                    for name, v in sinks.items()
                }

    def _maker(
        self, la: LayerAttention, heads: list[int], batch: Batch | None
    ) -> Callable[..., Decomposition]:
        def make(only: list[int] | None = None) -> Decomposition:
            tokens = batch.tokens if batch is not None else None
            strs = (
                [self.adapter.str_tokens(batch, row) for row in range(len(tokens))]
                if batch is not None and tokens is not None and self.adapter.tokenizer is not None
                else ()
            )
            return decompose_layer(
                la,
                heads if only is None else only,
                self.adapter.info.architecture,
                tokens,
                strs,
                self.dtype,
            )

        return make

    def forward(self, prompt: Prompt | Batch, padding_side: str = "right") -> torch.Tensor:
        """Run the model on a prompt or padded batch with its padding mask, collecting."""
        batch = self.adapter.tokenize(prompt, padding_side)
        with self.adapter.collecting(self):
            return self.adapter.forward(batch)

    def result(self, *, allow_empty: bool = False) -> OddsRatioResult:
        """Everything collected so far (copies: collecting more does not change it). Before any
        forward pass this raises (inside ``attach`` it is a forgotten model call: no data is
        never a number) unless ``allow_empty`` (an empty shard's zero sums, ``scale``)."""
        if not self._pass_sums and not allow_empty:
            raise Collector.no_passes("odds_ratio")
        specs = [self.adapter.specs[layer] for layer in self.layers]
        keys = len(_stats.SUM_KEYS) + len(SINK_SUM_KEYS)
        if self._pass_sums:  # one read from the device for every pass so far
            host = to_host({"sums": torch.stack(self._pass_sums)} | self._boot.pending())
            self._boot.absorb(host)
            parts = [ExactSum.of(x) for x in host["sums"]]
            exact = parts[0] if len(parts) == 1 else ExactSum.total(parts)
        else:
            exact = ExactSum.zeros((len(self.layers), keys, len(self.heads)))
        stats = HeadStats.from_exact(
            self.adapter.info.architecture,
            tuple(self.layers),
            tuple(self.heads),
            tuple(s.scale for s in specs),
            tuple(s.softcap for s in specs),
            self._prompts,
            exact,
            _stats.SUM_KEYS,
            boot=self._boot.result((len(self.layers), len(self.heads))),
        )
        return OddsRatioResult(
            stats, tuple(p.copy() for p in self._passes), tuple(dict(s) for s in self._sinks)
        )


def sink_facts(la: LayerAttention) -> dict[str, torch.Tensor]:
    """The sink of every prompt and head of one captured layer, ``[batch, head]`` each.

    Its mass, position (in real tokens; 0 = the first), dominance over the next-largest column
    (a learned sink's included), key-prior rank, the mass a learned sink absorbs
    (``learned_sink_mass``, zero without one), and its advantage over the row mean split into
    key prior, distance
    log-likelihood and bias (docs/math.md §2.3), as ``attach`` collects them.

    Args:
        la: one layer's captured attention (``ModelAdapter.attention(...)[layer]``).

    Returns:
        ``{name: [batch, head] tensor}`` with ``sink_mass``, ``sink_position``,
        ``sink_dominance``, ``sink_prior_rank``, ``sink_prior_adv``, ``sink_loglik_adv``,
        ``sink_bias_adv``, ``learned_sink_mass``, ``sink_alpha`` (Gu et al.'s alpha of the
        first real key, docs/math.md §2.3) and the rest of the per-prompt sink facts.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b c a b c")[1]
        >>> odds_ratio.sink_facts(la)["sink_mass"].shape
        torch.Size([1, 4])
    """
    masks = MaskFacts.of(la.allowed, la.query_valid, la.spec.causal, la.spec.window)
    return _stats.layer_sums(
        la.q,
        la.k,
        la.scale,
        la.bias(),
        la.allowed,
        la.query_valid,
        la.softcap,
        masks=masks,
        sink=la.sink_logit,
    )[1]


@contextmanager
def attach(
    model: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    keep_tensors: bool = False,
    dtype: torch.dtype = torch.float32,
    threads: int | None = STAT_THREADS,
) -> Iterator[OddsRatioCollector]:
    """Collect odds-ratio statistics during every forward pass run inside the block.

    ``layers`` and ``heads`` select as in ``compute``; the collector's ``result()`` is an
    ``OddsRatioResult`` like ``compute``'s.

    Statistics stream: only per-head sums are kept unless ``keep_tensors=True``. The padding
    mask is the pass's own: pass ``attention_mask=`` to your model call, or use
    ``collector.forward(prompts, padding_side=...)``.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        keep_tensors: also keep every pass's per-prompt decompositions.
        dtype: dtype of the split (``torch.float64`` for large models).
        threads: intra-op threads for the statistics (None: torch's setting).

    Returns:
        A context manager yielding the collector; call its ``result()`` after the block.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> model = testing.tiny_model("gpt2")
        >>> with odds_ratio.attach(model, layers=[1]) as collector:
        ...     _ = model(model.to_tokens("def f(x): return x"))
        ...     _ = model(model.to_tokens("a = b + c"))
        >>> res = collector.result()
        >>> res.stats.n_prompts, res.to_dataframe().index.tolist()
        (2, ['L1H0', 'L1H1', 'L1H2', 'L1H3'])
    """
    adapter = ModelAdapter.of(model)
    collector = OddsRatioCollector(
        adapter,
        adapter.check_attention_layers(layers),
        adapter.check_heads(heads),
        keep_tensors,
        dtype,
        threads,
    )
    with adapter.collecting(collector):
        yield collector


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    keep_tensors: bool = True,
    padding_side: str = "right",
    dtype: torch.dtype = torch.float32,
) -> OddsRatioResult:
    """Run the model once on ``prompt`` and split the scores of the asked layers and heads.

    ``prompt`` is a string, a list of strings (padded on ``padding_side``), a token tensor or
    an adapter ``Batch``. ``layers`` is a layer index, a list of them or None (all layers);
    ``heads`` a head index, a list of them or None (all heads), taken in every selected layer
    (the convention of every analysis, ``docs/developing.md``).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads).
        keep_tensors: keep the per-layer ``Decomposition`` (``result[layer]``).
        padding_side: where a list of texts is padded (``"right"`` or ``"left"``).
        dtype: dtype of the split (``torch.float64`` for large models).

    Returns:
        An ``OddsRatioResult``: per-head statistics and, with ``keep_tensors``, the per-layer
        decompositions (query term ``[batch, head, q]``, key prior ``[batch, head, k]``,
        log-likelihood ``[batch, head, q, k]``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> res = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=0)
        >>> res[0].parts.key_prior.shape, res[0].parts.loglik.shape
        (torch.Size([1, 4, 4]), torch.Size([1, 4, 4, 4]))
    """
    adapter = ModelAdapter.of(model)
    collector = OddsRatioCollector(
        adapter,
        adapter.check_attention_layers(layers),
        adapter.check_heads(heads),
        keep_tensors,
        dtype,
    )
    collector.forward(prompt, padding_side)
    return collector.result()
