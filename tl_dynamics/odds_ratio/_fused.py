"""One group of a pass's layers (same scale and masks, no bias, soft-cap or learned sink) as a pure
function of the tensors the collector kept: the per-head sums and per-prompt sink facts, stacked
as the collector stores them. On a GPU it runs as one compiled plan (``Collector.fused``: few
fused kernels instead of a launch per op); the CPU, and every other group, run the same code
eagerly."""

from __future__ import annotations

import torch
from torch import Tensor

from tl_dynamics.collect import Collector
from tl_dynamics.odds_ratio import _stats
from tl_dynamics.odds_ratio._fast import MaskFacts, launch_chunks
from tl_dynamics.odds_ratio._headstats import SINK_SUM_KEYS


def group_sums(
    q: Tensor,
    k: Tensor,
    masks: MaskFacts,
    scale: float,
    layer_heads: int,
    n_layers: int,
    launch_bound: bool,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """``(part, sinks, per_prompt)``: ``part`` is ``[layer, key, head]`` float64
    (``_stats.SUM_KEYS`` then ``SINK_SUM_KEYS``: the sink facts summed over prompts), ``sinks``
    the per-prompt sink facts ``[batch, layer * head]``, ``per_prompt`` the sums the labels rest
    on per prompt, ``[batch, len(_stats.BOOT_KEYS), layer * head]`` float64. ``q`` and ``k`` hold the group's layers' heads side by side;
    ``masks`` are the pass's facts of the group's masks. ``launch_bound`` picks the plan
    (``tl_dynamics.collect._policy``) outside any compiled region.

    Example:
        >>> import torch
        >>> q, k = torch.randn(2, 1, 5, 8, 4).unbind(0)
        >>> allowed = torch.ones(1, 5, 5, dtype=torch.bool).tril()
        >>> masks = MaskFacts.of(allowed, torch.ones(1, 5, dtype=torch.bool), causal=True)
        >>> part, sinks, per_prompt = group_sums(q, k, masks, 0.5, 8, 1, True)
        >>> tuple(part.shape) == (1, len(_stats.SUM_KEYS) + len(SINK_SUM_KEYS), 8)
        True
        >>> tuple(sinks["sink_mass"].shape)
        (1, 8)
    """
    sums, sinks = _stats.layer_sums(
        q,
        k,
        scale,
        None,
        masks.allowed,
        masks.query_valid,
        masks=masks,
        layer_heads=layer_heads,
        launch_bound=launch_bound,
    )
    per_prompt = sums.pop("per_prompt")
    return stacked(sums, sinks, n_layers, layer_heads), sinks, per_prompt


def stacked(
    sums: dict[str, Tensor], sinks: dict[str, Tensor], n_layers: int, layer_heads: int
) -> Tensor:
    """A group's sums and summed sink facts as the collector keeps them: ``[layer, key, head]``
    float64, keys ``_stats.SUM_KEYS`` then ``SINK_SUM_KEYS``."""
    sink_values = {
        "sink_mass": sinks["sink_mass"],
        "sink_first": _stats.first_sinks(sinks),
        "sink_by_prior": sinks["sink_prior_adv"] > sinks["sink_loglik_adv"],
        "sink_prior_adv": sinks["sink_prior_adv"],
        "sink_loglik_adv": sinks["sink_loglik_adv"],
        "sink_alpha": sinks["sink_alpha"],
        # prompts whose first-key alpha exceeds eps (strictly; compared in float64, as a float
        # alpha is compared with eps in ``_heads.sink_epsilon``)
        "sink_alpha_over": sinks["sink_alpha"].double() > _stats.SINK_EPSILON,
    }
    # the sink facts summed over prompts in one go (bools count as 0/1 when stacked with floats)
    summed = torch.stack([sink_values[key] for key in SINK_SUM_KEYS]).double().sum(1)
    part = torch.cat([torch.stack([sums[key].double() for key in _stats.SUM_KEYS]), summed])
    return part.reshape(part.shape[0], n_layers, layer_heads).transpose(0, 1)


# compiled on a GPU; eager on the CPU (its own plan, in cache-sized chunks: benchmarks/README.md)
GROUP_SUMS = Collector.fused(group_sums)
# the compiled graph unrolls the chunk loop: past this many chunks (GPT-2-small has 6 at 1 x 1,024,
# the Llama-1B shape 32 at 1 x 2,048, the 8B shape 256 at 1 x 4,096) it runs eagerly
MAX_COMPILED_CHUNKS = 8


def pass_group_sums(
    q: Tensor, k: Tensor, masks: MaskFacts, scale: float, layer_heads: int, n_layers: int
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """``group_sums`` with the launch-bound plan, through ``GROUP_SUMS`` where its chunk loop
    is short enough to compile (``MAX_COMPILED_CHUNKS``), else eagerly."""
    n_batch, n_pos, n_heads = q.shape[0], q.shape[1], q.shape[2]
    if launch_chunks(n_batch, n_heads, n_pos, layer_heads) > MAX_COMPILED_CHUNKS:
        return group_sums(q, k, masks, scale, layer_heads, n_layers, True)
    # the launch-bound plan reads both masks: formed here, outside the compiled region (a
    # functools.cached_property takes a lock that torch.compile cannot trace: it ran eagerly)
    _ = (masks.allowed_f, masks.additive)
    return GROUP_SUMS(q.device, q, k, masks, scale, layer_heads, n_layers, True)
