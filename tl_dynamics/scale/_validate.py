"""A statistics file's header and tensors, checked like untrusted input before anything is built.

The checksum catches accidents; these checks catch a file that is self-consistent but wrong
(written by hand, or crafted, with a recomputed checksum): every field's type, finiteness and
range, the known analyses, every tensor's dtype and shape against the shapes the header
declares, and exact-sum exponents and limb counts that stay within float64's range. Anything
else raises ``TLDynamicsError`` naming the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import HeadStats

ANALYSES = ("odds_ratio", "trajectories")
SKIP_KEYS = ("skipped_long", "truncated", "skipped_undecodable")
MAX_COUNT = 1 << 62
# float64 sums: the smallest exponent is that of the least subnormal (-1074, rounded down to a
# multiple of 32), the largest bit that of 2**63 values of at most 2**1024 (+ a sign limb)
MIN_EXPONENT, MAX_TOP_BIT = -1088, 1088 + 32
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEADER_KEYS = {"format", "version", "model", "analyses", "settings", "n_prompts", "prompts_hash"}
_ODDS_KEYS = {"model", "layers", "heads", "scale", "softcap", "n_prompts", "sum_keys"}
# The header's required fields by format version, in one place: version 2 added the BOS count
# (and, in the odds-ratio section, the first key's alpha among the sink sums, at eps); version 3
# the fingerprints of the model, its configuration and tokenizer, and the batches' hash.
HEADER_FIELDS = {
    1: _HEADER_KEYS,
    2: _HEADER_KEYS | {"bos_prompts"},
    3: _HEADER_KEYS | {"bos_prompts", "fingerprints", "batches_hash"},
}
ODDS_FIELDS = {1: _ODDS_KEYS, 2: _ODDS_KEYS | {"sink_keys", "sink_epsilon"}}
# version 3 also keeps the Poisson bootstrap replicates of the label sums (docs/math.md §9)
ODDS_FIELDS[3] = ODDS_FIELDS[2] | {"boot_keys", "boot_seed"}
OPTIONAL_FIELDS = {"odds_ratio", "trajectories", "corpus"}
FINGERPRINTS = ("weights", "config", "tokenizer")
# The sink sums of format version 1 (``HeadStats.SINK_SUM_KEYS`` without the first key's alpha).
V1_SINK_KEYS = ("sink_mass", "sink_first", "sink_by_prior", "sink_prior_adv", "sink_loglik_adv")
_META_TYPES = {
    "architecture": str,
    "d_model": int,
    "eps": list,
    "flattened": bool,
    "labels": list,
    "lens_note": str,
    "n_bins": int,
    "skip_first": bool,
    "standardize": str,
}


def fail(what: str, message: str) -> TLDynamicsError:
    return TLDynamicsError(f"{what}: malformed statistics header: {message}")


def _int(value: Any, what: str, field: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise fail(what, f"{field} must be an integer in {low}..{high}, got {value!r}")
    return value


def _float(value: Any, what: str, field: str, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        kind = "a positive finite number" if positive else "a finite number"
        raise fail(what, f"{field} must be {kind}, got {value!r}")
    return float(value)


def _list(value: Any, what: str, field: str) -> list:
    if not isinstance(value, list):
        raise fail(what, f"{field} must be a list, got {type(value).__name__}")
    return value


def _indices(value: Any, what: str, field: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if allow_none and isinstance(value, int) and not isinstance(value, bool):
        _int(value, what, field, 0, 1 << 20)
        return
    items = _list(value, what, field)
    for v in items:
        _int(v, what, field, 0, 1 << 20)
    if len(set(items)) != len(items):
        raise fail(what, f"{field} repeats an index: {items}")


def _keys(
    d: Any,
    what: str,
    field: str,
    required: AbstractSet[str],
    optional: AbstractSet[str] = frozenset(),
) -> dict:
    if not isinstance(d, dict):
        raise fail(what, f"{field} must be an object, got {type(d).__name__}")
    missing, extra = required - set(d), set(d) - required - optional
    if missing or extra:
        raise fail(what, f"{field}: missing {sorted(missing)}, unknown {sorted(extra)}")
    return d


def sink_keys(header: dict[str, Any]) -> tuple[str, ...]:
    """The sink sums a checked header's file holds (by its version)."""
    return V1_SINK_KEYS if header["version"] == 1 else HeadStats.SINK_SUM_KEYS


def check_header(header: Any, what: str) -> None:
    """The header's fields alone (types, ranges, known analyses, consistent settings), for its
    ``version`` (1 or 2, checked by the reader before)."""
    version = header.get("version") if isinstance(header, dict) else None
    version = version if version in HEADER_FIELDS else max(HEADER_FIELDS)
    v2 = version >= 2
    h = _keys(header, what, "header", HEADER_FIELDS[version], OPTIONAL_FIELDS)
    analyses = _list(h["analyses"], what, "analyses")
    if not analyses or analyses != [a for a in ANALYSES if a in analyses]:
        raise fail(
            what, f"analyses {analyses!r}: expected one or more of {list(ANALYSES)}, in that order"
        )
    for a in ANALYSES:
        if (a in analyses) != (a in h):
            raise fail(what, f"analyses {analyses} and the {a!r} section disagree")
    if not isinstance(h["model"], str) or not h["model"]:
        raise fail(what, f"model must be a non-empty string, got {h['model']!r}")
    _int(h["n_prompts"], what, "n_prompts")
    if v2:
        _int(h["bos_prompts"], what, "bos_prompts", 0, h["n_prompts"])
    hexes = [("prompts_hash", h["prompts_hash"])]
    if version >= 3:
        hexes.append(("batches_hash", h["batches_hash"]))
        prints = _keys(h["fingerprints"], what, "fingerprints", set(FINGERPRINTS))
        hexes += [(f"fingerprints.{k}", prints[k]) for k in FINGERPRINTS]
    for field, value in hexes:
        if not isinstance(value, str) or not _HEX64.match(value):
            raise fail(what, f"{field} must be 64 lowercase hexadecimal digits")
    if "corpus" in h:
        corpus = _keys(h["corpus"], what, "corpus", set(), set(SKIP_KEYS))
        for key, n in corpus.items():
            _int(n, what, f"corpus.{key}")
        if not any(corpus.values()):
            raise fail(what, "corpus is written only when something was left out or cut")
    _check_settings(h["settings"], analyses, what)
    if "odds_ratio" in h:
        _check_odds(h["odds_ratio"], h["n_prompts"], what, version)
    if "trajectories" in h:
        t = _keys(h["trajectories"], what, "trajectories", {"meta", "ints", "sums"})
        meta = _keys(t["meta"], what, "trajectories.meta", set(_META_TYPES))
        for key, kind in _META_TYPES.items():
            if isinstance(meta[key], bool) != (kind is bool) or not isinstance(meta[key], kind):
                raise fail(
                    what, f"trajectories.meta.{key} must be {kind.__name__}, got {meta[key]!r}"
                )
        _int(meta["d_model"], what, "trajectories.meta.d_model", 1, 1 << 20)
        _int(meta["n_bins"], what, "trajectories.meta.n_bins", 1, 1 << 16)
        for e in meta["eps"]:
            _float(e, what, "trajectories.meta.eps", positive=True)
        if not meta["labels"] or not all(isinstance(x, str) for x in meta["labels"]):
            raise fail(what, "trajectories.meta.labels must be a non-empty list of strings")
        for key in ("ints", "sums"):
            names = _list(t[key], what, f"trajectories.{key}")
            if not all(isinstance(n, str) for n in names) or names != sorted(set(names)):
                raise fail(what, f"trajectories.{key} must be sorted distinct names")


def _check_settings(settings: Any, analyses: list[str], what: str) -> None:
    s = _keys(settings, what, "settings", {"batch_size", "padding_side", *analyses}, {"on_long"})
    _int(s["batch_size"], what, "settings.batch_size", 1)
    if s["padding_side"] not in ("left", "right"):
        raise fail(what, f"settings.padding_side {s['padding_side']!r}: valid are left, right")
    if "on_long" in s and s["on_long"] not in ("skip", "truncate"):
        raise fail(what, f"settings.on_long {s['on_long']!r}: valid are skip, truncate")
    if "odds_ratio" in s:
        o = _keys(s["odds_ratio"], what, "settings.odds_ratio", {"layers", "heads"})
        _indices(o["layers"], what, "settings.odds_ratio.layers", allow_none=True)
        _indices(o["heads"], what, "settings.odds_ratio.heads", allow_none=True)
    if "trajectories" in s:
        t = _keys(s["trajectories"], what, "settings.trajectories", {"layers", "eps", "lens"})
        _indices(t["layers"], what, "settings.trajectories.layers", allow_none=True)
        for e in _list(t["eps"], what, "settings.trajectories.eps"):
            _float(e, what, "settings.trajectories.eps", positive=True)
        if not isinstance(t["lens"], bool):
            raise fail(what, f"settings.trajectories.lens must be true or false, got {t['lens']!r}")


def _check_odds(o: Any, n_prompts: int, what: str, version: int) -> None:
    o = _keys(o, what, "odds_ratio", ODDS_FIELDS[version])
    v2 = version >= 2
    if v2 and o["sink_keys"] != list(HeadStats.SINK_SUM_KEYS):
        raise fail(
            what,
            f"odds_ratio.sink_keys {o['sink_keys']!r}: expected {list(HeadStats.SINK_SUM_KEYS)}",
        )
    if v2 and not 0.0 <= _float(o["sink_epsilon"], what, "odds_ratio.sink_epsilon") < 1.0:
        raise fail(what, f"odds_ratio.sink_epsilon must lie in [0, 1), got {o['sink_epsilon']!r}")
    if not isinstance(o["model"], str):
        raise fail(what, "odds_ratio.model must be a string")
    for key in ("layers", "heads"):
        _indices(o[key], what, f"odds_ratio.{key}")
        if not o[key]:
            raise fail(what, f"odds_ratio.{key} is empty")
    n = len(o["layers"])
    for key, none_ok in (("scale", False), ("softcap", True)):
        values = _list(o[key], what, f"odds_ratio.{key}")
        if len(values) != n:
            raise fail(what, f"odds_ratio.{key} has {len(values)} entries for {n} layers")
        for v in values:
            if not (none_ok and v is None):
                _float(v, what, f"odds_ratio.{key}", positive=True)
    if _int(o["n_prompts"], what, "odds_ratio.n_prompts") != n_prompts:
        raise fail(what, f"odds_ratio.n_prompts {o['n_prompts']} != n_prompts {n_prompts}")
    if version >= 3 and o["boot_keys"] != list(HeadStats.BOOT_KEYS):
        raise fail(
            what, f"odds_ratio.boot_keys {o['boot_keys']!r}: expected {list(HeadStats.BOOT_KEYS)}"
        )
    if version >= 3:
        _int(o["boot_seed"], what, "odds_ratio.boot_seed")
    if o["sum_keys"] != list(HeadStats.SUM_KEYS):
        listed = o["sum_keys"] if isinstance(o["sum_keys"], list) else []
        missing = [k for k in HeadStats.SUM_KEYS if k not in listed]
        kept_later = {  # sums tl_dynamics added later, by what they are
            "learned_sink": "the learned-sink sum",
            "top_real": "the counterfactuals' agreement sums (top_*)",
        }
        later = [kept_later[k] for k in missing if k in kept_later]
        older = [k for k in HeadStats.SUM_KEYS if k not in missing]
        why = (
            f"; it was written before tl_dynamics kept {' and '.join(later)}: recompute it with "
            "`tl-dynamics stats`"
            if later and listed == older
            else ""
        )
        raise fail(
            what, f"odds_ratio.sum_keys {o['sum_keys']!r}: expected {list(HeadStats.SUM_KEYS)}{why}"
        )


def _traj_shapes(meta: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every trajectory array the header's meta implies (points P, thresholds E,
    histogram bins B, model width D)."""
    p, e, b, d = len(meta["labels"]), len(meta["eps"]), meta["n_bins"], meta["d_model"]
    sums: dict[str, tuple[int, ...]] = {
        name: (p,)
        for name in (
            "norm",
            "cos_final",
            "cos_embed",
            "dist_embed",
            "cos_unembed",
            "dist_unembed",
            "log_rank",
            "cos_sum",
            "erank",
        )
    }
    sums.update(step=(max(p - 1, 0),), rel_step=(max(p - 1, 0),), turning=(max(p - 2, 0),))
    shapes: dict[str, tuple[int, ...]] = {f"sums.{k}": v for k, v in sums.items()}
    shapes.update({f"ints.count_{k}": v for k, v in sums.items()})
    shapes.update(
        {
            "sums.state_sum": (p, d),
            "sums.state_sumsq": (p, d),
            "ints.n_tokens": (),
            "ints.n_prompts": (),
            "ints.n_lens_tokens": (),
            "ints.rank_sum": (p,),
            "ints.top1": (p,),
            "ints.settling": (p + 1,),
            "ints.cos_hist": (p, b),
            "ints.n_pairs": (p,),
            "ints.clusters": (e, p),
            "ints.merges": (e, max(p - 1, 0)),
            "ints.splits": (e, max(p - 1, 0)),
        }
    )
    return shapes


def _check_exact(
    tensors: dict[str, np.ndarray], prefix: str, shape: tuple[int, ...], what: str, used: set[str]
) -> None:
    names = {f"{prefix}.limbs", f"{prefix}.exponent"}
    special = f"{prefix}.special"
    missing = [n for n in names if n not in tensors]
    if missing:
        raise fail(what, f"tensor {missing[0]!r} is missing")
    limbs, exponent = tensors[f"{prefix}.limbs"], tensors[f"{prefix}.exponent"]
    if limbs.dtype != np.int64 or exponent.dtype != np.int64 or exponent.shape != (1,):
        raise fail(what, f"{prefix}: limbs and exponent must be int64 (exponent one element)")
    if limbs.ndim < 1 or tuple(limbs.shape[1:]) != shape or not 1 <= limbs.shape[0]:
        raise fail(
            what,
            f"{prefix}.limbs has shape {list(limbs.shape)}; the header implies "
            f"[n_limbs, {', '.join(map(str, shape))}]",
        )
    e = int(exponent[0])
    if e < MIN_EXPONENT or e + 32 * limbs.shape[0] > MAX_TOP_BIT:
        raise fail(
            what, f"{prefix}: exponent {e} with {limbs.shape[0]} limbs is outside float64's range"
        )
    used |= names | ({special} if special in tensors else set())


def check_tensors(header: dict[str, Any], tensors: dict[str, np.ndarray], what: str) -> None:
    """Every tensor the header names has the dtype and shape it implies; none is left over;
    counts are non-negative and agree with the header's."""
    used: set[str] = set()
    if "odds_ratio" in header:
        o = header["odds_ratio"]
        shape = (
            len(o["layers"]),
            len(HeadStats.SUM_KEYS) + len(sink_keys(header)),
            len(o["heads"]),
        )
        _check_exact(tensors, "odds_ratio.sums", shape, what, used)
        if "boot_keys" in o:  # version 3: the replicates, [n_boot, layer, key, head]
            limbs = tensors.get("odds_ratio.boot.limbs")
            n_boot = int(limbs.shape[1]) if limbs is not None and limbs.ndim == 5 else -1
            if not 1 <= n_boot:
                raise fail(
                    what, "odds_ratio.boot.limbs must be [n_limbs, n_boot, layer, key, head]"
                )
            boot = (n_boot, len(o["layers"]), len(HeadStats.BOOT_KEYS), len(o["heads"]))
            _check_exact(tensors, "odds_ratio.boot", boot, what, used)
    if "trajectories" in header:
        t = header["trajectories"]
        shapes = _traj_shapes(t["meta"])
        for kind in ("ints", "sums"):
            for name in t[kind]:
                key = f"{kind}.{name}"
                if key not in shapes:
                    raise fail(what, f"unknown trajectory statistic {key!r}")
                full = f"trajectories.{key}"
                if kind == "sums":
                    _check_exact(tensors, full, shapes[key], what, used)
                    continue
                array = tensors.get(full)
                if array is None or array.dtype != np.int64 or array.shape != shapes[key]:
                    raise fail(
                        what,
                        f"tensor {full!r} must be int64 of shape "
                        f"{list(shapes[key])}, got "
                        f"{None if array is None else (array.dtype.name, list(array.shape))}",
                    )
                if (array < 0).any():
                    raise fail(what, f"tensor {full!r} holds negative counts")
                used.add(full)
        if t["ints"] and (
            "n_prompts" not in t["ints"]
            or int(tensors["trajectories.ints.n_prompts"]) != header["n_prompts"]
        ):
            raise fail(what, "trajectories.ints.n_prompts disagrees with n_prompts")
        setting = header["settings"]["trajectories"]
        if [float(e) for e in setting["eps"]] != [float(e) for e in t["meta"]["eps"]]:
            raise fail(what, "settings.trajectories.eps disagrees with trajectories.meta.eps")
        if not setting["lens"] and "rank_sum" in t["ints"]:
            raise fail(what, "settings.trajectories.lens is false but the file has lens statistics")
    extra = sorted(set(tensors) - used)
    if extra:
        raise fail(what, f"tensor {extra[0]!r} is not described by the header")


def check_position(position: Any, what: str) -> int:
    """A checkpoint's position: ``{"next_batch": i}`` with ``i >= 1``."""
    p = _keys(position, what, "checkpoint", {"next_batch"})
    return _int(p["next_batch"], what, "checkpoint.next_batch", 1)
