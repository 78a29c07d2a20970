"""Reading a statistics file (docs/stats-format.md) back, bit-exactly, and merging files.

Corrupt, crafted or foreign files and unfinished runs' checkpoints are refused by name
(``tl_dynamics.scale._validate`` checks the header and tensors before anything is parsed);
``tl_dynamics.scale._format`` defines ``DatasetStats`` and writes the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load

from tl_dynamics import files
from tl_dynamics.collect import ExactSum
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import HeadStats
from tl_dynamics.scale import _validate
from tl_dynamics.scale._values import check_values
from tl_dynamics.scale._format import (
    CHECKPOINT_KEY,
    CHECKSUM_KEY,
    FORMAT,
    HEADER_KEY,
    READABLE,
    DatasetStats,
    _checksum,
)
from tl_dynamics.trajectories import TrajectoryStats


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _exact(tensors: dict[str, np.ndarray], prefix: str, what: str) -> ExactSum:
    parts = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    return ExactSum.from_arrays(parts, what)


def from_bytes(
    data: bytes, what: str = "statistics", allow_partial: bool = False
) -> tuple[DatasetStats, dict | None]:
    """Parse a file's bytes; returns the statistics and the checkpoint position (or None).
    A checkpoint (an unfinished run's ``.partial``) is refused unless ``allow_partial``."""
    try:
        tensors = st_load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except Exception as exc:  # safetensors, JSON and index errors alike: not a readable file
        raise TLDynamicsError(
            f"{what} is not a tl-dynamics statistics file (corrupt or truncated safetensors: {exc})"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get(HEADER_KEY), str):
        raise _no_header(what)
    text = meta[HEADER_KEY]
    if meta.get(CHECKSUM_KEY) != _checksum(tensors, text):
        raise TLDynamicsError(f"{what} is corrupt: its contents do not match its checksum")
    unknown = sorted(set(meta) - {HEADER_KEY, CHECKSUM_KEY, CHECKPOINT_KEY})
    if unknown:
        raise _validate.fail(what, f"unknown metadata {unknown}")
    position = None
    if CHECKPOINT_KEY in meta:
        if not allow_partial:
            raise TLDynamicsError(
                f"{what} is the checkpoint of an unfinished run (a .partial "
                "file), not finished statistics; finish it with `tl-dynamics "
                "stats ... --resume`, or pass --allow-partial to read it anyway"
            )
        position = _validate.check_position(_json(meta[CHECKPOINT_KEY], what), what)
    header = _checked_header(text, what)
    _validate.check_tensors(header, tensors, what)
    try:
        stats = _parse(header, tensors, what)
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
        raise TLDynamicsError(f"{what}: malformed statistics header ({exc!r})") from None
    check_values(stats.odds_ratio, stats.trajectories, what)
    return stats, None if position is None else {"next_batch": position}


def _no_header(what: str) -> TLDynamicsError:
    return TLDynamicsError(
        f"{what} is a safetensors file but not tl-dynamics statistics (no {HEADER_KEY!r} header)"
    )


def _checked_header(text: str, what: str) -> dict[str, Any]:
    """The JSON header, of a format and version this reader reads, its fields checked."""
    header = _json(text, what)
    if (
        not isinstance(header, dict)
        or header.get("format") != FORMAT
        or type(header.get("version")) is not int
        or header.get("version") not in READABLE
    ):
        got = (
            header
            if not isinstance(header, dict)
            else f"format {header.get('format')!r} version {header.get('version')!r}"
        )
        raise TLDynamicsError(
            f"{what}: {got}; this tl_dynamics reads {FORMAT!r} versions "
            f"{', '.join(map(str, READABLE))}"
        )
    _validate.check_header(header, what)
    return header


def _json(text: str, what: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not a JSON number")

    try:
        return json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as exc:
        raise _validate.fail(what, f"not valid JSON ({exc})") from None


def _parse(header: dict[str, Any], tensors: dict[str, np.ndarray], what: str) -> DatasetStats:
    heads = trajs = None
    if "odds_ratio" in header["analyses"]:
        o = header["odds_ratio"]
        heads = HeadStats.from_exact(
            o["model"],
            tuple(o["layers"]),
            tuple(o["heads"]),
            tuple(o["scale"]),
            tuple(o["softcap"]),
            o["n_prompts"],
            _exact(tensors, "odds_ratio.sums", f"{what} odds_ratio"),
            tuple(o["sum_keys"]),
            _validate.sink_keys(header),
            float(o.get("sink_epsilon", HeadStats.SINK_EPSILON)),  # version 1: no alpha counted
            # version 3: the bootstrap replicates of the label sums (earlier files: none)
            _exact(tensors, "odds_ratio.boot", f"{what} odds_ratio") if "boot_keys" in o else None,
            int(o.get("boot_seed", 0)),
        )
    if "trajectories" in header["analyses"]:
        t = header["trajectories"]
        ints = {k: tensors[f"trajectories.ints.{k}"] for k in t["ints"]}
        if any(v.dtype != np.int64 for v in ints.values()):
            raise TLDynamicsError(f"{what}: trajectory counts must be int64")
        sums = {
            k: _exact(tensors, f"trajectories.sums.{k}", f"{what} trajectories {k}")
            for k in t["sums"]
        }
        trajs = TrajectoryStats(
            meta={k: _tuples(v) for k, v in t["meta"].items()}, ints=ints, sums=sums
        )
    return DatasetStats(
        header["model"],
        header["settings"],
        int(header["n_prompts"]),
        int(header["prompts_hash"], 16),
        heads,
        trajs,
        dict(header.get("corpus", {})),
        header.get("bos_prompts"),  # None in version 1 files
        header.get("fingerprints"),  # None in version 1 and 2 files
        None if "batches_hash" not in header else int(header["batches_hash"], 16),
    )


MAX_HEADER = 100_000_000  # the safetensors library's own limit on a header


def read_stats_file(
    path: Path, what: str, allow_partial: bool = False
) -> tuple[DatasetStats, dict | None]:
    """``from_bytes`` of a file, read with care: anything but a regular file is named for what it
    is (a directory, a FIFO, a device such as ``/dev/zero``) before it is opened, and the header
    is read first: its length checked against the file's size, its format and version, and the
    tensors' total size against the file's, so a large file that is not statistics is refused
    after reading its first bytes, not all of them."""
    problem = files.not_a_file(path)
    if problem is not None:
        raise TLDynamicsError(f"{what} {problem}: give a statistics file from `tl-dynamics stats`")
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            _check_header_first(handle, size, what)
            handle.seek(0)
            data = handle.read()
    except OSError as exc:
        raise TLDynamicsError(f"{what}: cannot be read ({exc.strerror or exc})") from None
    return from_bytes(data, what, allow_partial)


def _check_header_first(handle: Any, size: int, what: str) -> None:
    """The safetensors header alone: its length against the file's size, the statistics header
    in its metadata (format, version, fields) and the tensors' total size against the bytes that
    follow, before the tensors are read."""

    def refuse(why: str) -> TLDynamicsError:
        return TLDynamicsError(f"{what} is not a tl-dynamics statistics file ({why})")

    head = handle.read(8)
    if len(head) < 8:
        raise refuse(f"{size} bytes: shorter than a safetensors header's length")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, MAX_HEADER):
        raise refuse(
            f"its first 8 bytes give a header of {n} bytes, but {size - 8} follow them (and a "
            f"safetensors header has at most {MAX_HEADER})"
        )
    try:
        header = json.loads(handle.read(n))
        meta = header.get("__metadata__") or {}
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        data = max((int(e) for e in ends), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        raise refuse("its header is not safetensors JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get(HEADER_KEY), str):
        raise _no_header(what)
    _checked_header(meta[HEADER_KEY], what)
    if data != size - 8 - n:
        raise refuse(
            f"its header describes {data} bytes of tensors, but {size - 8 - n} follow it: "
            "truncated, or grown"
        )


def load_stats(path: str | os.PathLike, allow_partial: bool = False) -> DatasetStats:
    """Read a statistics file back, bit-exactly.

    Corrupt, crafted or foreign files are refused clearly, and an unfinished run's checkpoint
    (``.partial``) unless ``allow_partial``.

    Args:
        path: The ``.safetensors`` file.
        allow_partial: Accept a checkpoint of an unfinished run.

    Returns:
        The ``DatasetStats``.

    Example:
        >>> import tempfile, pathlib
        >>> from tl_dynamics import scale, testing
        >>> stats = scale.run_stats(testing.cached_model("gpt2"), ["a = 1"], progress=False)
        >>> path = scale.save_stats(stats, pathlib.Path(tempfile.mkdtemp()) / "s.safetensors")
        >>> scale.load_stats(path).n_prompts
        1
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TLDynamicsError(f"load_stats takes a file path, got {type(path).__name__}")
    path = Path(path)
    return read_stats_file(path, f"statistics file {str(path)!r}", allow_partial)[0]


def merge_stats(*items: DatasetStats | str | os.PathLike) -> DatasetStats:
    """Merge statistics (objects or file paths) of the same model and settings, exactly.

    Args:
        *items: ``DatasetStats`` objects or paths of statistics files (at least one); the same
            prompts twice are refused.

    Returns:
        The merged ``DatasetStats`` (the same bytes in any order).

    Example:
        >>> from tl_dynamics import scale, testing
        >>> model = testing.cached_model("gpt2")
        >>> texts = ["a = 1", "b = 2", "c = 3"]
        >>> parts = [scale.run_stats(model, [text], batch_size=1, progress=False, model_name="tiny")
        ...          for text in texts]
        >>> whole = scale.run_stats(model, texts, batch_size=1, progress=False, model_name="tiny")
        >>> scale.merge_stats(*parts) == whole
        True
    """
    if not items:
        raise TLDynamicsError("merge_stats needs at least one statistics file or object")
    loaded = [s if isinstance(s, DatasetStats) else load_stats(s) for s in items]
    seen: dict[tuple[int, int], int] = {}
    for i, s in enumerate(loaded):
        key = (s.prompts_hash, s.n_prompts)
        if s.n_prompts and key in seen:
            raise TLDynamicsError(
                f"merge_stats: items {seen[key]} and {i} hold the same prompts (hash "
                f"{s.prompts_hash:064x}, {s.n_prompts} prompts): merging a file with itself "
                "would count every prompt twice"
            )
        seen[key] = i
    out = loaded[0]
    for other in loaded[1:]:
        out = out.merge(other)
    return out
