"""Per-layer decompositions of one forward pass, formed only when asked (issue 15).

A ``Decomposition`` holds ``[batch, head, q, k]`` tensors for every part and pattern: at 1,024
tokens that is about 200 MB per GPT-2-small layer. ``compute(keep_tensors=True)`` therefore
keeps only what determines them, the captured layer's ``q``, ``k``, scale, bias and masks
(``LayerAttention``), and forms a layer's split when it is looked up (the same function on the
same tensors, so the same numbers). The last layer formed is kept, so repeated look-ups of one
layer cost nothing.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from tl_dynamics.odds_ratio._result import Decomposition

# Forms a layer's decomposition: for every head kept (no argument) or for the heads given.
Maker = Callable[..., Decomposition]


class LazyDecompositions(Mapping[int, Decomposition]):
    """``{layer: Decomposition}`` of one forward pass; each value is built on first look-up.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> res = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1")
        >>> sorted(res.decompositions[0]), res[1].parts.loglik.shape
        ([0, 1], torch.Size([1, 4, 4, 4]))
    """

    def __init__(self, makers: dict[int, Maker] | None = None):
        self._makers: dict[int, Maker] = dict(makers or {})
        self._last: tuple[int, Decomposition] | None = None

    def add(self, layer: int, make: Maker) -> None:
        """Register how to form ``layer``'s decomposition (called while collecting)."""
        self._makers[layer] = make
        if self._last is not None and self._last[0] == layer:
            self._last = None

    def copy(self) -> "LazyDecompositions":
        """A snapshot of the layers registered so far (nothing is formed)."""
        return LazyDecompositions(self._makers)

    def heads_of(self, layer: int, heads: list[int]) -> Decomposition:
        """``layer``'s decomposition for ``heads`` only (formed each call, not kept): what a
        view of one head needs, at a fraction of the whole layer's cost."""
        return self._makers[layer](heads)

    def __getitem__(self, layer: int) -> Decomposition:
        if self._last is not None and self._last[0] == layer:
            return self._last[1]
        dec = self._makers[layer]()
        self._last = (layer, dec)
        return dec

    def __iter__(self) -> Iterator[int]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __contains__(self, layer: object) -> bool:
        return layer in self._makers

    def __repr__(self) -> str:
        return f"LazyDecompositions(layers={list(self._makers)})"
