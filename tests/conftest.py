"""Shared test set-up: offline, quiet, one tiny model per architecture per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tl_dynamics import testing  # noqa: E402

# Tiny models: one intra-op thread is fastest and deterministic (two threads made small
# matmuls ~1000x slower on a loaded 2-core machine).
torch.set_num_threads(1)

HAS_HOOKED = testing.has_hooked_transformer()


def adapter_for(arch: str, compat: bool = False):
    """A ``ModelAdapter`` on the session's shared tiny model of ``arch``."""
    from tl_dynamics.adapter import ModelAdapter

    return ModelAdapter(testing.cached_model(arch, compat))


requires_hooked = pytest.mark.skipif(
    not HAS_HOOKED, reason="HookedTransformer was removed in TransformerLens 4.0; "
                           "these configs run in the TransformerLens 3.x environment")
