"""Real model shapes for the benchmarks (issue 22), with random weights from a transformers config.

- ``gpt2-small``: 12 layers, 12 heads, d_model 768, vocab 50,257, float32 (``GPT2Config``);
- ``llama-1b``: the Llama-3.2-1B shape: 16 layers, 32 query heads, 8 key/value heads, d_model
  2,048, MLP 8,192, vocab 128,256, rotary (theta 500,000; without Llama 3.2's rope scaling),
  tied embeddings, bfloat16;
- ``llama-8b``: the Llama-3-8B shape: 32 layers, 32 query heads, 8 key/value heads, d_model
  4,096, MLP 14,336, vocab 128,256, rotary (theta 500,000), bfloat16;
- ``llama-long``: issue 48's long-context shape: 4 layers, 8 query heads, 2 key/value heads,
  d_model 256 (d_head 32), MLP 1,024, vocab 1,024, rotary, float32, at 512-4,096 tokens.

``folder(name, root)`` writes the model (config, ``model.safetensors``, the tiny test tokenizer)
once and returns its folder, so ``tl-dynamics report --model FOLDER`` loads it like any Hugging Face
folder (``--dtype auto`` reads bfloat16 from its config); ``build(name, root, device)`` boots it
with ``TransformerBridge.boot_transformers``, its weights drawn on ``device`` in its dtype and
never written (seconds on a GPU for the 8B shape, whose bfloat16 weights would be 16 GB on disk). ``tiny=True`` keeps a shape's head
structure (query and key/value heads, rotary, dtype) at 2 layers, d_model 256 and a 1,024-token
vocabulary: the CPU smoke test of every benchmark.

    python benchmarks/shapes.py llama-1b --tiny      # write the folder, print it and the shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from tl_dynamics import testing  # noqa: E402

LLAMA_COMMON = dict(
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=0,
)
# name -> (config class, model class, config fields, dtype)
SHAPES: dict[str, tuple[str, str, dict[str, Any], torch.dtype]] = {
    "gpt2-small": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_layer=12,
            n_head=12,
            n_embd=768,
            vocab_size=50257,
            n_positions=1024,
            bos_token_id=0,
            eos_token_id=0,
        ),
        torch.float32,
    ),
    "llama-1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            LLAMA_COMMON,
            num_hidden_layers=16,
            hidden_size=2048,
            intermediate_size=8192,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        torch.bfloat16,
    ),
    "llama-8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            LLAMA_COMMON,
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            head_dim=128,
            tie_word_embeddings=False,
        ),
        torch.bfloat16,
    ),
    # issue 48's long-context shape: small d_model, grouped-query attention 8/2, rotary, so
    # attention (quadratic in tokens) is most of the forward at 512-4,096 tokens
    "llama-long": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            LLAMA_COMMON,
            num_hidden_layers=4,
            hidden_size=256,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        torch.float32,
    ),
}
NAMES = tuple(SHAPES)
# The token shapes (batch, positions) each shape is benchmarked at (issue 22's targets).
ATTACH_TOKENS = {
    "gpt2-small": ((4, 256), (1, 1024)),
    "llama-1b": ((1, 2048), (8, 512)),
    "llama-8b": ((1, 4096),),
    "llama-long": ((1, 512), (1, 1024), (1, 2048), (1, 4096)),
}
TINY = {
    "gpt2-small": dict(n_layer=2, n_embd=96, vocab_size=1024),
    "llama-1b": dict(
        num_hidden_layers=2, hidden_size=256, intermediate_size=512, head_dim=8, vocab_size=1024
    ),
    "llama-8b": dict(
        num_hidden_layers=2, hidden_size=256, intermediate_size=512, head_dim=8, vocab_size=1024
    ),
    "llama-long": dict(num_hidden_layers=2),
}


def attach_tokens(name: str, tiny: bool = False) -> tuple[tuple[int, int], ...]:
    """The ``(batch, positions)`` inputs of ``cost_bench.py --shape`` (``tiny``: at most 128
    positions, for the CPU)."""
    return tuple((b, min(n, 128)) for b, n in ATTACH_TOKENS[name]) if tiny else ATTACH_TOKENS[name]


def fields(name: str, tiny: bool = False) -> dict[str, Any]:
    """The config fields of shape ``name`` (``tiny``: scaled down, same heads and dtype)."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; valid: {', '.join(NAMES)}")
    return dict(SHAPES[name][2], **(TINY[name] if tiny else {}))


def vocab(name: str, tiny: bool = False) -> int:
    return int(fields(name, tiny)["vocab_size"])


def dtype(name: str) -> torch.dtype:
    return SHAPES[name][3]


def folder(
    name: str, root: str | os.PathLike, tiny: bool = False, device: str = "cpu", seed: int = 0
) -> Path:
    """The shape's model folder under ``root`` (written on first use, then reused)."""
    import transformers

    out = Path(root) / f"{name}{'-tiny' if tiny else ''}-random"
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    config_cls, model_cls, _, want = SHAPES[name]
    config = getattr(transformers, config_cls)(**fields(name, tiny))
    config.torch_dtype = want  # recorded in config.json: `--dtype auto` loads in it
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(want).eval()
    model.save_pretrained(out)
    testing.tokenizer().save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    if str(saved.get("torch_dtype", saved.get("dtype", ""))).removeprefix("torch.") != str(
        want
    ).removeprefix("torch."):
        raise SystemExit(f"{out}/config.json does not record {want}: {saved}")
    del model
    return out


def draw(name: str, tiny: bool = False, device: str = "cpu", seed: int = 0) -> Any:
    """The shape's Hugging Face model with random weights drawn straight on ``device`` in the
    shape's dtype (no float32 copy first, nothing written to disk: the 8B shape's 16 GB of
    bfloat16 weights are drawn on the GPU in seconds)."""
    import transformers

    config_cls, model_cls, _, want = SHAPES[name]
    config = getattr(transformers, config_cls)(**fields(name, tiny))
    config.torch_dtype = want
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(want)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(want).eval()


def config_folder(name: str, root: str | os.PathLike, tiny: bool = False) -> Path:
    """A folder with the shape's ``config.json`` and the test tokenizer, and no weights."""
    import transformers

    out = Path(root) / f"{name}{'-tiny' if tiny else ''}-config"
    if not (out / "config.json").exists():
        config_cls, _, _, want = SHAPES[name]
        config = getattr(transformers, config_cls)(**fields(name, tiny))
        config.torch_dtype = want
        config.save_pretrained(out)
        testing.tokenizer().save_pretrained(out)
    return out


def build(
    name: str,
    root: str | os.PathLike,
    device: str = "cpu",
    tiny: bool = False,
    in_memory: bool = True,
) -> Any:
    """The shape booted with ``TransformerBridge.boot_transformers`` on ``device`` in its dtype:
    ``in_memory`` (the default), its weights drawn on ``device`` (``draw``) and handed over as
    ``hf_model`` beside a folder holding only the config and tokenizer; otherwise loaded from
    ``folder``."""
    if in_memory:
        return (
            testing.bridge_class()
            .boot_transformers(
                str(config_folder(name, root, tiny)),
                hf_model=draw(name, tiny, device),
                device=device,
                dtype=dtype(name),
            )
            .eval()
        )
    path = folder(name, root, tiny, device if device.startswith("cuda") else "cpu")
    return (
        testing.bridge_class().boot_transformers(str(path), device=device, dtype=dtype(name)).eval()
    )


def describe(model: Any) -> str:
    from tl_dynamics.adapter import ModelAdapter

    ad = ModelAdapter.of(model)
    n_params = sum(p.numel() for p in model.parameters())
    return (
        f"{ad.n_layers} layers, {ad.n_heads} query heads, {ad.n_kv_heads} key/value heads, "
        f"d_model {ad.d_model}, {ad.dtype}, {n_params / 1e9:.3f} B parameters, rotary: "
        f"{ad.rotation(0) is not None}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=NAMES)
    parser.add_argument("--tiny", action="store_true", help="2 layers, d_model 256 (CPU smoke)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    model = build(args.shape, args.root, args.device, args.tiny)
    print(folder(args.shape, args.root, args.tiny))
    print(describe(model))


if __name__ == "__main__":
    main()
