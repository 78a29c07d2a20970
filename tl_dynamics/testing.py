"""Tiny, randomly initialised models for tests, examples and benchmarks, built offline.

Every architecture of the exactness matrix can be built from its Hugging Face config class
and booted through ``TransformerBridge.boot_transformers`` from a local folder, and a set of
``HookedTransformerConfig`` variants covers the legacy host. Nothing here touches a model hub.

Example:
    >>> from tl_dynamics import testing
    >>> model = testing.tiny_model("llama")
    >>> model.cfg.n_layers
    2
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from tl_dynamics.compat import bridge_class, has_hooked_transformer, tl_version
from tl_dynamics._tiny_archs import (
    D_HEAD,
    D_MODEL,
    HF_ARCHS,
    HF_FLAG_VARIANTS,
    HOOKED_VARIANTS,
    INIT_STD,
    N_CTX,
    N_HEADS,
    N_LAYERS,
    NATIVE_VARIANTS,
    QUERY_PRE_ATTN_SCALAR,
    SOFTCAP,
    WINDOW,
)
from tl_dynamics._truth import PROMPTS, hf_truth_errors, hf_twin, reconstruction_errors
from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "D_HEAD",
    "D_MODEL",
    "HF_ARCHS",
    "HF_FLAG_VARIANTS",
    "HOOKED_VARIANTS",
    "INIT_STD",
    "NATIVE_VARIANTS",
    "N_CTX",
    "N_HEADS",
    "N_LAYERS",
    "PROMPTS",
    "QUERY_PRE_ATTN_SCALAR",
    "SOFTCAP",
    "TOKENIZER_FILE",
    "WINDOW",
    "cached_model",
    "hf_folder",
    "hf_truth_errors",
    "hf_twin",
    "reconstruction_errors",
    "tiny_bridge",
    "tiny_hooked",
    "tiny_model",
    "tiny_native",
    "tokenizer",
]

# The test tokenizer, trained once (byte-level BPE, 512 ids) and shipped, so that editing a source
# file or upgrading torch never changes a tiny model's vocabulary.
TOKENIZER_FILE = Path(__file__).parent / "data" / "test_tokenizer.json"


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The tiny models' byte-level BPE tokenizer (512 ids, shipped); pad = BOS = EOS = id 0.

    One object per process, shared by its callers (do not mutate it). Each tiny model gets its
    own copy, so what a model's host sets on its tokenizer (``padding_side`` among others) stays
    with that model.

    Example:
        >>> len(tokenizer()), tokenizer().pad_token_id
        (512, 0)
    """
    return _new_tokenizer()


@functools.lru_cache(maxsize=1)
def _tokenizer_folder() -> Path:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    # Round-trip through a folder: HookedTransformer re-loads tokenizers by name_or_path.
    folder = Path(tempfile.mkdtemp(prefix="tl_dynamics_tok_"))
    fast.save_pretrained(folder)
    return folder


def _new_tokenizer():
    """A fresh copy of the test tokenizer, as saved (it pads on the right)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(_tokenizer_folder()))


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def hf_folder(arch: str, root: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Save a tiny random Hugging Face model of ``arch`` (and the test tokenizer) to a folder.

    Args:
        arch: A key of ``HF_ARCHS`` or ``HF_FLAG_VARIANTS``.
        root: The parent folder (default: a new temporary folder).
        seed: Seeds the random weights.

    Returns:
        The model's folder, ``root / arch``.

    Example:
        >>> folder = hf_folder("gpt2")
        >>> sorted(p.name for p in folder.iterdir() if p.suffix == ".json")[:2]
        ['config.json', 'generation_config.json']
    """
    archs = {**HF_ARCHS, **HF_FLAG_VARIANTS}
    if arch not in archs:
        raise TLDynamicsError(f"unknown tiny architecture {arch!r}; valid: {sorted(archs)}")
    import transformers

    _quiet_transformers()
    config_name, model_name, kwargs = archs[arch]
    tok = _new_tokenizer()  # as saved, whatever a model's host set on the shared one
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), bos_token_id=0, eos_token_id=0, **kwargs
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    folder = Path(root or tempfile.mkdtemp(prefix="tl_dynamics_")) / arch
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_bridge(arch: str, compat: bool = False, root: str | os.PathLike | None = None) -> Any:
    """Boot a tiny random ``arch`` model with ``TransformerBridge.boot_transformers``.

    Args:
        arch: A key of ``HF_ARCHS`` or ``HF_FLAG_VARIANTS``.
        compat: Enable the bridge's compatibility mode (folded, centred weights).
        root: The parent folder of the saved Hugging Face model (default: a temporary one).

    Returns:
        A ``TransformerBridge`` in eval mode.

    Example:
        >>> model = tiny_bridge("gpt2")
        >>> type(model).__name__, model.cfg.n_layers, model.cfg.d_model
        ('TransformerBridge', 2, 64)
    """
    bridge_cls = bridge_class()
    _quiet_transformers()
    model = bridge_cls.boot_transformers(str(hf_folder(arch, root)), device="cpu")
    if compat:
        model.enable_compatibility_mode(disable_warnings=True)
    return model.eval()


def tiny_hooked(variant: str = "gpt2-like", **overrides: Any) -> Any:
    """Build a tiny random ``HookedTransformer`` (TransformerLens 3.x only; 4.x is refused).

    Args:
        variant: A key of ``HOOKED_VARIANTS``.
        **overrides: ``HookedTransformerConfig`` fields that replace the variant's.

    Returns:
        A ``HookedTransformer`` in eval mode.

    Example:
        >>> from tl_dynamics.compat import has_hooked_transformer
        >>> if has_hooked_transformer():  # TransformerLens 3.x
        ...     assert tiny_hooked("gpt2-like", n_layers=1).cfg.n_layers == 1
    """
    if variant not in HOOKED_VARIANTS:
        raise TLDynamicsError(
            f"unknown HookedTransformer variant {variant!r}; valid: {sorted(HOOKED_VARIANTS)}"
        )
    if not has_hooked_transformer():
        raise TLDynamicsError(
            "HookedTransformer is not available in transformer_lens "
            f"{tl_version()} (it was removed in 4.0)"
        )
    tl = importlib.import_module("transformer_lens")
    cfg = tl.HookedTransformerConfig(
        **{**HOOKED_VARIANTS[variant], **overrides}, d_vocab=len(tokenizer())
    )
    model = tl.HookedTransformer(cfg, tokenizer=_new_tokenizer())  # its own: it sets its state
    return model.eval()


def tiny_native(variant: str = "native", seed: int = 0) -> Any:
    """A tiny random ``TransformerBridge.boot_native`` model (TransformerLens 4.x; 3.x is refused).

    Args:
        variant: A key of ``NATIVE_VARIANTS``.
        seed: Seeds the random weights.

    Returns:
        A ``TransformerBridge`` in eval mode.

    Example:
        >>> try:
        ...     model = tiny_native()
        ... except TLDynamicsError:  # TransformerLens 3.x has no boot_native
        ...     model = None
        >>> model is None or model.cfg.n_layers == N_LAYERS
        True
    """
    if variant not in NATIVE_VARIANTS:
        raise TLDynamicsError(
            f"unknown native variant {variant!r}; valid: {sorted(NATIVE_VARIANTS)}"
        )
    try:
        from transformer_lens.config import TransformerBridgeConfig
    except ImportError as exc:
        raise TLDynamicsError("boot_native needs TransformerLens 4.x") from exc
    bridge_cls = bridge_class()
    if not hasattr(bridge_cls, "boot_native"):
        raise TLDynamicsError("this TransformerLens has no TransformerBridge.boot_native (4.x has)")
    cfg = TransformerBridgeConfig(
        architecture="TransformerLensNative", d_vocab=len(tokenizer()), **NATIVE_VARIANTS[variant]
    )
    torch.manual_seed(seed)
    model = bridge_cls.boot_native(cfg, tokenizer=_new_tokenizer(), model_name=variant)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, INIT_STD)
    return model.eval()


def tiny_model(arch: str = "gpt2", compat: bool = False) -> Any:
    """A tiny random model: a bridge arch (``HF_ARCHS``), a native variant, or a hooked variant.

    Args:
        arch: A key of ``HF_ARCHS``, ``HF_FLAG_VARIANTS``, ``NATIVE_VARIANTS`` or
            ``HOOKED_VARIANTS``.
        compat: For a bridge: enable its compatibility mode.

    Returns:
        The model, in eval mode.

    Example:
        >>> model = tiny_model("llama")
        >>> model.cfg.n_layers, model.cfg.n_heads
        (2, 4)
    """
    if arch in HF_ARCHS or arch in HF_FLAG_VARIANTS:
        return tiny_bridge(arch, compat=compat)
    if arch in NATIVE_VARIANTS:
        return tiny_native(arch)
    return tiny_hooked(arch)


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, compat: bool = False) -> Any:
    """``tiny_model`` built once per process (tests and examples share it; do not mutate it).

    Args:
        arch: As in ``tiny_model``.
        compat: As in ``tiny_model``.

    Returns:
        The same model object for the same arguments.

    Example:
        >>> cached_model("gpt2") is cached_model("gpt2")
        True
    """
    return tiny_model(arch, compat=compat)
