"""The polarisation split of attention scores: pure tensors in, tensors out (no model).

``r_ij = c <q_i, k_j> + p_ij = query_term_i + key_prior_j + loglik_ij + p_ij`` with
``query_term_i = (c/2)|q_i|^2``, ``key_prior_j = (c/2)|k_j|^2`` and
``loglik_ij = -(c/2)|q_i - k_j|^2`` (docs/math.md §2.1). The query term is constant along a row, so
it cancels in the softmax; the pattern is a posterior over source positions, key prior times
distance likelihood.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_dynamics.adapter import masked_softmax
from tl_dynamics.errors import TLDynamicsError


@dataclass(frozen=True)
class ScoreParts:
    """The four additive parts of the raw (pre-cap) scores of some heads.

    ``query_term[b, h, i]``, ``key_prior[b, h, j]``, ``loglik[b, h, i, j]`` and ``bias``
    (``[b, h, i, j]`` or None when the model has no position bias). ``scale`` is ``c``.
    ``sink[h]``, on layers with learned attention sinks (GPT-OSS), is the prior of the virtual
    key that stands for the sink: its whole score, with no query term, no likelihood and no
    bias (docs/math.md §2.6); None elsewhere.
    """

    query_term: Float[Tensor, "batch head q"]
    key_prior: Float[Tensor, "batch head k"]
    loglik: Float[Tensor, "batch head q k"]
    bias: Float[Tensor, "batch head q k"] | None
    scale: float
    sink: Float[Tensor, " head"] | None = None

    @property
    def sigma2(self) -> float:
        """The effective temperature ``sigma^2 = 1/c`` of the Gaussian odds ratio."""
        return 1.0 / self.scale

    def total(self) -> Float[Tensor, "batch head q k"]:
        """``query_term + key_prior + loglik + bias``: the raw score ``c<q,k> + p``."""
        out = self.query_term[..., :, None] + self.key_prior[..., None, :] + self.loglik
        return out if self.bias is None else out + self.bias

    def total_with_sink(self) -> Float[Tensor, "batch head q k_plus_1"]:
        """``total()`` with the virtual key's score ``sink_h`` as one more column (the model's
        softmax input, sink included); ``total()`` itself where the layer has no sink."""
        out = self.total()
        if self.sink is None:
            return out
        column = self.sink.to(out)[None, :, None, None].expand(*out.shape[:-1], 1)
        return torch.cat([out, column], dim=-1)

    def prior_logits(self) -> Float[Tensor, "batch head q k"]:
        """``key_prior_j + p_ij``: the logits of the prior-only counterfactual."""
        out = self.key_prior[..., None, :].expand_as(self.loglik)
        return out if self.bias is None else out + self.bias

    def likelihood_logits(self) -> Float[Tensor, "batch head q k"]:
        """``loglik_ij + p_ij``: the logits of the likelihood-only counterfactual. With a
        learned sink the query term stays in (``query_term_i + loglik_ij + p_ij``, the
        log-likelihood ratio against the null): the virtual key has none, so it does not cancel."""
        out = self.loglik if self.sink is None else self.loglik + self.query_term[..., :, None]
        return out if self.bias is None else out + self.bias


def split_scores(
    q: Float[Tensor, "batch pos head d_head"],
    k: Float[Tensor, "batch pos head d_head"],
    scale: float,
    bias: Float[Tensor, "batch head pos pos"] | None = None,
    dtype: torch.dtype = torch.float32,
    sink: Float[Tensor, " head"] | None = None,
) -> ScoreParts:
    """Split ``c <q_i, k_j> + p_ij`` into query term, key prior, distance log-likelihood, bias.

    ``c <q, k> = (c/2)|q|^2 + (c/2)|k|^2 - (c/2)|q - k|^2``: the query term is constant along a
    row, the key prior depends on the key alone, the log-likelihood on the distance
    (docs/math.md §2). The log-likelihood is computed from the distances themselves (not from
    the expanded inner product), so the identity ``total() == c<q,k> + p`` is a real check; in
    float32 it holds to about ``1e-7`` times ``(c/2)(|q|^2 + |k|^2)`` (pass
    ``dtype=torch.float64`` for large models). ``sink`` (per-head learned sink logits, GPT-OSS)
    becomes the prior of a virtual key (``ScoreParts.sink``).

    Args:
        q: queries ``[batch, pos, head, d_head]`` (after any rotation).
        k: keys ``[batch, pos, head, d_head]``.
        scale: the score scale ``c`` (positive).
        bias: an additive score bias ``[batch, head, pos, pos]`` (ALiBi, ...), or None.
        dtype: dtype of the split.
        sink: per-head learned sink logits ``[head]``, or None.

    Returns:
        ``ScoreParts``: ``query_term`` ``[batch, head, q]``, ``key_prior`` ``[batch, head, k]``,
        ``loglik`` ``[batch, head, q, k]``, ``bias``, ``sink`` and ``sigma2 = 1/c``; ``total()``
        adds the parts.

    Example:
        >>> import torch
        >>> q = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 0.0]]]]).reshape(1, 2, 1, 2)
        >>> parts = split_scores(q, q, scale=0.5)
        >>> parts.key_prior.tolist(), parts.loglik[0, 0].tolist()
        ([[[0.25, 0.0]]], [[-0.0, -0.25], [-0.25, -0.0]])
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b c")[1]
        >>> parts = split_scores(la.q, la.k, la.scale)
        >>> torch.allclose(parts.total(), la.scores(), atol=1e-5)  # the model's scores
        True
    """
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise TLDynamicsError(
            f"q and k must be [batch, pos, head, d_head] with the same batch, "
            f"heads and d_head; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if not scale > 0:
        raise TLDynamicsError(f"score scale c must be positive (sigma^2 = 1/c), got {scale}")
    qh = q.to(dtype).permute(0, 2, 1, 3)  # [b, h, i, d]
    kh = k.to(dtype).permute(0, 2, 1, 3)
    half = scale / 2.0
    query_term = half * qh.pow(2).sum(-1)
    key_prior = half * kh.pow(2).sum(-1)
    loglik = -half * _squared_distances(qh, kh)
    bias = None if bias is None else bias.to(dtype).expand_as(loglik)
    return ScoreParts(
        query_term, key_prior, loglik, bias, float(scale), None if sink is None else sink.to(dtype)
    )


# Largest [batch, head, q-chunk, k, d_head] difference tensor formed at once.
_CHUNK_ELEMENTS = 1 << 24


def _squared_distances(qh: Tensor, kh: Tensor) -> Tensor:
    """``|q_i - k_j|^2`` from the differences themselves (no cancellation), in query chunks."""
    b, h, n_q, d = qh.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * kh.shape[2] * d))
    return torch.cat(
        [
            (qh[:, :, i : i + step, None] - kh[:, :, None]).pow(2).sum(-1)
            for i in range(0, n_q, step)
        ],
        dim=2,
    )


def counterfactual_patterns(
    parts: ScoreParts, allowed: Bool[Tensor, "batch q k"]
) -> tuple[Float[Tensor, "batch head q k"], Float[Tensor, "batch head q k"]]:
    """Prior-only ``softmax(key_prior + p)`` and likelihood-only ``softmax(loglik + p)``.

    Both are taken over the allowed keys and are not soft-capped (the cap acts on the whole
    score, query term included, so it has no meaning for one part alone). With a learned sink
    (``parts.sink``) the virtual key joins both denominators, with its prior ``sink_h`` in the
    prior-only pattern and logit 0 (no likelihood) in the likelihood-only one, and is then
    dropped like the model's own: rows sum to less than 1 (docs/math.md §2.6).

    Args:
        parts: the split of one layer's scores (``split_scores``).
        allowed: ``[batch, q, k]`` which keys each query may attend to.

    Returns:
        ``(prior_pattern, likelihood_pattern)``, each ``[batch, head, q, k]``, rows summing to
        one over the allowed keys (less than one with a learned sink).

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b c")[1]
        >>> prior, lik = odds_ratio.counterfactual_patterns(
        ...     odds_ratio.split_scores(la.q, la.k, la.scale), la.allowed)
        >>> prior.shape, bool((prior.sum(-1) - 1).abs().max() < 1e-5)
        (torch.Size([1, 4, 4, 4]), True)
    """
    if parts.sink is None:
        return (
            masked_softmax(parts.prior_logits(), allowed),
            masked_softmax(parts.likelihood_logits(), allowed),
        )
    return (
        masked_softmax(parts.prior_logits(), allowed, parts.sink),
        masked_softmax(parts.likelihood_logits(), allowed, torch.zeros_like(parts.sink)),
    )


def log_softmax_with_sink(
    logits: Float[Tensor, "batch head q k"],
    allowed: Bool[Tensor, "batch q k"],
    sink: Float[Tensor, " head"],
) -> Float[Tensor, "batch head q k_plus_1"]:
    """Log-softmax over the allowed keys and a virtual key of logit ``sink_h`` (the last
    column); ``-inf`` off the mask. Rows with no allowed key put everything on the virtual key.

    Example:
        >>> import torch
        >>> allowed = torch.tensor([[[True, False]]])
        >>> log_softmax_with_sink(torch.zeros(1, 1, 1, 2), allowed, torch.zeros(1)).exp()
        tensor([[[[0.5000, 0.0000, 0.5000]]]])
    """
    column = sink.to(logits)[None, :, None, None].expand(*logits.shape[:-1], 1)
    masked = logits.masked_fill(~allowed[:, None], float("-inf"))
    return torch.log_softmax(torch.cat([masked, column], dim=-1), dim=-1)


def sink_log_patterns(
    parts: ScoreParts, allowed: Bool[Tensor, "batch q k"], softcap: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Log real, prior-only and likelihood-only patterns over the real keys and the virtual
    key of a learned sink (last column), from the parts themselves (no ``1 - sum``
    cancellation; docs/math.md §2.6). The real one is soft-capped where the layer is."""
    sink = parts.sink
    if sink is None:
        raise TLDynamicsError("these score parts have no learned sink (ScoreParts.sink is None)")
    total = parts.total()
    real = total if softcap is None else softcap * torch.tanh(total / softcap)
    return (
        log_softmax_with_sink(real, allowed, sink),
        log_softmax_with_sink(parts.prior_logits(), allowed, sink),
        log_softmax_with_sink(parts.likelihood_logits(), allowed, torch.zeros_like(sink)),
    )


def row_kl(log_p: Float[Tensor, "... k"], log_q: Float[Tensor, "... k"]) -> Float[Tensor, "..."]:
    """``KL(p || q) = sum_j p_j (log p_j - log q_j)`` per row, with ``0 log 0 = 0``."""
    p = log_p.exp()
    diff = torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))
    return (p * diff).sum(-1)
