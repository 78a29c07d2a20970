"""Model cards: measure the saved model through TransformerLens and write ``MODEL_CARD.md``."""

from __future__ import annotations

import json
import math
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from tl_dynamics.zoo import _data, _files, _regression_card
from tl_dynamics.zoo._load import default_host, load_folder
from tl_dynamics.zoo._measure import greedy_completion, head_scores, masked_loss, scores_table

CARD = "MODEL_CARD.md"
TRAINING_LOG = "training.json"  # what train.py measured while training: history, recipe, corpus
DETECTED = 0.3  # a head "is" of a kind when its detect_head score exceeds this

CODE_PROMPTS = [
    "def __init__(self",
    "import os\nimport sys\n\n\ndef ",
    "    for i in range(",
    "class Error(Exception):\n",
]
# Prompts for the code model's head scores: code written twice over (induction targets in
# the second copy) and plain code.
CODE_HEAD_PROMPTS = [
    "total = count_items(values, limit)\nresult.append(total)\n" * 2,
    "if key not in self._cache:\n    self._cache[key] = loader(key)\n" * 2,
    "def close(self):\n    if self._file is not None:\n        self._file.close()\n",
]


def induction_prompts(n: int, period: int, seed: int) -> list[str]:
    """Random symbol strings written twice, e.g. ``"Gq7xGq7x"``."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(_data.SYMBOLS), (n, period), generator=gen)
    return ["".join(_data.SYMBOLS[i] for i in row) * 2 for row in idx.tolist()]


def late_induction_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """Detection pattern ``[pos, pos]`` for a head that attends two positions after an earlier
    occurrence of the current token (key j where ``x[j-2] == x[i]``): TL's induction pattern
    shifted one more position right."""
    from transformer_lens.head_detector import get_duplicate_token_head_detection_pattern

    dup = get_duplicate_token_head_detection_pattern(tokens)
    late = torch.zeros_like(dup)
    late[:, 2:] = dup[:, :-2]
    return torch.tril(late, diagonal=-1)


def late_induction_scores(model: Any, prompts: list[str]) -> torch.Tensor:
    """``detect_head`` scores ``[n_layers, n_heads]`` for ``late_induction_pattern``, mean over prompts."""
    from transformer_lens.head_detector import detect_head

    return torch.stack(
        [
            detect_head(model, p, late_induction_pattern(model.to_tokens(p)[0].cpu()))
            for p in prompts
        ]
    ).mean(0)


def _detected(scores: dict[str, torch.Tensor]) -> str:
    lines = []
    for kind, table in scores.items():
        heads = [f"L{l}H{h} ({table[l, h]:.2f})" for l, h in (table > DETECTED).nonzero().tolist()]
        lines.append(
            f"- {kind.replace('_', ' ')}s (score > {DETECTED}): {', '.join(heads) or 'none'}"
        )
    return "\n".join(lines)


def _history(history: list[dict[str, float]]) -> str:
    keys = list(history[0])
    rows = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    rows += ["| " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |" for r in history]
    return "\n".join(rows)


def _host(model: Any) -> str:
    return f"{type(model).__name__}, TransformerLens {version('transformer-lens')}"


def _n_params(folder: Path, name: str) -> int:
    sums = _files.expected_checksums(folder, name)
    return sum(t.numel() for t in _files.read_tensors(folder, name, _files.WEIGHTS, sums).values())


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6


def induction_card(folder: Path, result: dict[str, Any]) -> str:
    model = load_folder(folder, "induction-2l", default_host("induction-2l"))
    task = _data.InductionTask.build(seq_len=model.cfg.n_ctx, seed=result["seed"])
    chance, n_symbols = math.log(len(_data.SYMBOLS)), len(_data.SYMBOLS)
    rows = []
    for label, periods, odd in [
        ("training periods, even offsets (seen)", _data.TRAIN_PERIODS, False)
    ] + [(f"period {p}, odd offsets (held out)", (p,), True) for p in _data.HELDOUT_PERIODS]:
        tokens, mask = task.batch(512, torch.Generator().manual_seed(7), periods, odd_offsets=odd)
        rows.append(f"| {label} | {masked_loss(model, tokens, mask):.3f} |")
    probe, probe_mask = _data.repeated_random_tokens(
        256, 60, (_data.FIRST_SYMBOL, _data.INDUCTION_VOCAB), 0, torch.Generator().manual_seed(8)
    )
    rows.append(
        f"| random 60 symbols written twice (period 60 > any trained) | {masked_loss(model, probe, probe_mask):.3f} |"
    )
    prompts = induction_prompts(16, 30, seed=9)
    scores = head_scores(model, prompts)
    scores["late_induction_head"] = late_induction_scores(model, prompts)
    recipe = result["recipe"]
    return f"""# induction-2l

An attention-only two-layer transformer (LayerNorm, learned positions, 4 heads of width 16,
d_model 64, n_ctx 128) over {_data.INDUCTION_VOCAB} tokens: `<|endoftext|>` (BOS, EOS and pad), `<unk>`, and the
{n_symbols} one-character symbols `A-Z a-z 0-9`. Text prompts are read one symbol per token, spaces
ignored: `model.to_tokens("ABCABC")`. {_n_params(folder, "induction-2l"):,} parameters,
{_size_mb(folder):.2f} MB on disk. Retrain with `python -m tl_dynamics.zoo.train induction-2l`.

## Data

Every training sequence is BOS + 127 symbols. Outside the repeated segment each symbol
follows one of three rules: with probability {_data.CONTEXT_BIGRAM_P}, an *in-context bigram*
`x[t] = F[x[t-1]]` for a random map `F` drawn afresh for every sequence (only an earlier
occurrence of the current symbol tells what follows it); otherwise, with probability
{_data.SKIP_BIGRAM_P}, a skip-bigram `x[t] = PERM[x[t-2]]` for one fixed permutation (this makes a
layer-0 previous-token head useful on its own); otherwise a uniform symbol. In every sequence
one uniform random segment of period p is written 2 to 4 times in a row from offset s (first
copy at `[s, s+p)`). Training: p in {list(_data.TRAIN_PERIODS)}, even s. Held out:
p in {list(_data.HELDOUT_PERIODS)}, odd s, written twice.

Why these rules (measured on this machine): repeats of one fixed period teach a positional
shortcut rather than induction; variable-period repeats alone stayed on the loss plateau for
45 minutes; repeats plus the skip-bigram alone (the previous recipe, three seeds) formed a
*late* induction head within 2,000 steps, one that matches the previous token (through a
layer-0 head looking three back) and reads two positions after the earlier copy, with TL's
induction score 0.01. The in-context bigrams reward matching the current token alone: with
them, each of three runs (two trial seeds and the shipped run) formed textbook induction heads
within 1,500-2,000 steps, with late scores at most 0.01.

## Training

Seed {result["seed"]}, {recipe["steps"]} steps of batch {recipe["batch"]} x 128 tokens, AdamW (lr
{recipe["lr"]}, warm-up {recipe["warmup"]}, cosine to 10%, weight decay {recipe["weight_decay"]}),
one CPU thread: {_minutes(result)}.

{_history(result["history"])}

## Held-out repeat loss

Mean next-token loss on the second copy of the repeated segment (its first token excluded),
512 sequences each, measured on the loaded model ({_host(model)}). Chance is
ln {n_symbols} = {chance:.3f}.

| repeats | loss |
|---|---|
{chr(10).join(rows)}

## Head structure

`transformer_lens.head_detector.detect_head` scores (default `"mul"` measure: the share of a
head's attention on the expected key positions; BOS included in the denominator), mean over
16 prompts of 30 random symbols written twice. On these prompts only about half of the rows
have an induction target (the first copy has none, apart from symbols that recur by chance),
so scores around 0.5 are the ceiling.
`late induction head` is `detect_head` with a custom pattern (`_cards.late_induction_pattern`):
key j where `x[j-2] == x[i]`, one position later than TL's induction pattern.

{_detected(scores)}

**What the layer-1 heads do.** They are textbook induction heads: a query at the current
token attends to the position one after that token's earlier occurrence, whose key carries the
previous token written there by the layer-0 previous-token heads (K-composition), and the
head's OV circuit copies the token found there. `late induction head` is kept as a control:
the pattern an earlier recipe produced instead (see Data) scores near 0 here.

{scores_table(scores)}
"""


def code_card(folder: Path, result: dict[str, Any]) -> str:
    model = load_folder(folder, "code-2l", default_host("code-2l"))
    scores = head_scores(model, CODE_HEAD_PROMPTS)
    samples = "\n\n".join(
        f"```python\n{greedy_completion(model, p, 24)}\n```" for p in CODE_PROMPTS
    )
    recipe, corpus, last = result["recipe"], result["corpus"], result["history"][-1]
    induction = scores["induction_head"]
    formed = "formed" if (induction > DETECTED).any() else "did not form"
    return f"""# code-2l

A two-layer transformer with MLPs and LayerNorm (d_model 128, 4 heads of width 32, d_mlp 512,
GELU, learned positions, n_ctx 256) trained on the Python standard library's own source. Its
tokenizer is a byte-level BPE of 4,096 tokens trained with `tokenizers` on the same text;
`<|endoftext|>` (id 0) is BOS, EOS and pad. {_n_params(folder, "code-2l"):,} parameters,
{_size_mb(folder):.2f} MB on disk. Retrain with `python -m tl_dynamics.zoo.train code-2l`.

## Data

{corpus["files"]} `.py` files of the standard library of Python {corpus["python"]}
(`test`, `tests`, `idle_test` and `site-packages` excluded), in sorted order; every
{recipe["val_every"]}th file is held out for validation ({corpus["val_files"]} files,
{corpus["val_tokens"]:,} tokens; training {corpus["train_tokens"]:,} tokens). Training windows
are BOS + 255 tokens at random offsets. Another Python version has another standard library,
so a retrain elsewhere gives a similar, not identical, model.

Induction: measured earlier on this machine, a model this size trained for 10 minutes on this
text alone formed no induction head. So in {recipe["repeat_share"]:.0%} of the training windows a segment of 8 to 127 tokens is copied
directly after itself (variable period, random offset), which rewards copying from context.
The induction head {formed} (scores below).

## Training

Seed {result["seed"]}, {recipe["steps"]} steps of batch {recipe["batch"]} x 256 tokens, AdamW (lr {recipe["lr"]},
warm-up {recipe["warmup"]}, cosine to 10%, weight decay {recipe["weight_decay"]}), one CPU thread:
{_minutes(result)}.{_frozen_b_U(recipe)} `val_loss`: validation next-token loss (nats/token, 64 windows);
`repeat_loss`: loss on the second copy of 100 random tokens written twice (chance
ln 4095 = {math.log(4095):.2f}).

{_history(result["history"])}

Final validation loss **{last["val_loss"]:.3f}**; repeated-random-token loss {last["repeat_loss"]:.3f}.

## Sample completions (greedy, 24 tokens, {_host(model)})

{samples}

## Head structure

`transformer_lens.head_detector.detect_head` scores (default `"mul"` measure), mean over
{len(CODE_HEAD_PROMPTS)} code prompts, two of them code written twice.

{_detected(scores)}

{scores_table(scores)}
"""


def _frozen_b_U(recipe: dict[str, Any]) -> str:
    if not recipe.get("freeze_b_U"):
        return ""
    return (
        " The unembedding bias `b_U` is frozen at zero, as GPT-2 has none, so "
        '`zoo.export_gpt2("code-2l", folder)` writes an exact Hugging Face GPT-2 folder '
        "(`TransformerBridge.boot_transformers(folder)`)."
    )


def _minutes(result: dict[str, Any]) -> str:
    last = result["history"][-1]
    cpu = (
        f" ({last['cpu_minutes']:.1f} minutes of CPU; the 2-core machine was shared)"
        if "cpu_minutes" in last
        else ""
    )
    return f"{last['minutes']:.1f} minutes{cpu}"


def write_card(folder: Path, name: str) -> None:
    """Measure the saved model and write ``MODEL_CARD.md`` beside it."""
    result = json.loads((folder / TRAINING_LOG).read_text())
    if name == "regression-2l":
        card = _regression_card.regression_card(
            folder, result, _history(result["history"]), _minutes(result)
        )
    else:
        card = (
            induction_card(folder, result) if name == "induction-2l" else code_card(folder, result)
        )
    (folder / CARD).write_text(card)
