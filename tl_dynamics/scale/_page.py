"""The dataset page (stub, filled in below)."""
from __future__ import annotations


def stats_page(stats, path=None):
    raise NotImplementedError
