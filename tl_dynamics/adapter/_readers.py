"""Host internals read in one place, by meaning.

Every number the adapter takes from a Hugging Face module, its configuration or a
TransformerLens module is read here, through one ``Read`` per attribute: the attribute's name
(the older names a release used too), what it means (a multiplier or a divisor of ``q . k``, a
window that is exclusive, a flag), and a check against the configuration or ``head_dim`` where
one exists. A missing, renamed or implausible attribute is a ``TLDynamicsError`` naming the
module's class, the attribute, the installed transformers and TransformerLens and the versions
the tests ran on (``TESTED_ON``): never an ``AttributeError``, never a default that changes a
number. ``SCALES`` is the table of score scales per attention family; windows are read per layer
by ``window``; the self-check at load (``_selfcheck``) then compares the reading with the
model's own values, which a window longer than its probe cannot reach: these readers cover it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tl_dynamics.errors import TLDynamicsError

# The versions the test suite last passed on (the lock files, when a source checkout has them).
TESTED_ON = "transformers 5.24.0 with TransformerLens 4.3.0 and 3.9.0"
_LOCKS = Path(__file__).resolve().parents[2] / "requirements"
ABSENT = _ABSENT = object()  # what lookup returns for a missing attribute


def tested_on() -> str:
    """The versions the tests ran on: read from ``requirements/lock-tl*.txt`` where a source
    checkout has them, else ``TESTED_ON``.

    Example:
        >>> "transformers" in tested_on()
        True
    """
    found: dict[str, list[str]] = {}
    for lock in sorted(_LOCKS.glob("lock-tl*.txt")):
        for line in lock.read_text(encoding="utf-8").splitlines():
            name, _, version = line.partition("==")
            name = name.strip().lower()
            if name in ("transformers", "transformer-lens", "transformer_lens") and version:
                found.setdefault(name.replace("_", "-"), []).append(version.split()[0])
    if "transformers" not in found or "transformer-lens" not in found:
        return TESTED_ON
    return (
        f"transformers {' and '.join(sorted(set(found['transformers'])))} with "
        f"TransformerLens {' and '.join(sorted(set(found['transformer-lens'])))}"
    )


def installed() -> str:
    """The installed transformers and TransformerLens versions, in words."""
    from tl_dynamics.compat import tl_version

    try:
        import transformers

        hf = str(transformers.__version__)
    except ImportError:  # a HookedTransformer without transformers installed
        hf = "none"
    return f"transformers {hf} with TransformerLens {tl_version()}"


def refusal(owner: Any, attribute: str, problem: str) -> TLDynamicsError:
    """The error for an attribute the adapter cannot read by its meaning."""
    return TLDynamicsError(
        f"{type(owner).__name__}.{attribute}: {problem}. Installed: {installed()}; the tests "
        f"ran on {tested_on()}. The adapter refuses rather than guess a number; install the "
        "tested versions (requirements/lock-tl4.txt, lock-tl3.txt) or report the change"
    )


def lookup(owner: Any, path: str) -> Any:
    """``owner.a.b`` for ``path="a.b"``, or ``_ABSENT`` where any step is missing."""
    value = owner
    for part in path.split("."):
        value = getattr(value, part, _ABSENT)
        if value is _ABSENT:
            return _ABSENT
    return value


@dataclass(frozen=True)
class Read:
    """One attribute and its meaning: ``value(raw, owner)`` turns what the attribute holds into
    the number the adapter uses (for a score scale: the multiplier ``c`` of ``q . k``)."""

    attribute: str
    meaning: str
    value: Callable[[Any, int], float]


def _multiplier(raw: Any, _head_dim: int) -> float:
    return float(raw)


def _divisor(raw: Any, _head_dim: int) -> float:
    return 1.0 / float(raw)


def _sqrt_flag(raw: Any, head_dim: int) -> float:
    return float(head_dim) ** -0.5 if bool(raw) else 1.0


MULTIPLIER = "multiplier of q.k"
DIVISOR = "divisor of q.k (sqrt(head_dim))"
_SCALING = Read("scaling", MULTIPLIER, _multiplier)

# attention family -> the attributes holding its score scale, newest name first; "*": the rest.
# The families whose scale is fixed at head_dim**-0.5 by their code are checked against it.
SCALES: dict[str, tuple[Read, ...]] = {
    "gptj": (_SCALING, Read("scale_attn", DIVISOR, _divisor)),  # 5.24 renamed and flipped
    "codegen": (_SCALING, Read("scale_attn", DIVISOR, _divisor)),
    "bloom": (Read("inv_norm_factor", MULTIPLIER, _multiplier),),
    "falcon": (Read("inv_norm_factor", MULTIPLIER, _multiplier),),
    "mpt": (Read("softmax_scale", MULTIPLIER, _multiplier),),
    "openai_gpt": (Read("scale", "flag: divide q.k by sqrt(head_dim)", _sqrt_flag),),
    "bert": (_SCALING, Read("self.scaling", MULTIPLIER, _multiplier)),
    "roberta": (_SCALING, Read("self.scaling", MULTIPLIER, _multiplier)),
    "*": (_SCALING,),
}
FIXED_SCALE = {"gptj", "codegen", "bloom", "falcon"}  # head_dim**-0.5 by code


def scale(module: Any, family: str, head_dim: int) -> float:
    """The multiplier ``c`` of ``q . k`` in ``module``, read by ``SCALES[family]``.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> scale(NS(scaling=0.25), "gptj", 16), scale(NS(scale_attn=4.0), "gptj", 16)
        (0.25, 0.25)
    """
    reads = SCALES.get(family, SCALES["*"])
    for read in reads:
        raw = lookup(module, read.attribute)
        if raw is _ABSENT or raw is None:
            continue
        value = read.value(raw, head_dim)
        _check_scale(module, read, value, family, head_dim)
        return value
    names = " or ".join(read.attribute for read in reads)
    raise refusal(module, names, f"no score scale ({reads[0].meaning}) under this name")


def _check_scale(module: Any, read: Read, value: float, family: str, head_dim: int) -> None:
    if not math.isfinite(value) or value <= 0:
        raise refusal(module, read.attribute, f"score scale {value} is not a positive number")
    if family in FIXED_SCALE and not math.isclose(value, head_dim**-0.5, rel_tol=1e-6):
        raise refusal(
            module,
            read.attribute,
            f"read as a {read.meaning} it gives {value:.6g}, but this family's code scales by "
            f"head_dim**-0.5 = {head_dim**-0.5:.6g} (head_dim {head_dim}): its meaning changed",
        )
    if read.meaning == MULTIPLIER and head_dim > 1 and value > 1.0:
        if math.isclose(value, head_dim**0.5, rel_tol=1e-6):  # a divisor under a multiplier's name
            raise refusal(
                module,
                read.attribute,
                f"{value:.6g} = sqrt(head_dim) is a divisor, not a multiplier",
            )


def required(owner: Any, path: str, meaning: str) -> Any:
    """``owner.path``, which this family's code always has, or a refusal naming it."""
    value = lookup(owner, path)
    if value is _ABSENT:
        raise refusal(owner, path, f"missing ({meaning})")
    return value


def optional(owner: Any, path: str) -> Any:
    """``owner.path`` where its absence has a meaning of its own (no such feature), else None."""
    value = lookup(owner, path)
    return None if value is _ABSENT else value


# families whose module has no is_causal: their model's code always builds a causal mask
CAUSAL_BY_CODE = {"bloom", "mpt", "xglm", "openai_gpt"}


def causal(module: Any, family: str, hf_config: Any) -> bool:
    """Whether key ``j`` must satisfy ``j <= i``: the module's ``is_causal`` (on BERT-like
    wrappers its ``self``), BERT's config ``is_decoder``, ``CAUSAL_BY_CODE``."""
    if family in CAUSAL_BY_CODE:
        return True
    if family in ("bert", "roberta"):
        return bool(required(hf_config, "is_decoder", "BERT is causal iff it is a decoder"))
    for path in ("is_causal", "self.is_causal"):
        value = lookup(module, path)
        if value is not _ABSENT:
            return bool(value)
    raise refusal(module, "is_causal", "missing (whether keys after the query are masked)")


def text_config(model: Any) -> Any:
    """The configuration of the text model the bridge's layers belong to (``text_config`` of a
    multimodal wrapper such as Llava or Mistral3), or None without a Hugging Face model."""
    config = optional(lookup(model, "original_model"), "config")
    if config is None:
        return None
    text = getattr(config, "get_text_config", None)
    return text(decoder=True) if callable(text) else config


_SLIDING, _FULL = "sliding_attention", "full_attention"


def window(module: Any, layer: int, config: Any) -> int | None:
    """The sliding window ``w`` of one layer (key ``j`` allowed iff ``j > i - w``: exclusive,
    as Hugging Face's ``sliding_window``), or None for full attention.

    Read per layer: whether the layer slides from its module's ``is_sliding`` where it has one
    (Exaone 4 and Gemma keep ``sliding_window`` on their global layers too), else from the text
    model's ``layer_types`` (Qwen2-MoE's ``use_sliding_window`` / ``max_window_layers``), else
    from the module's own ``sliding_window``, else the text config's; the width from the module,
    else the text config, both checked to agree.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
        >>> window(NS(sliding_window=4), 0, cfg), window(NS(), 1, cfg)
        (4, None)
        >>> window(NS(), 0, NS(sliding_window=4)), window(NS(is_sliding=False, sliding_window=4), 1, cfg)
        (4, None)
    """
    own = lookup(module, "sliding_window")
    configured = optional(config, "sliding_window") or None
    types = optional(config, "layer_types")
    kind = types[layer] if types is not None and layer < len(types) else None
    kind = kind if kind in (_SLIDING, _FULL) else None  # other types: not a mask of their own
    flag = lookup(module, "is_sliding")
    if flag is not _ABSENT:
        sliding = bool(flag)
        if kind is not None and sliding != (kind == _SLIDING):
            raise refusal(
                module, "is_sliding", f"{sliding} in layer {layer}, but layer_types says {kind!r}"
            )
    elif kind is not None:
        sliding = kind == _SLIDING
        if not sliding and own not in (_ABSENT, None, 0):
            raise refusal(
                module,
                "sliding_window",
                f"{own} in layer {layer}, which layer_types says is {kind!r}",
            )
    elif own is not _ABSENT:
        sliding = bool(own)
    else:
        sliding = configured is not None
    if not sliding:
        return None
    width = own if own not in (_ABSENT, None, 0) else configured
    if width is None:
        raise refusal(module, "sliding_window", f"layer {layer} slides but no window is given")
    if configured is not None and own not in (_ABSENT, None, 0) and int(own) != int(configured):
        raise refusal(
            module, "sliding_window", f"{own} in layer {layer}, but the config says {configured}"
        )
    if int(width) < 1:
        raise refusal(module, "sliding_window", f"{width} is not a window width")
    return int(width)


def softcap(module: Any, config: Any) -> float | None:
    """``cap`` in ``cap * tanh(s / cap)``: the module's ``attn_logit_softcapping`` (Gemma 2);
    a module without one whose text config caps is refused (the cap would be dropped)."""
    own = lookup(module, "attn_logit_softcapping")
    if own is _ABSENT:
        if optional(config, "attn_logit_softcapping"):
            raise refusal(
                module,
                "attn_logit_softcapping",
                "missing, but the model's config soft-caps the scores",
            )
        return None
    return float(own) if own else None


# GPT-J and CodeGen build their sinusoid tables with base 10000 in code (no attribute to read).
ROTARY_BASES = {"gptj": 10000.0, "codegen": 10000.0}


def rotary_base(family: str) -> float:
    """The rotary base of a family whose code fixes it (``ROTARY_BASES``)."""
    return ROTARY_BASES[family]


def clip(config: Any) -> float | None:
    """``clip_qkv`` (OLMo, OLMoE: the config; MPT: its ``attn_config``): q, k and v clamped to
    ``[-clip, clip]``; None (no clamp) where the config has none."""
    value = optional(config, "clip_qkv") or optional(optional(config, "attn_config"), "clip_qkv")
    return float(value) if value else None


# families whose text config always has final_logit_softcapping (None or 0 where not capped)
FINAL_SOFTCAP = {"gemma2", "gemma3", "gemma4", "vaultgemma", "nanochat"}


def final_softcap(model: Any, host: str, family: str) -> float | None:
    """The soft-cap on the output logits: ``output_logits_soft_cap`` of a HookedTransformer
    (``<= 0``: none), the text config's ``final_logit_softcapping`` on a bridge (absent on
    families without one; required on ``FINAL_SOFTCAP``)."""
    if host == "hooked":
        cap = required(model.cfg, "output_logits_soft_cap", "logit soft-cap; <= 0: none")
    elif family in FINAL_SOFTCAP:
        cap = required(text_config(model), "final_logit_softcapping", "logit soft-cap")
    else:
        cap = optional(text_config(model), "final_logit_softcapping")
    return float(cap) if cap and cap > 0 else None
