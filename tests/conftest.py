"""Shared test set-up: offline, quiet, one intra-op thread. Helpers shared by test modules (tiny
models per architecture, host markers) live in ``tests/helpers.py``."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models: one intra-op thread is fastest and deterministic (on a loaded machine, threads
# waiting for each other make small matmuls far slower).
torch.set_num_threads(1)
