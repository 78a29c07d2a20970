"""The package's one error type."""

from __future__ import annotations


class TLDynamicsError(ValueError):
    """Raised for input tl_dynamics cannot use: the message names what was asked and what is valid.

    Subclasses ``ValueError`` so that generic ``except ValueError`` handlers still catch it.
    """


class HostDiffersWarning(UserWarning):
    """The host (TransformerLens) computes attention differently from the Hugging Face model it
    wraps for a flag this model sets; the adapter follows the host, whose hooks it reads, and
    says so once when it is made (the message names the flag and the difference)."""


class UnknownTokenWarning(UserWarning):
    """A text prompt has characters (or words) the model's tokenizer maps to its unknown token
    (``<unk>``): the model sees one placeholder where the text had them. The message names them
    and the prompt; pass text the tokenizer keeps (``adapter.str_tokens`` shows what it kept)."""
