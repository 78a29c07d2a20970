"""The model behind an analysis, and readable names for the rows and columns of a circuit."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from tl_dynamics.adapter import ModelAdapter

_VOCABS: "weakref.WeakKeyDictionary[ModelAdapter, Vocabulary]" = weakref.WeakKeyDictionary()


class Vocabulary:
    """Token strings of a model, decoded on demand and remembered."""

    def __init__(self, adapter: ModelAdapter):
        self._adapter = weakref.ref(adapter)
        self._known: dict[int, str] = {}

    def __call__(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        ids = [int(i) for i in (ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)]
        missing = sorted({i for i in ids if i not in self._known})
        adapter = self._adapter()
        if missing and adapter is not None:
            self._known.update(zip(missing, adapter.decode(missing)))
        return [self._known.get(i, str(i)) for i in ids]


def vocabulary(adapter: ModelAdapter) -> Vocabulary:
    if adapter not in _VOCABS:
        _VOCABS[adapter] = Vocabulary(adapter)
    return _VOCABS[adapter]


def labels(space: str, ids: Sequence[int] | torch.Tensor, vocab: Vocabulary | None) -> list[str]:
    """Names of rows/columns in ``space`` (``"token"``, ``"output token"``, ``"position"``,
    ``"input"``)."""
    ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if "token" in space and vocab is not None:
        return vocab(ids)
    prefix = {"position": "pos ", "input": "x"}.get(space, "")
    return [f"{prefix}{i}" for i in ids]
