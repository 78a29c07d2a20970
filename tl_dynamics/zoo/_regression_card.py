"""``regression-2l``'s model card: the task solved in context (loss by pairs seen against a
context-free predictor and a ridge oracle) and its heads read by ``tl_dynamics.regression``
beside two controls, the same weights shuffled and the same configuration untrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tl_dynamics.zoo import _files
from tl_dynamics.zoo import _regression_task as _reg
from tl_dynamics.zoo._load import default_host, load_folder
from tl_dynamics.zoo._load import untrained as _untrained

NAME = "regression-2l"
CARD_SEQUENCES = 2048  # held-out sequences for the loss table
CARD_SEED = 7  # their generator's seed (training draws from 1, its evaluation from 2)
ANALYSIS_PROMPTS = 64  # held-out sequences the regression view reads (32 fit, 32 held out)
ANALYSIS_SEED = 3
SHUFFLE_SEED = 1
UNTRAINED_SEED = 0


def readings(
    model: Any, stride: int = 2, seed: int = ANALYSIS_SEED, n: int = ANALYSIS_PROMPTS
) -> Any:
    """``tl_dynamics.regression.compute`` on ``n`` held-out sequences of the task (token ids),
    every head of both layers, default settings but ``stride``: 2 measures the x-token
    destinations only (even positions), where the model predicts a y; 1 measures all."""
    from tl_dynamics import regression

    return regression.compute(model, _reg.heldout_sample(n, seed).tokens, stride=stride)


def controls(model: Any, stride: int = 2, seed: int = ANALYSIS_SEED) -> dict[str, Any]:
    """The trained model's readings beside its shuffled-weights and untrained controls, on the
    held-out sequences of ``seed``."""
    from tl_dynamics.adapter import ModelAdapter, shuffled_weights

    adapter = ModelAdapter.of(model)
    shuffled = shuffled_weights(adapter, seed=SHUFFLE_SEED)
    return {
        "trained": readings(adapter, stride, seed),
        f"shuffled (seed {SHUFFLE_SEED})": readings(shuffled, stride, seed),
        f"untrained (seed {UNTRAINED_SEED})": readings(
            _untrained(NAME, UNTRAINED_SEED), stride, seed
        ),
    }


def claims_table(res: Any) -> str:
    """Markdown: one row per head, its reading and the claim-band numbers."""
    frame = res.claims()
    lines = [
        "| head | reading | best regression (R²) | best linear (R²) | best control (R²) "
        "| Δ regression [low] | Δ linear [low] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in frame.itertuples():
        lines.append(
            f"| L{r.layer}H{r.head} | {r.reading} | {r.best_regression} ({r.r2_regression:.2f}) "
            f"| {r.best_linear} ({r.r2_linear:.2f}) | {r.best_control} ({r.r2_control:.2f}) "
            f"| {r.delta_regression:+.2f} [{r.delta_regression_low:+.2f}] "
            f"| {r.delta_linear:+.2f} [{r.delta_linear_low:+.2f}] |"
        )
    return "\n".join(lines)


def _heads(res: Any, mask: np.ndarray) -> str:
    found = [f"L{res.layers[i]}H{res.heads[j]}" for i, j in zip(*np.nonzero(mask))]
    return ", ".join(found) or "none"


def summary(results: dict[str, Any]) -> str:
    """Markdown: per model, the heads that read regression and linear, and the largest lower
    ends of the two differences."""
    lines = [
        "| model | regression-like heads | linear-like heads | max Δ regression low "
        "| max Δ linear low |",
        "|---|---|---|---|---|",
    ]
    for label, res in results.items():
        lines.append(
            f"| {label} | {_heads(res, res.regression_like)} | {_heads(res, res.linear_like)} "
            f"| {np.nanmax(res.delta_regression[..., 1]):+.2f} "
            f"| {np.nanmax(res.delta_linear[..., 1]):+.2f} |"
        )
    return "\n".join(lines)


def verdict(results: dict[str, Any]) -> str:
    """One paragraph: the trained head closest to ridge beyond its rivals, against the controls."""
    res = results["trained"]
    delta = res.delta_regression[..., 0]
    i, j = np.unravel_index(np.nanargmax(delta), delta.shape)
    row = res.claims().set_index(["layer", "head_index"]).loc[(res.layers[i], res.heads[j])]
    rivals = max(
        np.nanmax(r.delta_regression[..., 0]) for k, r in results.items() if k != "trained"
    )
    met = (res.reading() == "regression").any()
    controls_read = any(
        (r.reading() == "regression").any() for k, r in results.items() if k != "trained"
    )
    return (
        f"The head whose best ridge or GD predictor most beats its best linear-attention or "
        f"control predictor is L{res.layers[i]}H{res.heads[j]}: {row.best_regression} held-out "
        f"R² {row.r2_regression:.2f} against {row.best_linear}'s {row.r2_linear:.2f} "
        f"({row.delta_regression:+.2f}, lower end {row.delta_regression_low:+.2f}); it reads "
        f"`{row.reading}`. {'A' if controls_read else 'No'} control head reads `regression` "
        f"(their largest difference: {rivals:+.2f}). "
        "The issue's planted case (b), heads that read `regression` well above their "
        f"controls, is {'met' if met else 'not met'} here (docs/math.md §8.5)."
    )


def regression_card(folder: Path, result: dict[str, Any], history: str, minutes: str) -> str:
    model = load_folder(folder, NAME, default_host(NAME))
    task = _reg.RegressionTask.build(result["seed"])
    sample = task.sample(CARD_SEQUENCES, torch.Generator().manual_seed(CARD_SEED))
    rows = {
        "regression-2l": _reg.by_band(_reg.model_nll(model, sample.tokens)),
        "context-free (prior predictive)": _reg.by_band(task.context_free_nll(sample)),
        "ridge oracle (posterior predictive)": _reg.by_band(task.oracle_nll(sample)),
    }
    head = "| predictor | " + " | ".join(f"pairs {a}-{b}" for a, b in _reg.PAIR_BANDS) + " |"
    loss_table = "\n".join(
        [head, "|---|" + "---|" * len(_reg.PAIR_BANDS)]
        + [f"| {k} | " + " | ".join(f"{x:.3f}" for x in v) + " |" for k, v in rows.items()]
    )
    results, every = controls(model, 2), controls(model, 1)
    recipe = result["recipe"]
    sums = _files.expected_checksums(folder, NAME)
    n_params = sum(
        t.numel() for t in _files.read_tensors(folder, NAME, _files.WEIGHTS, sums).values()
    )
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
    return f"""# regression-2l

An attention-only two-layer transformer (LayerNorm, learned positions, 8 heads of width 8,
d_model 64, n_ctx {_reg.SEQ_LEN}) trained on in-context linear regression written in tokens, in
the spirit of von Oswald et al. 2023. {n_params:,} parameters, {size:.2f} MB on disk. Retrain with
`python -m tl_dynamics.zoo.train {NAME}`.

## Task

Tokens: `<|endoftext|>` (id 0, BOS of the tokenizer, never written: `default_prepend_bos` is
False), `<unk>`, {_reg.N_X} x-tokens `x0 .. x{_reg.N_X - 1}` and
{_reg.N_BINS} y-tokens `y0 .. y{_reg.N_BINS - 1}`; prompts are words separated by spaces,
`model.to_tokens("x17 y20 x301")`. Each x-token has a fixed random vector u in R^{_reg.D_X}
(`N(0, I)`, seed {result["seed"]}). Each sequence draws its own w ~ N(0, I) and writes
{_reg.N_PAIRS} pairs `x_i y_i`, so the x-tokens sit at the even positions: the x_i are distinct (drawn without replacement, so the
query's x never occurred earlier and nothing can be copied), y_i is the bin of
w.u/sqrt({_reg.D_X}) + {_reg.NOISE} eps among {_reg.N_BINS} equal bins of [-{_reg.Y_MAX:g},
{_reg.Y_MAX:g}] (outer bins open). Training counts the loss on the y-tokens only; only the
context tells w.

Design history (measured on this machine): a first recipe (u in R^3, 48 pairs, default
embedding initialisation, batch 64) stayed on a plateau for its 5 CPU minutes (2,677 steps):
late-pair loss 2.377 against the context-free 2.608 and the oracle's 0.768. The same task with the embedding rows
initialised from the numbers (`_regression_task.numeric_embeddings`) and batch 32 was still on
it after 3,000 steps. The shipped recipe (u in R^2, 24 pairs, numeric initialisation, lr 3e-3)
left the plateau after about 2,000 steps.

## Training

Seed {result["seed"]}, {recipe["steps"]} steps of batch {recipe["batch"]} fresh sequences,
AdamW (lr {recipe["lr"]}, warm-up {recipe["warmup"]}, cosine to 10%, weight decay
{recipe["weight_decay"]}), one CPU thread: {minutes}. `heldout_loss`: mean loss on the y-tokens
of 512 held-out sequences; `late_loss`: the same on their last {_reg.LATE_PAIRS} pairs.

{history}

## The task is solved in context

Mean loss (nats) on the y-token of the j-th pair, by j, over {CARD_SEQUENCES} held-out
sequences, measured on the loaded model. *Context-free*: the best predictor that sees only the
query's x (y | u ~ N(0, |u|²/{_reg.D_X} + {_reg.NOISE}²), binned exactly). *Ridge oracle*: the
Bayesian posterior predictive of w given the earlier pairs (ridge regression at the prior's
lambda), each earlier y-token read as its bin's centre, binned exactly. Chance is ln
{_reg.N_BINS} = {np.log(_reg.N_BINS):.3f}.

{loss_table}

## Heads read as in-context regression

`tl_dynamics.regression.compute` (docs/math.md §8) on {ANALYSIS_PROMPTS} held-out sequences
(seed {ANALYSIS_SEED}; units are sequences, half fit the gains and half are held out), every head,
default settings but `stride=2`: the destinations measured are the x-tokens, where the model
predicts a y (all keys are used). d_head = 8, so claims are made on destinations that see at
least 16 keys (the claim band: the x-tokens of the 9th pair on). A head is *regression-like* where its best ridge or GD
(at least two steps) predictor beats its best linear-attention or control predictor by more
than 0.05 (`MARGIN`, docs/math.md §8.4) held-out R² at the lower end of the 95% bootstrap interval; *linear-like* where
its best linear-attention predictor so beats its best control. Controls: the same weights
shuffled (`tl_dynamics.adapter.shuffled_weights`) and the same configuration untrained.

{summary(results)}

All destinations (`stride=1`: the y-tokens too, whose outputs the training loss never reads):

{summary(every)}

The trained model, head by head (`stride=2`, claim band; Δ: held-out R² difference, [low]: the lower end of
its bootstrap interval):

{claims_table(results["trained"])}

{verdict(results)}
"""
