"""The in-context linear regression task of ``regression-2l`` (in the spirit of von Oswald et al.
2023), written in tokens, with its two reference predictors.

Tokens: ``<|endoftext|>`` (BOS, id 0, never written: sequences start with their first pair, so
the x-tokens sit at the even positions), ``<unk>`` (id 1), ``N_X`` x-tokens ``x0 .. x511`` and
``N_BINS`` y-tokens ``y0 .. y31``. Every x-token has one fixed random vector ``u`` in
``R^D_X`` (seeded, ``N(0, I)``). A sequence draws its own ``w ~ N(0, I_D_X)`` and writes
``N_PAIRS`` pairs ``x_i y_i``: ``x_i`` are distinct x-tokens (drawn without replacement, so a
query's x never occurs earlier in its context and nothing can be copied), and ``y_i`` is the bin
of ``w . u_{x_i} / sqrt(D_X) + NOISE * eps`` among ``N_BINS`` equal bins of ``[-Y_MAX, Y_MAX]``
(the outer bins open). Only the context tells ``w``: the loss is the cross-entropy of each y-token
given everything before it.

The references, per pair index ``j`` (``j`` pairs seen before the query):

- **context-free**: the best predictor that sees only the query's x: ``y | u ~ N(0, |u|^2 / D_X
  + NOISE^2)`` (the prior of ``w``), binned exactly;
- **ridge oracle**: the Bayesian posterior predictive of ``w`` given the ``j`` earlier pairs (ridge
  regression with the prior's ``lambda``), reading each earlier y-token as its bin's centre with
  noise variance ``NOISE^2 + h^2 / 12`` (``h`` the bin width), binned exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tl_dynamics.zoo._data import BOS, UNK

N_X = 512  # x-tokens
D_X = 2  # dimension of their vectors u
N_BINS = 32  # y-tokens
Y_MAX = 4.0  # the bins cover [-Y_MAX, Y_MAX]; y has standard deviation about 1
NOISE = 0.1  # standard deviation of the noise on y
N_PAIRS = 24
FIRST_X = 2  # ids 0 and 1 are BOS and UNK
FIRST_Y = FIRST_X + N_X
VOCAB = FIRST_Y + N_BINS
SEQ_LEN = 2 * N_PAIRS  # x_1 y_1 ... x_N y_N, no BOS: the x-tokens sit at the even positions
LATE_PAIRS = 8  # "late pairs": the last 8 (17th to 24th pair)
PAIR_BANDS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 24))  # pair indices, 1-based


def regression_tokenizer():
    """One token per whitespace-separated word: ``"x17 y20 x301"``; ``BOS`` doubles as EOS and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {BOS: 0, UNK: 1}
    vocab.update({f"x{i}": FIRST_X + i for i in range(N_X)})
    vocab.update({f"y{b}": FIRST_Y + b for b in range(N_BINS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=BOS, unk_token=UNK
    )


def bin_edges() -> torch.Tensor:
    """``[N_BINS + 1]`` float64 edges, the outer two at -inf and +inf."""
    edges = torch.linspace(-Y_MAX, Y_MAX, N_BINS + 1, dtype=torch.float64)
    edges[0], edges[-1] = -math.inf, math.inf
    return edges


def bin_centres() -> torch.Tensor:
    edges = torch.linspace(-Y_MAX, Y_MAX, N_BINS + 1, dtype=torch.float64)
    return (edges[:-1] + edges[1:]) / 2


def binned_logprob(mean: torch.Tensor, var: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """``log P(bin)`` of a Gaussian ``N(mean, var)`` (all float64, same shape)."""
    edges = bin_edges()
    sd = var.sqrt()
    normal = torch.distributions.Normal(0.0, 1.0)
    hi = normal.cdf((edges[bins + 1] - mean) / sd)
    lo = normal.cdf((edges[bins] - mean) / sd)
    return (hi - lo).clamp_min(1e-300).log()


@dataclass(frozen=True)
class Sample:
    """Sequences of the task: ``tokens`` ``[batch, SEQ_LEN]`` (no BOS), the x indices ``[batch, N_PAIRS]``,
    the y bins ``[batch, N_PAIRS]`` and each row's ``w`` ``[batch, D_X]``."""

    tokens: torch.Tensor
    x: torch.Tensor
    bins: torch.Tensor
    w: torch.Tensor

    @property
    def target_mask(self) -> torch.Tensor:
        """``[batch, SEQ_LEN - 1]``: the next-token targets that are y-tokens."""
        target = torch.arange(1, SEQ_LEN)
        return (target % 2 == 1).expand(len(self.tokens), -1)


@dataclass(frozen=True)
class RegressionTask:
    """The task's fixed part: the vectors ``u`` of the x-tokens."""

    u: torch.Tensor  # [N_X, D_X] float64

    @classmethod
    def build(cls, seed: int) -> "RegressionTask":
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randn(N_X, D_X, generator=gen, dtype=torch.float64))

    def sample(self, batch: int, gen: torch.Generator) -> Sample:
        """``batch`` sequences, deterministic given ``gen``'s state."""
        x = torch.rand(batch, N_X, generator=gen).argsort(-1)[:, :N_PAIRS]
        w = torch.randn(batch, D_X, generator=gen, dtype=torch.float64)
        eps = torch.randn(batch, N_PAIRS, generator=gen, dtype=torch.float64)
        y = (self.u[x] @ w[:, :, None])[..., 0] / math.sqrt(D_X) + NOISE * eps
        bins = torch.bucketize(y, bin_edges()[1:-1])
        tokens = torch.stack([x + FIRST_X, bins + FIRST_Y], dim=-1).reshape(batch, -1)
        return Sample(tokens, x, bins, w)

    def batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch: tokens and the mask of y-token targets."""
        s = self.sample(batch, gen)
        return s.tokens, s.target_mask

    def context_free_nll(self, s: Sample) -> torch.Tensor:
        """``[batch, N_PAIRS]``: the loss of the best predictor that sees only the query's x."""
        a2 = (self.u[s.x] ** 2).sum(-1) / D_X
        return -binned_logprob(torch.zeros_like(a2), a2 + NOISE**2, s.bins)

    def oracle_nll(self, s: Sample) -> torch.Tensor:
        """``[batch, N_PAIRS]``: the loss of the ridge oracle (the posterior predictive of ``w``
        given the earlier pairs, their y-tokens read as bin centres)."""
        a = self.u[s.x] / math.sqrt(D_X)  # [b, N, D]
        width = 2 * Y_MAX / N_BINS
        s2 = NOISE**2 + width**2 / 12
        y = bin_centres()[s.bins]
        eye = torch.eye(D_X, dtype=torch.float64)
        prec = eye.expand(len(a), D_X, D_X).clone()
        rhs = torch.zeros(len(a), D_X, dtype=torch.float64)
        out = torch.empty(len(a), N_PAIRS, dtype=torch.float64)
        for j in range(N_PAIRS):
            cov = torch.linalg.inv(prec)
            mean = ((cov @ rhs[..., None])[..., 0] * a[:, j]).sum(-1)
            var = (a[:, j, None, :] @ cov @ a[:, j, :, None])[:, 0, 0] + NOISE**2
            out[:, j] = -binned_logprob(mean, var, s.bins[:, j])
            prec = prec + a[:, j, :, None] * a[:, j, None, :] / s2
            rhs = rhs + a[:, j] * y[:, j, None] / s2
        return out


@torch.no_grad()
def numeric_embeddings(W_E: torch.Tensor, task: RegressionTask, gen: torch.Generator) -> None:
    """Initialise the embedding rows with the task's numbers (they are trained afterwards): an
    x-token's row is ``u_x P + t_x``, a y-token's ``c_b e / 2 + t_y`` (``c_b`` its bin's centre),
    for a random ``P`` ``[D_X, d_model]`` and random directions ``e``, ``t_x``, ``t_y``, entries
    ``N(0, 0.1^2)`` like the default initialisation. Without it, a model trained for 5 CPU
    minutes learned the x-tokens' vectors too slowly to use the context (see the card)."""
    d_model = W_E.shape[1]
    P, e, t_x, t_y = (0.1 * torch.randn(n, d_model, generator=gen) for n in (D_X, 1, 1, 1))
    W_E[FIRST_X:FIRST_Y] = task.u.float() @ P + t_x
    W_E[FIRST_Y:] = bin_centres().float()[:, None] * e / 2 + t_y


@torch.no_grad()
def model_nll(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``[batch, N_PAIRS]``: a model's loss on each y-token (its logits at the x-token before;
    ``tokens`` as ``Sample.tokens``, no BOS)."""
    logp = model(tokens).log_softmax(-1)
    return -logp[:, 0:-1:2].gather(-1, tokens[:, 1::2, None])[..., 0].double()


def by_band(nll: torch.Tensor) -> list[float]:
    """Mean loss over the sequences and the pairs of each ``PAIR_BANDS`` band."""
    return [nll[:, a - 1 : b].mean().item() for a, b in PAIR_BANDS]


def heldout_sample(n: int, seed: int, task_seed: int = 0) -> Sample:
    """``n`` sequences drawn from a generator seeded with ``seed`` (training draws from seed 1)."""
    return RegressionTask.build(task_seed).sample(n, torch.Generator().manual_seed(seed))
