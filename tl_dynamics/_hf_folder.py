"""A Hugging Face model folder booted through ``TransformerBridge.boot_transformers``, with or
without tokenizer files.

Without them (a folder written by ``save_pretrained`` of the model alone), TransformerLens would
look for a tokenizer anyway and, depending on the family, fail (Llama: "You need to have
sentencepiece or tiktoken installed") or load a stand-in (an empty GPT-2 tokenizer that turns
any text into ``[0, 0]``). So such a folder is booted with a placeholder that is dropped at once:
the model has no tokenizer, prompts are token ids (``--prompt-ids``, a token tensor), text is
refused by name (``ModelAdapter.tokenize``, the CLI), and the loader says so once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tl_dynamics import compat

# a folder holds a tokenizer when it has one of these (fast, sentencepiece, BPE, WordPiece,
# tiktoken files); tokenizer_config.json alone names a class but holds no vocabulary
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
)


class NoTokenizerWarning(UserWarning):
    """A model folder was loaded without a tokenizer: its prompts are token ids."""


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files (``TOKENIZER_FILES``, or any ``*.tiktoken``).

    Args:
        folder: A model folder.

    Returns:
        True when a tokenizer can be loaded from it.

    Example:
        >>> import tempfile
        >>> has_tokenizer_files(Path(tempfile.mkdtemp()))
        False
    """
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(
        folder.glob("*.tiktoken")
    )


def boot_folder(folder: Path, device: str, dtype: Any) -> Any:
    """Boot a Hugging Face model folder; without tokenizer files, without a tokenizer (said once,
    as a ``NoTokenizerWarning``)."""
    bridge = compat.bridge_class()
    if has_tokenizer_files(folder):
        return bridge.boot_transformers(str(folder), device=device, dtype=dtype).eval()
    model = bridge.boot_transformers(
        str(folder), device=device, dtype=dtype, tokenizer=_placeholder()
    ).eval()
    model.tokenizer = None
    warnings.warn(
        f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): the model is "
        'loaded without a tokenizer, so prompts are token ids (--prompt-ids "300 5 17", or a '
        "token tensor in Python) and text is refused",
        NoTokenizerWarning,
        stacklevel=4,
    )
    return model


def _placeholder() -> Any:
    """A one-word tokenizer that only lets the bridge boot (dropped straight after)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
    )
