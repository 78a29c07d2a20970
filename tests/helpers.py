"""Helpers shared by the test modules (``from helpers import ...``); set-up lives in conftest."""

import importlib.util
import os
import json
import time
from pathlib import Path

import pytest

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter

HAS_HOOKED = testing.has_hooked_transformer()


def adapter_for(arch: str, compat: bool = False) -> ModelAdapter:
    """A ``ModelAdapter`` on the session's shared tiny model of ``arch``."""
    return ModelAdapter(testing.cached_model(arch, compat))


requires_hooked = pytest.mark.skipif(
    not HAS_HOOKED,
    reason="HookedTransformer was removed in TransformerLens 4.0; "
    "these configs run in the TransformerLens 3.x environment",
)


# The real-model folder `make smollm2` builds (the Makefile exports its path).
SMOLLM2 = Path(
    os.environ.get(
        "TL_DYNAMICS_SMOLLM2", Path(__file__).resolve().parents[1] / ".models" / "smollm2-135m"
    )
)


def notebook_params(paths: list[Path]) -> list:
    """One ``pytest.param`` per notebook. A notebook whose metadata names the modules it needs
    (``metadata.tl_dynamics.requires``: ``sae_lens`` for ``sae.ipynb``, which needs
    TransformerLens 3.x) is marked ``tl3`` (``make test-tl3`` runs it) and skipped, with the
    reason, where one of them is missing."""
    params = []
    for path in paths:
        meta = json.loads(path.read_text()).get("metadata", {}).get("tl_dynamics", {})
        needs = meta.get("requires", [])
        missing = [name for name in needs if importlib.util.find_spec(name) is None]
        if meta.get("requires_smollm2") and not (SMOLLM2 / "BUILD.json").is_file():
            missing.append(f"the SmolLM2-135M folder {SMOLLM2}")
        marks = [pytest.mark.tl3] if needs else []
        if missing:
            marks.append(
                pytest.mark.skip(
                    reason=f"{path.name} needs {', '.join(missing)} ({meta.get('why', '')})"
                )
            )
        params.append(pytest.param(path, id=path.stem, marks=marks))
    return params


def _ray_folder() -> str | None:
    spec = importlib.util.find_spec("ray")
    return None if spec is None or spec.origin is None else str(Path(spec.origin).parent)


def marked_processes(marker: str, ray_only: bool = False) -> dict[int, str]:
    """The live processes whose environment carries ``marker`` (every process a test or the
    suite started, and everything those started), with their command lines; ``ray_only``:
    Ray's alone (its programs, and its workers, named ``ray::...``)."""
    folder, found = _ray_folder(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() + b"=" not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        is_ray = line.startswith("ray::") or (folder is not None and folder in line)
        if state not in ("Z", "X") and (is_ray or not ray_only):  # a zombie is dead
            found[int(entry.name)] = line.strip()[:160]
    return found


def processes_left(marker: str, ray_only: bool = False, timeout: float = 120.0) -> dict[int, str]:
    """``marked_processes`` once none is left, or those still there after ``timeout`` s (a
    safety net: processes end a moment after whatever ended them returns)."""
    deadline = time.monotonic() + timeout
    while (left := marked_processes(marker, ray_only)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
