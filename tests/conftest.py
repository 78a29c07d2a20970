"""Shared test set-up: offline, quiet, one tiny model per architecture per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tl_dynamics import testing  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

HAS_HOOKED = testing.has_hooked_transformer()
requires_hooked = pytest.mark.skipif(
    not HAS_HOOKED, reason="HookedTransformer was removed in TransformerLens 4.0; "
                           "these configs run in the TransformerLens 3.x environment")
