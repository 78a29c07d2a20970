"""The statistics file (docs/stats-format.md): safetensors tensors plus a small JSON header.

Every real number is an exact sum (``tl_dynamics.collect.ExactSum``: int64 limbs and one exponent per
array), every count an int64 array, so a file is a function of the corpus, the model and the
settings alone: the same statistics give the same bytes however many workers computed them.
This module defines ``DatasetStats`` and writes the files; ``tl_dynamics.scale._read`` reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tl_dynamics import files
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import HeadStats
from tl_dynamics.collect import ExactSum
from tl_dynamics.scale._corpus import ON_LONG
from tl_dynamics.scale._provenance import _HASH_MOD, FINGERPRINTS, fingerprint_changes
from tl_dynamics.scale._validate import ANALYSES, SKIP_KEYS, V1_SINK_KEYS
from tl_dynamics.scale._values import check_values
from tl_dynamics.trajectories import TrajectoryStats

# Version 2 added each prompt's first-key alpha (Sink^eps: ``odds_ratio.sink_keys``,
# ``sink_epsilon``) and the count of prompts that begin with a BOS token (``bos_prompts``);
# version 3 what the numbers were computed from (``fingerprints`` of the model's weights,
# configuration and tokenizer; ``batches_hash`` of the batches in their order). Older files
# still load, without them (docs/stats-format.md).
FORMAT, VERSION, READABLE = "tl-dynamics-stats", 3, (1, 2, 3)
# what each older version lacks (a merge with a newer file is refused, saying so)
OLDER = {
    1: "version 1 files predate Sink^eps and the BOS count",
    2: "version 2 files predate the fingerprints of the model, tokenizer and batches",
}

HEADER_KEY, CHECKSUM_KEY, CHECKPOINT_KEY = (
    "tl_dynamics_stats",
    "tl_dynamics_sha256",
    "tl_dynamics_checkpoint",
)


@dataclass(frozen=True, eq=False)
class DatasetStats:
    """The dataset-level statistics of one corpus, with what was computed how.

    Odds-ratio head statistics and trajectory statistics (either may be None when not asked for).
    Two statistics merge only when model, analyses and settings agree. Equality is byte equality of
    the saved files. ``DatasetStats.ANALYSES`` names the analyses a run can ask for and
    ``DatasetStats.ON_LONG`` the ``on_long`` policies.

    Args:
        model: The model's name, as recorded in the file.
        settings: The run's inputs that change the numbers (batch size, padding side, the
            analyses' layers/heads/eps/lens).
        n_prompts: How many prompts were used.
        prompts_hash: An order-independent hash of the prompts.
        odds_ratio: The odds-ratio head statistics (``odds_ratio.HeadStats``), or None.
        trajectories: The trajectory statistics (``trajectories.TrajectoryStats``), or None.
        skipped: The corpus lines the run's ``on_long`` policy left out or cut
            (``skipped_long``, ``truncated``, ``skipped_undecodable``; empty when none).
        bos_prompts: How many prompts begin with the tokenizer's BOS token (their first real
            token is its id: one was prepended); None in files of format version 1, which did
            not record it (``version``).
        fingerprints: SHA-256 of the model's weights, configuration and tokenizer
            (``weights``, ``config``, ``tokenizer``: ``ModelAdapter.fingerprints``); None in
            files of format versions 1 and 2.
        batches_hash: The sum of ``batch_hash`` over the batches (sensitive to the prompts'
            order within and across batches); None in files of format versions 1 and 2.

    Example:
        >>> from tl_dynamics import scale, testing
        >>> model = testing.cached_model("gpt2")
        >>> stats = scale.run_stats(model, ["a = 1", "b = 2"], progress=False, model_name="tiny")
        >>> stats
        DatasetStats(tiny, analyses=['odds_ratio', 'trajectories'], prompts=2)
    """

    ANALYSES: ClassVar[tuple[str, ...]] = ANALYSES
    ON_LONG: ClassVar[tuple[str, ...]] = ON_LONG

    model: str
    settings: dict[str, Any]
    n_prompts: int
    prompts_hash: int
    odds_ratio: HeadStats | None = None
    trajectories: TrajectoryStats | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    bos_prompts: int | None = None
    fingerprints: dict[str, str] | None = None
    batches_hash: int | None = None

    @property
    def version(self) -> int:
        """The file format version these statistics are written in.

        1 when they come from a file of version 1 (no first-key alpha, no BOS count), 2 from a
        file of version 2 (no fingerprints), else ``VERSION``.

        Example:
            >>> from tl_dynamics import scale, testing
            >>> stats = scale.run_stats(testing.cached_model("gpt2"), ["a = 1"], progress=False)
            >>> stats.version, stats.bos_prompts
            (3, 1)
        """
        if self.bos_prompts is None:
            return 1
        return 2 if self.fingerprints is None else VERSION

    @property
    def analyses(self) -> tuple[str, ...]:
        """The analyses these statistics hold, in ``DatasetStats.ANALYSES`` order.

        Example:
            >>> from tl_dynamics import scale, testing
            >>> model = testing.cached_model("gpt2")
            >>> scale.run_stats(model, ["a = 1"], analyses=["trajectories"], progress=False,
            ...                 model_name="tiny").analyses
            ('trajectories',)
        """
        return tuple(a for a in ANALYSES if getattr(self, a) is not None)

    def __repr__(self) -> str:
        return (
            f"DatasetStats({self.model}, analyses={list(self.analyses)}, prompts={self.n_prompts})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DatasetStats) and to_bytes(self) == to_bytes(other)

    __hash__ = None  # type: ignore[assignment]

    def merge(self, other: "DatasetStats") -> "DatasetStats":
        """Both corpora's statistics, exactly (order-independent, bit-identical).

        Args:
            other: Statistics of the same model, analyses and settings.

        Returns:
            The merged ``DatasetStats``.

        Example:
            >>> from tl_dynamics import scale, testing
            >>> model = testing.cached_model("gpt2")
            >>> a = scale.run_stats(model, ["a = 1"], progress=False, model_name="tiny")
            >>> b = scale.run_stats(model, ["b = 2"], progress=False, model_name="tiny")
            >>> a.merge(b) == b.merge(a), a.merge(b).n_prompts
            (True, 2)
        """
        if not isinstance(other, DatasetStats):
            raise TLDynamicsError(f"can only merge DatasetStats, got {type(other).__name__}")
        mine = {"model": self.model, "analyses": self.analyses, "settings": self.settings}
        theirs = {"model": other.model, "analyses": other.analyses, "settings": other.settings}
        if self.version != other.version:
            older = min(self.version, other.version)
            raise TLDynamicsError(
                f"cannot merge statistics of format versions {self.version} and "
                f"{other.version}: {OLDER[older]}; recompute the older one with "
                "`tl-dynamics stats`"
            )
        diff = [f"{k} ({mine[k]!r} vs {theirs[k]!r})" for k in mine if mine[k] != theirs[k]]
        diff += fingerprint_changes(self.fingerprints, other.fingerprints)
        if diff:
            raise TLDynamicsError(
                "cannot merge statistics of different runs: they differ in " + ", ".join(diff)
            )
        trajectories = (
            None
            if self.trajectories is None or other.trajectories is None
            else self.trajectories.merge(other.trajectories)
        )
        check_values(None, trajectories, "the merged statistics")  # int64 counts: no wrap
        return DatasetStats(
            self.model,
            self.settings,
            self.n_prompts + other.n_prompts,
            (self.prompts_hash + other.prompts_hash) % _HASH_MOD,
            # the same analyses on both sides (checked above): both None or both there
            None
            if self.odds_ratio is None or other.odds_ratio is None
            else self.odds_ratio.merge(other.odds_ratio),
            trajectories,
            {
                k: self.skipped.get(k, 0) + other.skipped.get(k, 0)
                for k in SKIP_KEYS
                if self.skipped.get(k, 0) + other.skipped.get(k, 0)
            },
            None
            if self.bos_prompts is None or other.bos_prompts is None
            else self.bos_prompts + other.bos_prompts,
            self.fingerprints,
            None
            if self.batches_hash is None or other.batches_hash is None
            else (self.batches_hash + other.batches_hash) % _HASH_MOD,
        )


# ---------------------------------------------------------------------- writing
_DTYPES = {np.dtype(np.int64): ("I64", "<i8"), np.dtype(np.uint8): ("U8", "u1")}


def _pack(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file with its header in sorted order (the library's own writer orders
    the header as a hash map does, so equal contents would not give equal bytes)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    chunks, offset = [], 0
    for name in sorted(tensors):
        array = tensors[name]
        code, little = _DTYPES[array.dtype]
        data = np.array(array, dtype=little, order="C").tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _put_exact(tensors: dict[str, np.ndarray], prefix: str, value: ExactSum) -> None:
    for name, array in value.arrays().items():
        tensors[f"{prefix}.{name}"] = np.array(array, order="C")


def _checksum(tensors: dict[str, np.ndarray], header: str) -> str:
    digest = hashlib.sha256(header.encode("utf-8"))
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(np.array(array, order="C").tobytes())
    return digest.hexdigest()


def to_bytes(stats: DatasetStats, checkpoint: dict[str, Any] | None = None) -> bytes:
    """The file's bytes (``save_stats`` writes them)."""
    tensors: dict[str, np.ndarray] = {}
    version = stats.version
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": version,
        "model": stats.model,
        "analyses": list(stats.analyses),
        "settings": _plain(stats.settings),
        "n_prompts": int(stats.n_prompts),
        "prompts_hash": f"{stats.prompts_hash:064x}",
    }
    skipped = {k: int(v) for k, v in sorted(stats.skipped.items()) if v}
    if skipped:  # only when lines were left out or cut: clean corpora keep their bytes
        header["corpus"] = skipped
    if version >= 2:
        header["bos_prompts"] = int(stats.bos_prompts or 0)
    if version >= 3:
        prints = stats.fingerprints or {}
        if stats.batches_hash is None or sorted(prints) != sorted(FINGERPRINTS):
            raise TLDynamicsError(
                f"statistics of format version {version} record the fingerprints "
                f"{list(FINGERPRINTS)} and a batches_hash; these have {stats.fingerprints} and "
                f"{stats.batches_hash}"
            )
        header["fingerprints"] = {k: str(prints[k]) for k in FINGERPRINTS}
        header["batches_hash"] = f"{stats.batches_hash:064x}"
    h = stats.odds_ratio
    if h is not None:
        if h.exact is None:
            raise TLDynamicsError("these odds-ratio statistics have no exact sums to save")
        expected = V1_SINK_KEYS if version == 1 else HeadStats.SINK_SUM_KEYS
        if tuple(h.sink_keys) != expected:
            raise TLDynamicsError(
                f"statistics of format version {version} hold the sink sums {list(expected)}, "
                f"these odds-ratio statistics {list(h.sink_keys)}: a BOS count (bos_prompts) "
                "goes with the first key's alpha"
            )
        header["odds_ratio"] = {
            "model": h.model,
            "layers": list(h.layers),
            "heads": list(h.heads),
            "scale": list(h.scale),
            "softcap": list(h.softcap),
            "n_prompts": int(h.n_prompts),
            "sum_keys": list(h.sum_keys),
        }
        if version >= 2:
            header["odds_ratio"].update(sink_keys=list(h.sink_keys), sink_epsilon=h.sink_eps)
        _put_exact(tensors, "odds_ratio.sums", h.exact)
        if version >= 3:  # the labels' bootstrap replicates (docs/math.md §9)
            if h.boot is None:
                raise TLDynamicsError(
                    "these odds-ratio statistics have no bootstrap replicates to save (format "
                    f"version {version} keeps them: compute them with odds_ratio.attach/compute)"
                )
            header["odds_ratio"].update(boot_keys=list(h.boot.keys), boot_seed=int(h.boot.seed))
            _put_exact(tensors, "odds_ratio.boot", h.boot.exact)
    t = stats.trajectories
    if t is not None:
        header["trajectories"] = {
            "meta": _plain(t.meta),
            "ints": sorted(t.ints),
            "sums": sorted(t.sums),
        }
        for name, array in t.ints.items():
            tensors[f"trajectories.ints.{name}"] = np.array(array, dtype=np.int64, order="C")
        for name, value in t.sums.items():
            _put_exact(tensors, f"trajectories.sums.{name}", value)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False)
    meta = {HEADER_KEY: text, CHECKSUM_KEY: _checksum(tensors, text)}
    if checkpoint is not None:
        meta[CHECKPOINT_KEY] = json.dumps(checkpoint, sort_keys=True)
    return _pack(tensors, meta)


def save_stats(
    stats: DatasetStats, path: str | os.PathLike, checkpoint: dict[str, Any] | None = None
) -> Path:
    """Write statistics to a file (atomically: a temporary file renamed into place).

    The format is docs/stats-format.md: a ``.safetensors`` file whose bytes depend only on the
    statistics.

    Args:
        stats: The ``DatasetStats``.
        path: The file to write.
        checkpoint: Where an unfinished run stands (written by ``run_stats`` into its
            ``.partial`` checkpoints); None for a finished file.

    Returns:
        The path written.

    Example:
        >>> import tempfile, pathlib
        >>> from tl_dynamics import scale, testing
        >>> model = testing.cached_model("gpt2")
        >>> stats = scale.run_stats(model, ["a = 1", "b = 2"], progress=False, model_name="tiny")
        >>> path = scale.save_stats(stats, pathlib.Path(tempfile.mkdtemp()) / "s.safetensors")
        >>> scale.load_stats(path) == stats
        True
    """
    return files.write_bytes(Path(path), to_bytes(stats, checkpoint))
