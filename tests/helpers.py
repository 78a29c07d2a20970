"""Helpers shared by the test modules (``from helpers import ...``); set-up lives in conftest."""

import pytest

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter

HAS_HOOKED = testing.has_hooked_transformer()


def adapter_for(arch: str, compat: bool = False) -> ModelAdapter:
    """A ``ModelAdapter`` on the session's shared tiny model of ``arch``."""
    return ModelAdapter(testing.cached_model(arch, compat))


requires_hooked = pytest.mark.skipif(
    not HAS_HOOKED, reason="HookedTransformer was removed in TransformerLens 4.0; "
                           "these configs run in the TransformerLens 3.x environment")
