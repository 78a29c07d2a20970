"""Shared test set-up: offline, quiet, one intra-op thread. Helpers shared by test modules (tiny
models per architecture, host markers) live in ``tests/helpers.py``."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models: one intra-op thread is fastest and deterministic (two threads made small
# matmuls ~1000x slower on a loaded 2-core machine).
torch.set_num_threads(1)
