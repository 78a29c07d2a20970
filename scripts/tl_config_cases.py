"""Build the TransformerLens checkpoint cases that tests/test_tl_checkpoint.py loads on both hosts.

Each case is a small ``HookedTransformer`` built by TransformerLens 3.x from a config that sets
one or more fields changing the forward pass (attention direction, rotary settings,
``d_vocab_out``, attention scale, soft-caps, windows, parallel blocks, ...), with every
parameter drawn at random (so biases and norm weights matter), and its logits on fixed tokens.
TransformerLens's own model is the truth: on 4.x, where ``HookedTransformer`` is gone, the
loader's model must give the same logits or refuse the field by name.

    .venv-tl3/bin/python scripts/tl_config_cases.py [OUT_PREFIX]

writes ``OUT_PREFIX.json`` (``{case: config}``, the configs as ``HookedTransformerConfig``
writes them, ``dtype`` as a string) and ``OUT_PREFIX.safetensors`` (``case/param`` the state
dict, ``case/logits``, and ``tokens``); the default prefix is ``tests/data/tl_config_cases``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

BASE = dict(
    d_model=8,
    d_head=4,
    n_heads=2,
    n_layers=2,
    n_ctx=16,
    d_vocab=20,
    d_mlp=16,
    act_fn="gelu_new",
    normalization_type="LN",
    model_name="case",
)
LOCAL = dict(use_local_attn=True, window_size=3, attn_types=["local", "global"])
CASES: dict[str, dict] = {
    "base": {},
    "bidirectional": dict(attention_dir="bidirectional"),
    "rotary": dict(positional_embedding_type="rotary", rotary_dim=4),
    "rotary_partial_base": dict(
        n_heads=1, d_head=8, positional_embedding_type="rotary", rotary_dim=4, rotary_base=500000
    ),
    "rotary_adjacent": dict(
        positional_embedding_type="rotary", rotary_dim=4, rotary_adjacent_pairs=True
    ),
    "d_vocab_out": dict(d_vocab_out=12),
    "attn_scale": dict(attn_scale=2.5),
    "unscaled": dict(use_attn_scale=False),
    "attn_soft_cap": dict(attn_scores_soft_cap=2.0),
    "logit_soft_cap": dict(output_logits_soft_cap=1.5),
    "window": LOCAL,
    "parallel": dict(parallel_attn_mlp=True),
    "gqa": dict(n_key_value_heads=1),
    "llama_like": dict(
        normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary"
    ),
    "attn_only_no_norm": dict(attn_only=True, normalization_type=None, d_mlp=None, act_fn=None),
    "layer_idx_scale": dict(scale_attn_by_inverse_layer_idx=True),
    "post_embedding_ln": dict(post_embedding_ln=True),
    "shortformer": dict(positional_embedding_type="shortformer"),
    "final_rms": dict(final_rms=True),
    "ln_pre": dict(normalization_type="LNPre"),
    "relu": dict(act_fn="relu"),
    "solu_ln": dict(act_fn="solu_ln"),
    "qk_norm": dict(use_qk_norm=True),
}
TOKENS = torch.tensor(
    [[1, 5, 9, 2, 17, 5, 9, 3, 11, 0, 4, 8], [7, 7, 1, 19, 6, 2, 13, 5, 9, 2, 0, 15]]
)


def build(name: str, fields: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(**{**BASE, **fields})
    model = HookedTransformer(cfg, move_to_device=False).eval()
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        for key, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if key.endswith(".w") or key.endswith(".weight"):  # norm scales near one
                p.copy_(1.0 + 0.2 * noise)
            elif "mlp.b_" in key and cfg.gated_mlp:  # gated MLPs carry zero biases
                p.zero_()
            else:
                p.copy_(0.4 * noise)
        logits = model(TOKENS)
    config = cfg.to_dict()
    config["dtype"] = str(config["dtype"]).removeprefix("torch.")
    config.pop("device", None)  # placed by load_model(device=)
    state = {f"{name}/{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state[f"{name}/logits"] = logits.detach().contiguous()
    return config, state


def main(prefix: str = "tests/data/tl_config_cases") -> None:
    from safetensors.torch import save_file

    warnings.simplefilter("ignore", DeprecationWarning)
    configs, tensors = {}, {"tokens": TOKENS.clone()}
    for name, fields in CASES.items():
        configs[name], state = build(name, fields)
        tensors.update(state)
    out = Path(prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    save_file(tensors, str(out.with_suffix(".safetensors")))
    print(f"{len(configs)} cases -> {out}.json, {out}.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:])
