"""Models TransformerLens runs whose layers do not form one pass over one residual stream.

Every analysis reads a model as a stack of layers run once each, in order, over one residual
stream of ``d_model`` per token, each attention layer scoring the tokens themselves. Two
architectures the TransformerBridge boots break that, and are refused as a whole, with what
the host does (docs/math.md §1.8):

- DeepSeek V4 (``DeepseekV4ForCausalLM``) keeps ``hc_mult`` residual streams per token.
  Manifold-constrained hyper-connections (mHC) collapse them into each block's input with
  weights computed from the streams themselves, and mix them after it with a Sinkhorn-normalised
  matrix, also computed from the streams (TransformerLens's bridge gives its blocks no residual
  hooks for that reason). Its compressed layers also score keys that are not tokens: the
  sliding window's keys plus entries a learned compressor pools over blocks of tokens (on
  compressed sparse attention an indexer keeps the top-k entries per query). Its values are its
  rotated keys, rotated back at the query's position, so even a sliding layer's output map
  depends on the query-key offset.
- HRM-Text (``HrmTextForCausalLM``) is recurrent: two stacks of layers (the bridge's
  ``L_blocks`` and ``H_blocks``, no ``blocks[i]``) run several times per forward, each run's
  input adding the other stack's state, so a layer's hooks fire once per run with no index.
"""

from __future__ import annotations

from typing import Any

from tl_dynamics.adapter._readers import optional
from tl_dynamics.errors import TLDynamicsError

__all__ = ["structure_refusal"]

_COMPRESSED = {
    "compressed_sparse_attention": "entries a learned compressor pools over each block of "
    "{rate} tokens, of which a learned indexer keeps the top {topk} per query",
    "heavily_compressed_attention": "entries a learned compressor pools over each block of "
    "{rate} tokens",
}


def _layers(indices: list[int]) -> str:
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(map(str, indices))


def _deepseek_v4(cfg: Any, architecture: str) -> TLDynamicsError:
    types = list(cfg.layer_types)
    rates = dict(cfg.compress_rates)
    parts = []
    for kind, what in _COMPRESSED.items():
        found = [i for i, t in enumerate(types) if t == kind]
        if found:
            text = what.format(rate=rates[kind], topk=cfg.index_topk)
            parts.append(f"on {_layers(found)} ({kind}), {text}")
    keys = ""
    if parts:
        keys = (
            f"; beside the sliding window of {optional(cfg, 'sliding_window')} tokens, "
            "attention also scores, "
            f"{', and '.join(parts)}, so these keys are not tokens"
        )
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    plain = ""
    if sliding:
        plain = (
            f"; attention on {_layers(sliding)} (sliding_attention) scores tokens, but reads its "
            "input from those streams and writes through values that are its rotated keys "
            "rotated back at the query's position, which the analyses do not model"
        )
    pooled = [i for i, t in enumerate(types) if t in _COMPRESSED]
    headline = f"hc_mult={cfg.hc_mult} residual streams (mHC)" + (
        f" and keys pooled over blocks of tokens ({_layers(pooled)})" if pooled else ""
    )
    return TLDynamicsError(
        f"unsupported architecture {architecture!r}: {headline}; DeepSeek V4 keeps "
        f"hc_mult={cfg.hc_mult} "
        "residual streams per token, which hyper-connections (mHC) collapse into each block's "
        "input and mix after it with weights computed from the streams themselves, so there is "
        "no single residual stream for the analyses to read (TransformerLens's bridge gives its "
        f"blocks no hook_resid_pre or hook_resid_post either){keys}{plain}; the adapter refuses rather than return "
        "attention that ignores it"
    )


def _hrm_text(cfg: Any, architecture: str) -> TLDynamicsError:
    h_cycles, l_cycles = int(cfg.H_cycles), int(cfg.L_cycles)
    return TLDynamicsError(
        f"unsupported architecture {architecture!r}: HRM-Text is recurrent: each forward runs "
        f"its L stack H_cycles*L_cycles = {h_cycles * l_cycles} times and its H stack H_cycles "
        f"= {h_cycles} times (TransformerBridge's L_blocks and H_blocks of "
        f"{cfg.num_layers_per_stack} layers each, no blocks[i]), each run's input adding the "
        "other stack's state, so every layer's hooks fire once per run with no run index and "
        "no pass of layers over one residual stream exists for the analyses to read; the "
        "adapter refuses rather than return attention from one of those runs"
    )


def structure_refusal(model: Any, architecture: str) -> TLDynamicsError | None:
    """The refusal of a bridge whose layers are not one pass over one residual stream (see the
    module doc), or None.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(H_cycles=2, L_cycles=3, num_layers_per_stack=4)
        >>> model = NS(original_model=NS(config=cfg), L_blocks=[], H_blocks=[])
        >>> str(structure_refusal(model, "HrmTextForCausalLM"))[:68]
        "unsupported architecture 'HrmTextForCausalLM': HRM-Text is recurrent"
        >>> structure_refusal(NS(original_model=NS(config=NS()), blocks=[]), "X") is None
        True
    """
    cfg = getattr(getattr(model, "original_model", None), "config", None)
    if type(cfg).__name__ == "DeepseekV4Config":
        return _deepseek_v4(cfg, architecture)
    if hasattr(model, "L_blocks") and hasattr(model, "H_blocks"):
        return _hrm_text(cfg, architecture)
    return None
