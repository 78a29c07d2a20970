"""``export_gpt2``: a shipped GPT-2-architecture model as a Hugging Face ``GPT2LMHeadModel`` folder.

The folder loads with ``TransformerBridge.boot_transformers(folder)`` (or
``GPT2LMHeadModel.from_pretrained``), so the same trained weights can be studied through the
bridge's Hugging Face path as well as through ``boot_native`` / ``HookedTransformer``.

GPT-2 has no unembedding bias, so only a model trained with ``b_U`` frozen at zero exports
exactly (``code-2l`` is; the export refuses a nonzero ``b_U`` rather than dropping it). The
unembedding is written untied from the embedding (``tie_word_embeddings=False``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.zoo import _files
from tl_dynamics.zoo._load import model_folder

if TYPE_CHECKING:  # imported where used: `import tl_dynamics.zoo` needs no torch
    import torch

# The TransformerLens config a GPT-2 block reproduces (other fields are refused).
_GPT2_FIELDS = dict(
    attn_only=False,
    normalization_type="LN",
    positional_embedding_type="standard",
    act_fn="gelu_new",
)


def gpt2_state_dict(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``HookedTransformer`` parameter names and shapes -> ``GPT2LMHeadModel`` ones.

    Example:
        >>> from tl_dynamics.zoo._torch_model import TorchTransformer
        >>> cfg = dict(d_model=8, d_head=4, n_layers=1, n_ctx=6, n_heads=2, d_mlp=16, d_vocab=10,
        ...            act_fn="gelu_new", attn_only=False, normalization_type="LN",
        ...            positional_embedding_type="standard", eps=1e-5)
        >>> hf = gpt2_state_dict(TorchTransformer(cfg).state_dict(), cfg)
        >>> tuple(hf["transformer.h.0.attn.c_attn.weight"].shape), tuple(hf["lm_head.weight"].shape)
        ((8, 24), (10, 8))
    """
    import torch

    d_model = cfg["d_model"]
    out = {
        "transformer.wte.weight": state["embed.W_E"],
        "transformer.wpe.weight": state["pos_embed.W_pos"],
        "transformer.ln_f.weight": state["ln_final.w"],
        "transformer.ln_f.bias": state["ln_final.b"],
        "lm_head.weight": state["unembed.W_U"].T,
    }
    for layer in range(cfg["n_layers"]):
        p, h = f"blocks.{layer}.", f"transformer.h.{layer}."
        qkv = [state[p + f"attn.W_{m}"].permute(1, 0, 2).reshape(d_model, -1) for m in "QKV"]
        out.update({
            h + "ln_1.weight": state[p + "ln1.w"], h + "ln_1.bias": state[p + "ln1.b"],
            h + "attn.c_attn.weight": torch.cat(qkv, dim=1),
            h + "attn.c_attn.bias": torch.cat([state[p + f"attn.b_{m}"].reshape(-1) for m in "QKV"]),
            h + "attn.c_proj.weight": state[p + "attn.W_O"].reshape(-1, d_model),
            h + "attn.c_proj.bias": state[p + "attn.b_O"],
            h + "ln_2.weight": state[p + "ln2.w"], h + "ln_2.bias": state[p + "ln2.b"],
            h + "mlp.c_fc.weight": state[p + "mlp.W_in"], h + "mlp.c_fc.bias": state[p + "mlp.b_in"],
            h + "mlp.c_proj.weight": state[p + "mlp.W_out"], h + "mlp.c_proj.bias": state[p + "mlp.b_out"],
        })  # fmt: skip
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def export_gpt2(name: str, folder: str | Path) -> Path:
    """Write shipped model ``name`` as a Hugging Face GPT-2 folder (config, weights, tokenizer).

    The folder boots with ``TransformerBridge.boot_transformers`` or loads with
    ``transformers.GPT2LMHeadModel.from_pretrained``. Raises ``TLDynamicsError`` when the model is
    not GPT-2-shaped (attention-only, other norm, positions or activation, ``d_head * n_heads !=
    d_model``) or has a nonzero ``b_U``.

    Args:
        name: A shipped model's name (``"code-2l"`` is GPT-2-shaped).
        folder: The folder to write (made if missing).

    Returns:
        The folder written.

    Example:
        >>> import tempfile, torch, transformers
        >>> from tl_dynamics import zoo
        >>> path = zoo.export_gpt2("code-2l", tempfile.mkdtemp())
        >>> hf = transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()
        >>> model = zoo.load("code-2l")
        >>> tokens = model.to_tokens("def f(x):")
        >>> torch.allclose(hf(tokens).logits, model(tokens), atol=1e-4)
        True
    """
    from safetensors.torch import save_file
    from transformers import GPT2Config

    src = model_folder(name)
    sums = _files.expected_checksums(src, name)
    cfg = _files.read_config(src, name, sums)
    wrong = {k: cfg.get(k) for k, v in _GPT2_FIELDS.items() if cfg.get(k) != v}
    if cfg["d_head"] * cfg["n_heads"] != cfg["d_model"]:
        wrong["d_head * n_heads"] = cfg["d_head"] * cfg["n_heads"]
    if wrong:
        raise TLDynamicsError(
            f"zoo model {name!r} is not GPT-2-shaped and cannot be exported as "
            f"GPT2LMHeadModel: {wrong} (GPT-2 needs {_GPT2_FIELDS} and "
            f"d_head * n_heads == d_model = {cfg['d_model']})"
        )
    state = _files.read_tensors(src, name, _files.WEIGHTS, sums)
    b_U = state["unembed.b_U"]
    if b_U.abs().max() > 0:
        raise TLDynamicsError(
            f"zoo model {name!r} has a nonzero unembedding bias b_U (max "
            f"|b_U| = {b_U.abs().max():.3g}) and GPT-2 has none: the export would "
            "not be exact; train with b_U frozen at zero to export"
        )
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _files.read_tokenizer(src, name, sums)
    hf_cfg = GPT2Config(
        vocab_size=cfg["d_vocab"], n_positions=cfg["n_ctx"], n_embd=cfg["d_model"],
        n_layer=cfg["n_layers"], n_head=cfg["n_heads"], n_inner=cfg["d_mlp"],
        activation_function="gelu_new", layer_norm_epsilon=cfg["eps"], resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        architectures=["GPT2LMHeadModel"],
    )  # fmt: skip
    hf_cfg.save_pretrained(str(out))
    save_file(
        gpt2_state_dict(state, cfg), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    tokenizer.save_pretrained(str(out))
    (out / "tl_dynamics_export.json").write_text(json.dumps({"zoo_model": name}, indent=1) + "\n")
    return out
