"""``generate`` with the KV cache inside ``attach()``: each cached decoding step collected as its
new query rows against every cached key, stitched into the pass ``model(generated sequence)``
runs (docs/math.md §3.6).

While an analysis is attached, the model's ``generate`` is wrapped for the block (the original
runs, result and all). Inside it every pass is a *step*: the prompt's pass, then passes that run
only the new token(s) against the host's cache (TransformerLens 3.x's ``HookedTransformer``),
or rerun the whole sequence so far (a natively booted bridge). Of each step the adapter keeps
the hook outputs of its new positions only (``Generation``: O(context) per step, and one
pattern row per new query to check the host with); when ``generate`` returns they are stitched
along the positions into one pass over the sequence the steps ran (every token but the last
generated one), assembled and checked layer by layer, and only then handed to the collectors:
the numbers ``model(sequence)`` gives, within float tolerance, with nothing recomputed per step.

A step is checked against the host's own cache (read through ``CACHE_READS``: a release that
moves it is a refusal naming the attribute) and its own pattern: a cached step whose cache or
pattern holds fewer positions than the sequence (TransformerLens 4.3's and 3.9's bridges booted
from transformers fill no cache: each cached step attends to itself alone), or whose pattern
differs from the model's own attention beyond the self-check's tolerance, is refused by name
with the measured difference: the host's cached generation itself is wrong there, and its
generated text is not the model's (``use_past_kv_cache=False`` is the way out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from tl_dynamics.adapter import _readers
from tl_dynamics.adapter._batch import Batch
from tl_dynamics.adapter._collect import assemble
from tl_dynamics.adapter._tolerance import tolerance
from tl_dynamics.errors import TLDynamicsError

# role -> (the attribute holding the positions the host's cache holds, its meaning, reading)
CACHE_READS: dict[str, tuple[str, str, Callable[[Any], int]]] = {
    "past_key_values": (
        "get_seq_length",
        "the positions a transformers Cache holds",
        lambda value: int(value()),
    ),
    "past_kv_cache_entry": (
        "past_keys",
        "TransformerLens's cached keys [batch, pos, head, d_head]",
        lambda value: int(value.shape[1]),
    ),
}
PAIRED_ROLES = ("pattern", "scores")  # [batch, head, query, key]: new query rows, every key


def cached_positions(argument: str | None, cache: Any) -> int:
    """How many positions the host's cache holds before a pass (0 without a cache)."""
    if argument is None or cache is None or argument == "use_cache":
        return 0
    if argument not in CACHE_READS:
        raise TLDynamicsError(
            f"a pass through {argument} (a recurrent state, not a KV cache) inside generate: "
            "attach() collects attention passes only; pass use_past_kv_cache=False"
        )
    attribute, meaning, read = CACHE_READS[argument]
    return read(_readers.required(cache, attribute, meaning))


@dataclass
class Generation:
    """What the steps of one ``generate`` call ran so far."""

    length: int = 0  # positions stitched so far
    steps: int = 0
    tokens: Tensor | None = None  # [batch, length]
    mask: Tensor | None = None  # the latest attention mask, over every position so far
    rows: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)
    offset: int = 0  # where the current step's new positions start within its pass
    n_new: int = 0

    broken: int | None = None  # the positions the host's cache held at a step that needs more

    def begin(self, argument: str | None, cache: Any, tokens: Any, mask: Any, n: int) -> None:
        """A step starts: ``n`` positions run, after ``cache`` holding some. A step that
        neither continues the positions so far nor reruns them all is the host's error
        (``broken``), refused once its first layer has shown by how much (``keep``)."""
        held = cached_positions(argument, cache)
        self.broken = None
        if held == self.length:
            self.offset = 0
        elif held == 0 and n > self.length:  # the whole sequence rerun (no cache used)
            self.offset = self.length
        else:
            self.offset, self.broken = 0, held
        self.n_new = n - self.offset
        if isinstance(tokens, Tensor) and not tokens.is_floating_point():
            tokens = tokens if tokens.ndim == 2 else tokens[None]
            new = tokens[:, self.offset :]
            self.tokens = new if self.tokens is None else torch.cat([self.tokens, new], 1)
        if isinstance(mask, Tensor):
            self.mask = mask
        self.steps += 1

    def keep(self, layer: int, stash: dict[str, Tensor]) -> Tensor | None:
        """Keep the new positions of one layer's hook outputs. Returns the host's pattern rows
        where the step does not see the keys it should (for the measured refusal), else None."""
        lo, hi = self.offset, self.offset + self.n_new
        total = self.length + self.n_new
        wrong = None
        for role, t in stash.items():
            if role in PAIRED_ROLES:
                if t.shape[-1] != total or self.broken is not None:
                    wrong = t if role == "pattern" else wrong
                    continue
                new = t[:, :, lo:hi]
            elif t.ndim >= 2 and t.shape[1] == total and hi != total:  # past and new (a
                new = t[:, self.length : total]  # HookedTransformer's rotated cached keys)
            else:
                if t.ndim < 2 or t.shape[1] != hi:
                    raise TLDynamicsError(
                        f"generate with the KV cache inside attach(): the {role!r} hook of layer "
                        f"{layer} has shape {tuple(t.shape)}, not positions on its second axis, "
                        "so its steps cannot be stitched; pass use_past_kv_cache=False"
                    )
                new = t[:, lo:hi]
            self.rows.setdefault((role, layer), []).append(new.detach().clone())
        return wrong

    def end(self) -> None:
        if self.broken is not None:  # no pattern showed it: refused without a measure
            raise host_refusal(
                f"at decoding step {self.steps - 1} its cache held {self.broken} of the "
                f"{self.length} earlier positions",
                None,
            )
        self.length += self.n_new

    def batch(self, length: int | None = None) -> Batch:
        """The ``Batch`` of the sequence the steps ran (its first ``length`` positions)."""
        length = self.length if length is None else length
        if self.tokens is None or self.tokens.shape[1] < length:
            raise TLDynamicsError(
                "generate with the KV cache inside attach(): the token ids of its steps are "
                "unknown; pass use_past_kv_cache=False"
            )
        tokens = self.tokens[:, :length]
        valid = torch.ones_like(tokens, dtype=torch.bool)
        if self.mask is not None and self.mask.shape[0] == tokens.shape[0]:
            known = min(length, self.mask.shape[1])
            valid[:, :known] = self.mask[:, :known].bool().to(valid.device)
        side = "right" if bool(valid[:, 0].all()) else "left"
        return Batch(tokens, valid, side)

    def stitched(self, layer: int, roles: list[str], length: int | None = None) -> dict:
        """One layer's hook outputs over every position kept (``length``: so far), as one pass
        over them gives them."""
        length = self.length if length is None else length
        out = {}
        for role in roles:
            parts = self.rows.get((role, layer))
            if not parts:
                continue
            if role in PAIRED_ROLES:  # each step's rows see the keys so far: the rest masked
                fill = 0.0 if role == "pattern" else torch.finfo(parts[0].dtype).min
                parts = [
                    torch.nn.functional.pad(p, (0, length - p.shape[-1]), value=fill) for p in parts
                ]
                out[role] = torch.cat(parts, 2)
            else:
                out[role] = torch.cat(parts, 1)
        return out


def host_refusal(where: str, diff: float | None) -> TLDynamicsError:
    """The refusal of a cached step that does not see the keys it should, or whose attention
    is not the model's: the host's cached generation itself is wrong on this model."""
    measured = (
        ""
        if diff is None
        else f"; its attention pattern differs from the model's own (the adapter's recomputed "
        f"rows over the whole sequence) by up to {diff:.3g}"
    )
    return TLDynamicsError(
        f"generate with the KV cache inside attach(): the host's cached generation itself is "
        f"wrong on this model ({_readers.installed()}): {where}{measured}, so the tokens it "
        "generates are not the model's; pass use_past_kv_cache=False to generate (each step "
        "then runs the whole sequence, collected as model(sequence so far) collects it)"
    )


def measured_refusal(adapter: Any, gen: Generation, layer: int, host: Tensor) -> TLDynamicsError:
    """``host_refusal`` for a step whose pattern ``host`` sees other keys than the sequence's,
    measured against the adapter's recomputation of ``layer`` over every position so far."""
    total = gen.length + gen.n_new
    roles = [r for r, la in gen.rows if la == layer and r not in PAIRED_ROLES]
    try:
        la = assemble(adapter, layer, gen.stitched(layer, roles, total), gen.batch(total), {})
        diff: float | None = pattern_difference(host, la.pattern())
    except TLDynamicsError:
        diff = None
    held = gen.length if gen.broken is None else gen.broken
    return host_refusal(
        f"at decoding step {gen.steps - 1}, running {gen.n_new} new position(s) after "
        f"{gen.length}, its attention at layer {layer} sees {host.shape[-1]} of the {total} "
        f"positions (its cache held {held})",
        diff,
    )


def check_stitched(gen: Generation | None, layer: int, attention: Any, host: Tensor) -> None:
    """Refuse a stitched pass whose steps' own pattern (``host``) is not the adapter's
    recomputed pattern of the whole sequence within the self-check's tolerance."""
    rec = attention.pattern()
    keep = attention.query_valid[:, None, :, None] & attention.allowed[:, None]
    diff = float(((rec - host.float().to(rec.device)).abs() * keep).max())
    if diff > tolerance(host.dtype):
        steps = 0 if gen is None else gen.steps
        raise host_refusal(f"over its {steps} steps, its attention at layer {layer}", diff)


def pattern_difference(host: Tensor, recomputed: Tensor) -> float:
    """Max |host - recomputed| over the new query rows, the host's keys placed last (the ones a
    cache without the earlier positions sees)."""
    keys = recomputed.shape[-1]
    padded = torch.nn.functional.pad(host.float(), (keys - host.shape[-1], 0))
    return float((padded - recomputed[:, :, -host.shape[2] :].to(padded)).abs().max())
