"""QK/OV circuits on a GPT-2-small-shaped random model: composition, spectra, read-outs.

    .venv/bin/python benchmarks/circuits_bench.py                    # 2 heads of read-outs
    .venv/bin/python benchmarks/circuits_bench.py --readout-heads 144  # all heads (long on CPU)

The model: Hugging Face GPT2Config with 12 layers, 12 heads, d_model 768 (d_head 64), GPT-2's
vocabulary of 50,257 tokens and random weights, saved to a temporary folder and booted through
``TransformerBridge.boot_transformers`` (raw mode). The adapter's weight cache is warmed first,
so the timings are of the circuit computations, not of reading the weights out of the model.

Phases: all-pairs Q/K/V composition scores with the 200-sample random baseline; OV copying and
QK positivity scores of all 144 heads; top-10 full-vocabulary OV and QK read-outs (every one of
the 50,257 rows of each circuit, streamed in row chunks) for ``--readout-heads`` heads, with the
time for all 144 heads extrapolated from them (heads are processed one after another, so the
peak memory does not depend on how many are run).

Time: wall clock (best of 3 for the scores) and the process's CPU time; on a machine shared with
other work, CPU time / threads estimates the wall time on an idle one.

Memory: peak extra resident set size of each phase: the kernel's high-water mark ``VmHWM`` is
reset before the phase (``/proc/self/clear_refs``) and compared with ``VmRSS`` at its start.
(tracemalloc would not see torch's allocations, which bypass Python's allocator.)
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_LAYERS, N_HEADS, D_MODEL, VOCAB = 12, 12, 768, 50257
TOP_K = 10


def build():
    import transformers

    from tl_dynamics import testing
    from tl_dynamics.adapter import ModelAdapter

    folder = Path(tempfile.mkdtemp(prefix="tld_circuits_bench_")) / "gpt2-small-shaped"
    tok = testing.tokenizer()  # 512 tokens; the circuits read only the weights
    cfg = transformers.GPT2Config(
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_embd=D_MODEL,
        n_positions=1024,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    model = testing.bridge_class().boot_transformers(str(folder), device="cpu").eval()
    adapter = ModelAdapter(model)
    for layer in range(adapter.n_layers):  # warm the weight cache
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"):
            getattr(adapter, name)(layer)
    adapter.W_E, adapter.W_U  # noqa: B018
    return adapter


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn):
    """``(result, wall seconds, process CPU seconds, peak extra bytes)`` of ``fn()``."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    start_rss = _status("VmRSS")
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return result, seconds, cpu, _status("VmHWM") - start_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--readout-heads",
        type=int,
        default=2,
        help="heads whose full-vocabulary OV and QK read-outs are run (1..144)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tl_dynamics import circuits

    adapter = build()
    rows = []

    def record(name, fn, repeat=1):
        best = None
        for _ in range(repeat):
            result, seconds, cpu, extra = measure(fn)
            best = (seconds, cpu, extra) if best is None or seconds < best[0] else best
        rows.append((name, *best))
        return result

    comp = record(
        "composition scores, Q/K/V, all 9,504 head pairs + 200-sample baseline",
        lambda: circuits.composition_scores(adapter),
        repeat=3,
    )
    record(
        "composition scores, K only",
        lambda: circuits.composition_scores(adapter, kinds=("K",)),
        repeat=3,
    )
    record("OV copying scores, 144 heads", lambda: circuits.copying_scores(adapter), repeat=3)
    record(
        "QK positivity scores, 144 heads", lambda: circuits.qk_positivity_scores(adapter), repeat=3
    )

    heads = [(l, h) for l in range(N_LAYERS) for h in range(N_HEADS)][: args.readout_heads]

    def readouts(build_circuit):
        def run():
            for layer, head in heads:
                circuit = build_circuit(adapter, layer, head)
                circuit.topk(TOP_K, bottom=False)

        return run

    record(
        f"top-{TOP_K} OV read-out, all {VOCAB:,} rows, {len(heads)} head(s)",
        readouts(circuits.ov_circuit),
    )
    record(
        f"top-{TOP_K} QK read-out, all {VOCAB:,} rows, {len(heads)} head(s)",
        readouts(circuits.qk_circuit),
    )

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}, date {time.strftime('%Y-%m-%d')}"
    )
    threads = torch.get_num_threads()
    print(
        "| phase | wall time (s) | CPU time (s) | CPU time / threads (s) | peak extra RSS (MiB) |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name, seconds, cpu, extra in rows:
        print(f"| {name} | {seconds:.2f} | {cpu:.2f} | {cpu / threads:.2f} | {extra / 2**20:.0f} |")
    per_head = sum(s for n, s, _, _ in rows if "read-out" in n) / max(1, len(heads))
    print(
        f"\nOV + QK read-outs: {per_head:.1f} s per head; all 144 heads: ~{per_head * 144 / 60:.0f} min "
        f"(extrapolated from {len(heads)} head(s))"
    )
    print(comp.summary())


if __name__ == "__main__":
    main()
