"""Helpers shared by the test modules (``from helpers import ...``); set-up lives in conftest."""

import importlib.util
import os
import json
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
