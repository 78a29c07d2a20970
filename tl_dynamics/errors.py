"""The package's one error type."""

from __future__ import annotations


class TLDynamicsError(ValueError):
    """Raised for input tl_dynamics cannot use: the message names what was asked and what is valid.

    Subclasses ``ValueError`` so that generic ``except ValueError`` handlers still catch it.
    """
