"""The whole head atlas of a GPT-2-small-shaped random model against its reference cost.

    .venv/bin/python benchmarks/atlas_bench.py                 # boot_native bridge (TL 4.x)
    .venv/bin/python benchmarks/atlas_bench.py --host hf       # Hugging Face GPT-2 bridge
    .venv-tl3/bin/python benchmarks/atlas_bench.py --host hooked   # HookedTransformer (TL 3.x)

The model: 12 layers, 12 heads, d_model 768 (d_head 64), d_mlp 3072, GPT-2's vocabulary of
50,257 tokens, learned positions, LayerNorm, random weights, built from a config (nothing from
the hub). The probes: the atlas's defaults (``_probes.N_SEQ`` repeated random sequences of
``_probes.SEQ_LEN`` token ids after a BOS).

Reference: one ``run_with_cache`` over the probes plus one forward per ablated head (144 forwards,
each with one head's ``z`` mean-ablated through ``ModelAdapter.patch``). The atlas: every score
of the model and of its weight-shuffled control (two captured forward passes, circuits of all
heads), and three interventions per head (mean ablation, prior-only and likelihood-only
patterns). Wall clock and the process's CPU time are both printed; on a shared machine CPU time
is the comparable number.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from tl_dynamics.atlas import _probes

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_LAYERS, N_HEADS, D_MODEL, VOCAB, N_CTX = 12, 12, 768, 50257, 1024


def build(host: str):
    from tl_dynamics import testing

    torch.manual_seed(0)
    if host == "native":
        from transformer_lens.config import TransformerBridgeConfig

        cfg = TransformerBridgeConfig(
            architecture="TransformerLensNative",
            d_model=D_MODEL,
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            d_head=D_MODEL // N_HEADS,
            n_ctx=N_CTX,
            d_mlp=4 * D_MODEL,
            act_fn="gelu_new",
            d_vocab=VOCAB,
        )
        model = testing.bridge_class().boot_native(
            cfg, tokenizer=None, model_name="gpt2-small-shaped"
        )
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim > 1:
                    param.normal_(0.0, 0.02)
        return model.eval()
    if host == "hooked":
        import transformer_lens as tl

        cfg = tl.HookedTransformerConfig(
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            d_model=D_MODEL,
            d_head=D_MODEL // N_HEADS,
            d_mlp=4 * D_MODEL,
            n_ctx=N_CTX,
            d_vocab=VOCAB,
            act_fn="gelu_new",
            normalization_type="LN",
        )
        return tl.HookedTransformer(cfg).eval()
    import transformers

    folder = Path(tempfile.mkdtemp(prefix="tld_atlas_bench_")) / "gpt2-small-shaped"
    cfg = transformers.GPT2Config(
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_embd=D_MODEL,
        n_positions=N_CTX,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    return testing.bridge_class().boot_transformers(str(folder), device="cpu").eval()


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def reference(adapter, batch) -> tuple[float, float]:
    def run():
        with torch.no_grad():
            adapter.model.run_with_cache(batch.tokens)
            for layer in range(adapter.n_layers):
                for head in range(adapter.n_heads):

                    def ablate(z, head=head):
                        z = z.clone()
                        z[:, :, head] = z[:, :, head].mean(1, keepdim=True)
                        return z

                    with adapter.patch([("z", layer, ablate)]):
                        adapter.forward(batch)

    _, wall, cpu = timed(run)
    return wall, cpu


def main() -> None:
    from tl_dynamics import atlas
    from tl_dynamics.adapter import ModelAdapter

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", choices=["native", "hf", "hooked"], default="native")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = ModelAdapter(build(args.host))
    batch = adapter.tokenize(_probes.repeated_tokens(adapter)[0])
    with torch.no_grad():
        adapter.forward(batch)  # warm-up
    ref_wall, ref_cpu = reference(adapter, batch)
    res, wall, cpu = timed(lambda: atlas.compute(adapter))
    shared = any("earlier layers run once" in note for note in res.notes)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, host {args.host} "
        f"({adapter.info.host}), load average {os.getloadavg()[0]:.1f}"
    )
    print(f"probes: {tuple(batch.tokens.shape)} tokens; layer prefix shared: {shared}")
    print(
        f"reference (run_with_cache + 144 ablated forwards): wall {ref_wall:.1f} s, CPU {ref_cpu:.1f} s"
    )
    print(
        f"atlas (all 144 heads, control, 3 interventions each): wall {wall:.1f} s, CPU {cpu:.1f} s"
    )
    print(f"ratio: wall {wall / ref_wall:.2f}x, CPU {cpu / ref_cpu:.2f}x")
    print(res)


if __name__ == "__main__":
    main()
