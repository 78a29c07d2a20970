"""Benchmark: the cost of ``ModelAdapter``'s self-check at load (issue 31) next to one forward
pass of its 8 probe tokens.

Models: a GPT-2-small shape (``GPT2Config()``: 12 layers, d_model 768, random weights) and a
Llama of the same width (rotary: the self-check's probe also reads the rotations), booted with
``TransformerBridge.boot_transformers`` from a local folder. Rows interleave the plain forward
and the self-check in this one process (medians over ``--repeats``), so load from other
processes hits both alike; the CPU time of this process (``time.process_time``, one torch thread
with ``--threads 1``) is reported next to the wall clock, as it moves far less with the load of a
shared machine. "copies" is the largest size of the float32 weight copies the probe
holds while it runs (dropped when it ends), as a share of the model's parameter bytes.

    python benchmarks/selfcheck_bench.py               # both shapes, 5 repeats
    python benchmarks/selfcheck_bench.py --repeats 3 --only gpt2
    python benchmarks/selfcheck_bench.py --repeats 9 --threads 1   # the README's table
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tl_dynamics
from tl_dynamics import testing  # noqa: E402
from tl_dynamics.adapter import ModelAdapter, _selfcheck  # noqa: E402

SHAPES = {
    "gpt2": lambda: transformers.GPT2Config(),
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
}


def boot(name: str):
    config = SHAPES[name]()
    config.architectures = [type(transformers.AutoModelForCausalLM.from_config(config)).__name__]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.set_attn_implementation("eager")
    folder = tempfile.mkdtemp(prefix="tl_dynamics_selfcheck_")
    config.save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    return testing.bridge_class().boot_transformers(folder, device="cpu", hf_model=hf).eval()


def measure(name: str, repeats: int) -> None:
    model = boot(name)
    tokens = _selfcheck.probe_tokens(int(model.cfg.d_vocab), 64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = [0]
    drop = _selfcheck._drop_weight_copies

    def measuring(adapter):
        held = [v for v in adapter._cache.values() if isinstance(v, torch.Tensor)]
        copies[0] = max(copies[0], sum(t.numel() * t.element_size() for t in held))
        drop(adapter)

    _selfcheck._drop_weight_copies = measuring
    forward, check, forward_cpu, check_cpu = [], [], [], []
    with torch.no_grad():
        model(tokens)  # warm
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model(tokens)
        forward.append(time.perf_counter() - start)
        forward_cpu.append(time.process_time() - cpu)
        _selfcheck._VERIFIED.pop(model, None)
        adapter = ModelAdapter(model, verify=False)
        start, cpu = time.perf_counter(), time.process_time()
        _selfcheck.verify(adapter)
        check.append(time.perf_counter() - start)
        check_cpu.append(time.process_time() - cpu)
    _selfcheck._drop_weight_copies = drop
    f, c = statistics.median(forward), statistics.median(check)
    fc, cc = statistics.median(forward_cpu), statistics.median(check_cpu)
    print(
        f"{name}: forward of {tokens.shape[1]} tokens {f * 1e3:.0f} ms, self-check "
        f"{c * 1e3:.0f} ms ({c / f:.2f}x); CPU time {fc * 1e3:.0f} ms and {cc * 1e3:.0f} ms "
        f"({cc / fc:.2f}x); copies {copies[0] / params:.1%} of the parameters' "
        f"{params / 2**20:.0f} MiB, dropped after"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    for name in [args.only] if args.only else sorted(SHAPES):
        measure(name, args.repeats)


if __name__ == "__main__":
    main()
