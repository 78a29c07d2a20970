"""Entry points: ``compute`` (one call) and ``attach`` (collect during the user's own runs)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from tl_dynamics.adapter import Batch, LayerAttention, ModelAdapter, Prompt
from tl_dynamics.collect import ExactSum
from tl_dynamics.odds_ratio import _stats
from tl_dynamics.odds_ratio._fast import MaskFacts
from tl_dynamics.odds_ratio._lazy import LazyDecompositions
from tl_dynamics.odds_ratio._result import SINK_SUM_KEYS, Decomposition, HeadStats, OddsRatioResult
from tl_dynamics.odds_ratio._split import counterfactual_patterns, split_scores


def decompose_layer(la: LayerAttention, heads: Sequence[int], model: str = "",
                    tokens: torch.Tensor | None = None,
                    str_tokens: Sequence[Sequence[str]] = (),
                    dtype: torch.dtype = torch.float32) -> Decomposition:
    """The exact split of one captured layer (from ``ModelAdapter.capture``/``attention``).

    Example:
        >>> from tl_dynamics import testing                                   # doctest: +SKIP
        >>> from tl_dynamics.adapter import ModelAdapter                      # doctest: +SKIP
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b")[0]  # doctest: +SKIP
        >>> dec = decompose_layer(la, heads=[0, 1])                           # doctest: +SKIP
        >>> dec.parts.total().shape                                           # doctest: +SKIP
        torch.Size([1, 2, 2, 2])
    """
    la.require_no_sinks("odds_ratio.decompose_layer")
    heads = list(heads)
    parts = split_scores(la.q[:, :, heads], la.k[:, :, heads], la.scale, la.bias(heads), dtype)
    prior_p, lik_p = counterfactual_patterns(parts, la.allowed)
    if tokens is None:
        tokens = torch.zeros(la.q.shape[:2], dtype=torch.long, device=la.q.device)
    return Decomposition(model=model, layer=la.layer, heads=tuple(heads), tokens=tokens,
                         str_tokens=tuple(tuple(t) for t in str_tokens), parts=parts,
                         pattern=la.pattern(heads), prior_pattern=prior_p,
                         likelihood_pattern=lik_p, allowed=la.allowed,
                         query_valid=la.query_valid, softcap=la.softcap)


# Intra-op threads for the statistics (torch's setting is restored after each layer); None keeps
# torch's own setting. Measured (benchmarks/README.md): on an idle 2-core machine torch's two
# threads give 1.20x a plain forward against 1.26x on one thread; under heavy load one thread
# did better (1.17x vs 1.29x), so pass threads=1 on a shared machine.
STAT_THREADS: int | None = None


class OddsRatioCollector:
    """Accumulates per-head statistics over every forward pass run while attached.

    Only ``[layer, head]`` sums are kept unless ``keep_tensors`` (then every pass's
    ``Decomposition`` per layer and per-prompt sink facts are kept too).
    """

    def __init__(self, adapter: ModelAdapter, layers: list[int], heads: list[int],
                 keep_tensors: bool = False, dtype: torch.dtype = torch.float32,
                 threads: int | None = STAT_THREADS):
        self.adapter, self.layers, self.heads = adapter, layers, heads
        self.keep_tensors, self.dtype, self.threads = keep_tensors, dtype, threads
        # per layer, the exact sums [key, head] (keys SUM_KEYS then SINK_SUM_KEYS)
        self._exact = [ExactSum.zeros((len(_stats.SUM_KEYS) + len(SINK_SUM_KEYS), len(heads)))
                       for _ in layers]
        self._prompts = 0
        self._passes: list[LazyDecompositions] = []  # per pass, formed when looked up
        self._sinks: list[dict[int, dict[str, torch.Tensor]]] = []
        self._batch: Batch | None = None
        self._seen_in_pass: set[int] = set()
        self._in_forward = False
        self._masks: MaskFacts | None = None  # the last layer's mask facts (reused if equal)

    def on_outer_layer(self, la: LayerAttention) -> None:
        """The ``attach`` block's callback: ``forward`` collects with its own padding mask."""
        if not self._in_forward:
            self.on_layer(la)

    def _new_pass(self) -> None:
        self._seen_in_pass = set()
        if self.keep_tensors:
            self._passes.append(LazyDecompositions())
            self._sinks.append({})

    def on_layer(self, la: LayerAttention) -> None:
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            self._on_layer(la)
        finally:
            torch.set_num_threads(before)

    def _on_layer(self, la: LayerAttention) -> None:
        if not self._seen_in_pass or la.layer in self._seen_in_pass:
            self._new_pass()
            self._prompts += int(la.q.shape[0])
        self._seen_in_pass.add(la.layer)
        a = self.layers.index(la.layer)
        h = self.heads
        pick = slice(None) if h == list(range(la.n_heads)) else h  # no copy for all heads
        if self._masks is None or not self._masks.matches(la.allowed, la.query_valid):
            self._masks = MaskFacts.of(la.allowed, la.query_valid)  # once per pass, usually
        sums, sinks = _stats.layer_sums(la.q[:, :, pick], la.k[:, :, pick], la.scale, la.bias(h),
                                        la.allowed, la.query_valid, la.softcap, masks=self._masks)
        by_prior = sinks["sink_prior_adv"] > sinks["sink_loglik_adv"]
        sink_values = {"sink_mass": sinks["sink_mass"], "sink_first": _stats.first_sinks(sinks),
                       "sink_by_prior": by_prior, "sink_prior_adv": sinks["sink_prior_adv"],
                       "sink_loglik_adv": sinks["sink_loglik_adv"]}
        part = torch.stack([sums[k].double().cpu() for k in _stats.SUM_KEYS]
                           + [sink_values[k].double().sum(0).cpu() for k in SINK_SUM_KEYS])
        self._exact[a] = self._exact[a] + ExactSum.of(part)
        if self.keep_tensors:  # keep q, k, scale, bias and masks; form the split when asked
            self._passes[-1].add(la.layer, self._maker(la, list(h), self._batch))
            self._sinks[-1][la.layer] = {k: v.cpu() for k, v in sinks.items()}

    def _maker(self, la: LayerAttention, heads: list[int], batch: Batch | None
               ) -> Callable[..., Decomposition]:
        def make(only: list[int] | None = None) -> Decomposition:
            tokens = batch.tokens if batch is not None else None
            strs = [self.adapter.str_tokens(batch, row) for row in range(len(tokens))] \
                if tokens is not None and self.adapter.tokenizer is not None else ()
            return decompose_layer(la, heads if only is None else only,
                                   self.adapter.info.architecture, tokens, strs, self.dtype)
        return make

    def forward(self, prompt: Prompt | Batch, padding_side: str = "right") -> torch.Tensor:
        """Run the model on a prompt or padded batch with its padding mask, collecting."""
        batch = self.adapter.tokenize(prompt, padding_side)
        self._batch, self._in_forward, self._seen_in_pass = batch, True, set()
        try:
            with self.adapter.capture(self.on_layer, self.layers, batch=batch):
                return self.adapter.forward(batch)
        finally:
            self._batch, self._in_forward, self._seen_in_pass = None, False, set()

    def result(self) -> OddsRatioResult:
        """Everything collected so far (copies: collecting more does not change it)."""
        specs = [self.adapter.specs[layer] for layer in self.layers]
        stats = HeadStats.from_exact(
            self.adapter.info.architecture, tuple(self.layers), tuple(self.heads),
            tuple(s.scale for s in specs), tuple(s.softcap for s in specs), self._prompts,
            ExactSum.stack(self._exact), _stats.SUM_KEYS)
        return OddsRatioResult(stats, tuple(p.copy() for p in self._passes),
                               tuple(dict(s) for s in self._sinks))


def sink_facts(la: LayerAttention) -> dict[str, torch.Tensor]:
    """The sink of every prompt and head of one captured layer, ``[batch, head]`` each: its
    mass, position (in real tokens; 0 = the first), dominance over the next-largest column,
    key-prior rank, and its advantage over the row mean split into key prior, distance
    log-likelihood and bias (docs/math.md §2.3), as ``attach`` collects them.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b c a b c")[1]
        >>> odds_ratio.sink_facts(la)["sink_mass"].shape
        torch.Size([1, 4])
    """
    return _stats.layer_sums(la.q, la.k, la.scale, la.bias(), la.allowed, la.query_valid,
                             la.softcap)[1]


@contextmanager
def attach(model: Any, *, layers: int | Sequence[int] | None = None,
           heads: int | Sequence[int] | None = None, keep_tensors: bool = False,
           dtype: torch.dtype = torch.float32,
           threads: int | None = STAT_THREADS) -> Iterator[OddsRatioCollector]:
    """Collect odds-ratio statistics during every forward pass run inside the block.

    ``layers`` and ``heads`` select as in ``compute``; the collector's ``result()`` is an
    ``OddsRatioResult`` like ``compute``'s.

    Statistics stream: only per-head sums are kept unless ``keep_tensors=True``. Unpadded
    inputs can go straight through ``model(tokens)``; for padded batches use
    ``collector.forward(prompts, padding_side=...)`` so the padding mask is known.
    ``threads`` is the number of intra-op threads for the statistics (None: torch's setting).

    Example:
        >>> from tl_dynamics import odds_ratio, testing                 # doctest: +SKIP
        >>> model = testing.tiny_model("gpt2")                          # doctest: +SKIP
        >>> with odds_ratio.attach(model, layers=[1]) as collector:     # doctest: +SKIP
        ...     _ = model(model.to_tokens("def f(x): return x"))
        ...     _ = model(model.to_tokens("a = b + c"))
        >>> collector.result().to_dataframe()["label"].tolist()        # doctest: +SKIP
        ['likelihood-driven', 'mixed', 'likelihood-driven', 'likelihood-driven']
    """
    adapter = ModelAdapter.of(model)
    collector = OddsRatioCollector(adapter, adapter.check_layers(layers), adapter.check_heads(heads),
                                   keep_tensors, dtype, threads)
    with adapter.capture(collector.on_outer_layer, collector.layers):
        yield collector


def compute(model: Any, prompt: Prompt | Batch, *, layers: int | Sequence[int] | None = None,
            heads: int | Sequence[int] | None = None, keep_tensors: bool = True,
            padding_side: str = "right", dtype: torch.dtype = torch.float32) -> OddsRatioResult:
    """Run the model once on ``prompt`` and split the scores of the asked layers and heads.

    ``prompt`` is a string, a list of strings (padded on ``padding_side``), a token tensor or
    an adapter ``Batch``. ``layers`` is a layer index, a list of them or None (all layers);
    ``heads`` a head index, a list of them or None (all heads), taken in every selected layer
    (the convention of every analysis, ``docs/developing.md``). Returns per-head statistics and,
    with ``keep_tensors``, the per-layer ``Decomposition`` (``result[layer]``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing                  # doctest: +SKIP
        >>> res = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=0)  # doctest: +SKIP
        >>> res[0].parts.key_prior.shape                                 # doctest: +SKIP
        torch.Size([1, 4, 3])
    """
    adapter = ModelAdapter.of(model)
    collector = OddsRatioCollector(adapter, adapter.check_layers(layers), adapter.check_heads(heads),
                                   keep_tensors, dtype)
    collector.forward(prompt, padding_side)
    return collector.result()
