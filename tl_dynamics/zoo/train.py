"""Train a shipped model and write its folder: ``python -m tl_dynamics.zoo.train NAME``.

Fixed seed, deterministic data, one CPU thread. The model is trained as a plain-torch module
with TransformerLens parameter names (``_torch_model``), saved, loaded back through
``tl_dynamics.zoo`` on the installed TransformerLens, and measured there; the measurements go
into ``MODEL_CARD.md`` beside the weights. ``--reference-only`` rewrites just the cross-host
reference log-probabilities with the installed host (run it under TransformerLens 3.x).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, cast

import torch

from tl_dynamics.collect import torch_threads
from tl_dynamics.zoo import _cards, _data, _files
from tl_dynamics.zoo import _regression_task as _reg
from tl_dynamics.zoo._load import default_host, load_folder, model_folder
from tl_dynamics.zoo._measure import masked_loss
from tl_dynamics.zoo._torch_model import TorchTransformer

log = logging.getLogger("tl_dynamics.zoo.train")
SEED = 0
CALIBRATION_STEPS = 30

INDUCTION_CFG: dict[str, Any] = dict(
    d_model=64, d_head=16, n_layers=2, n_ctx=128, n_heads=4, d_mlp=None, d_vocab=_data.INDUCTION_VOCAB,
    act_fn=None, attn_only=True, normalization_type="LN", positional_embedding_type="standard",
    eps=1e-5, model_name="induction-2l", default_prepend_bos=True,
)  # fmt: skip
CODE_CFG: dict[str, Any] = dict(
    d_model=128, d_head=32, n_layers=2, n_ctx=256, n_heads=4, d_mlp=512, d_vocab=4096,
    act_fn="gelu_new", attn_only=False, normalization_type="LN", positional_embedding_type="standard",
    eps=1e-5, model_name="code-2l", default_prepend_bos=True,
)  # fmt: skip
REGRESSION_CFG: dict[str, Any] = dict(
    d_model=64, d_head=8, n_layers=2, n_ctx=_reg.SEQ_LEN, n_heads=8, d_mlp=None, d_vocab=_reg.VOCAB,
    act_fn=None, attn_only=True, normalization_type="LN", positional_embedding_type="standard",
    eps=1e-5, model_name="regression-2l", default_prepend_bos=False,
)  # fmt: skip
RECIPES: dict[str, dict[str, Any]] = {
    "induction-2l": dict(
        steps=8000, batch=32, lr=2e-3, warmup=200, weight_decay=0.01, eval_every=500
    ),
    "code-2l": dict(
        steps=None,
        cpu_minutes=12,
        batch=16,
        lr=3e-3,
        warmup=100,
        weight_decay=0.01,
        eval_every=200,
        repeat_share=0.3,
        val_every=20,
        freeze_b_U=True,
    ),  # fmt: skip
    "regression-2l": dict(  # steps: what 5 CPU minutes gave on the calibration run
        steps=9454,
        cpu_minutes=5,
        batch=32,
        lr=3e-3,
        warmup=200,
        weight_decay=0.01,
        eval_every=500,
        numeric_embeddings=True,
    ),
}
# Fixed prompts for the cross-host reference log-probabilities.
REFERENCE_PROMPTS = {
    "induction-2l": "Gq7xP2mZkR0aLwT Gq7xP2mZkR0aLwT 5bN",
    "code-2l": "import os\n\ndef read(path):\n    with open(path) as f:\n        return f.read()\n",
    "regression-2l": "x17 y20 x301 y9 x5 y16 x44 y12 x260",
}


def fit(
    model: torch.nn.Module,
    recipe: dict[str, Any],
    next_batch: Callable[[], torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    evaluate: Callable[[], dict[str, float]],
    save: Callable[[], None],
) -> list[dict[str, float]]:
    """AdamW with linear warm-up and cosine decay to 10%; returns the evaluation history.

    ``save`` runs after every evaluation, so an interrupted run leaves its latest weights.
    ``next_batch`` gives tokens, or tokens and a mask ``[batch, pos - 1]`` of the next-token
    targets the loss counts (all of them without one).

    With ``recipe["cpu_minutes"]`` and no ``recipe["steps"]``, the step count is fixed after
    ``CALIBRATION_STEPS`` steps so that training takes about that much CPU time on this machine
    (CPU, not wall time, since the machine may be shared), and written back into ``recipe``
    (rerun with ``--steps`` for the identical model).
    """
    from tqdm import tqdm

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe["lr"],
        betas=(0.9, 0.99),
    )
    warmup = recipe["warmup"]
    steps = recipe.get("steps") or CALIBRATION_STEPS + 1

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    history, start, cpu_start, step = [], time.time(), time.process_time(), 0
    bar = tqdm(total=recipe.get("steps"), mininterval=5.0, desc="train")
    while step < steps:
        model.train()
        drawn = next_batch()
        tokens, mask = drawn if isinstance(drawn, tuple) else (drawn, None)
        logits, targets = model(tokens[:, :-1]), tokens[:, 1:]
        if mask is not None:
            logits, targets = logits[mask], targets[mask]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if step == CALIBRATION_STEPS and not recipe.get("steps"):
            per_step = (time.process_time() - cpu_start) / step
            steps = recipe["steps"] = max(warmup + 1, int(recipe["cpu_minutes"] * 60 / per_step))
            bar.total = steps
            log.info("%.3f CPU s/step: training for %d steps", per_step, steps)
        if step % recipe["eval_every"] == 0 or step == steps:
            model.eval()
            row = {
                "step": step, "minutes": (time.time() - start) / 60,
                "cpu_minutes": (time.process_time() - cpu_start) / 60, "train_loss": loss.item(), **evaluate(),
            }  # fmt: skip
            history.append(row)
            log.info(" ".join(f"{k}={v:.4g}" for k, v in row.items()))
            save()
    bar.close()
    return history


def train_induction(folder: Path, init: Path | None = None) -> dict[str, Any]:
    recipe = RECIPES["induction-2l"]
    task = _data.InductionTask.build(seq_len=INDUCTION_CFG["n_ctx"], seed=SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    heldout = task.batch(
        512, torch.Generator().manual_seed(SEED + 2), _data.HELDOUT_PERIODS, odd_offsets=True
    )
    model = TorchTransformer(INDUCTION_CFG)
    if init is not None:  # continue a run: start from its saved weights
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(init / _files.WEIGHTS)))

    def evaluate() -> dict[str, float]:
        return {"heldout_repeat_loss": masked_loss(model, *heldout)}

    tokenizer = _data.induction_tokenizer()
    history = fit(
        model, recipe, lambda: task.batch(recipe["batch"], gen, copies=_data.TRAIN_COPIES)[0], evaluate,
        lambda: save_folder(folder, model, INDUCTION_CFG, tokenizer),
    )  # fmt: skip
    return {"seed": SEED, "history": history, "recipe": recipe, "init": str(init) if init else None}


def train_code(folder: Path) -> dict[str, Any]:
    recipe, cfg = RECIPES["code-2l"], CODE_CFG
    files = _data.stdlib_files()
    texts = _data.stdlib_texts(files)
    val_idx = set(range(0, len(files), recipe["val_every"]))
    train_texts = [t for i, t in enumerate(texts) if i not in val_idx]
    val_texts = [t for i, t in enumerate(texts) if i in val_idx]
    log.info(
        "corpus: %d files (%d validation), %.1f MB",
        len(files),
        len(val_texts),
        sum(map(len, texts)) / 1e6,
    )
    tokenizer = _data.train_code_tokenizer(train_texts, cfg["d_vocab"])
    train_ids = _data.encode_corpus(tokenizer, train_texts)
    val_ids = _data.encode_corpus(tokenizer, val_texts)
    log.info("tokens: %d train, %d validation", len(train_ids), len(val_ids))
    n_ctx, bos = cfg["n_ctx"], cast(int, tokenizer.bos_token_id)  # the trained tokenizer has one
    gen = torch.Generator().manual_seed(SEED + 1)
    val_gen = torch.Generator().manual_seed(SEED + 2)
    val_tokens = _data.windows(val_ids, 64, n_ctx, bos, val_gen)
    rep_tokens, rep_mask = _data.repeated_random_tokens(
        32, 100, (bos + 1, cfg["d_vocab"]), bos, val_gen
    )
    model = TorchTransformer(cfg)
    if recipe.get("freeze_b_U"):  # GPT-2 has no unembedding bias: keep it zero for export_gpt2
        model.unembed.b_U.requires_grad_(False)

    def next_batch() -> torch.Tensor:
        tokens = _data.windows(train_ids, recipe["batch"], n_ctx, bos, gen)
        return _data.splice_repeats(tokens, recipe["repeat_share"], gen)

    def evaluate() -> dict[str, float]:
        full = torch.ones(val_tokens.shape[0], n_ctx - 1, dtype=torch.bool)
        return {
            "val_loss": masked_loss(model, val_tokens, full),
            "repeat_loss": masked_loss(model, rep_tokens, rep_mask),
        }

    history = fit(
        model, recipe, next_batch, evaluate, lambda: save_folder(folder, model, cfg, tokenizer)
    )
    corpus = {
        "files": len(files), "val_files": len(val_texts), "train_tokens": len(train_ids),
        "val_tokens": len(val_ids), "python": _data.python_version(),
    }  # fmt: skip
    return {"seed": SEED, "history": history, "recipe": recipe, "corpus": corpus}


def train_regression(folder: Path) -> dict[str, Any]:
    recipe, cfg = RECIPES["regression-2l"], REGRESSION_CFG
    task = _reg.RegressionTask.build(SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    heldout = task.sample(512, torch.Generator().manual_seed(SEED + 2))
    model = TorchTransformer(cfg)
    if recipe.get("numeric_embeddings"):
        _reg.numeric_embeddings(model.embed.W_E, task, torch.Generator().manual_seed(SEED + 3))

    def evaluate() -> dict[str, float]:
        nll = _reg.model_nll(model, heldout.tokens)
        return {
            "heldout_loss": nll.mean().item(),
            "late_loss": nll[:, -_reg.LATE_PAIRS :].mean().item(),
        }

    history = fit(
        model, recipe, lambda: task.batch(recipe["batch"], gen), evaluate,
        lambda: save_folder(folder, model, cfg, _reg.regression_tokenizer()),
    )  # fmt: skip
    return {"seed": SEED, "history": history, "recipe": recipe}


def save_folder(folder: Path, model: torch.nn.Module, cfg: dict[str, Any], tokenizer: Any) -> None:
    _files.write_folder(folder, model, cfg, tokenizer)


def write_reference(folder: Path, name: str) -> None:
    """Next-token log-probabilities of the fixed prompt under the installed host."""
    from safetensors.torch import save_file

    model = load_folder(folder, name, default_host(name))
    tokens = model.to_tokens(REFERENCE_PROMPTS[name])
    with torch.no_grad():
        logp = model(tokens).log_softmax(-1)[0]
    tensors = {
        "tokens": tokens[0].contiguous(),
        "next_token_logprobs": logp[:-1].gather(-1, tokens[0, 1:, None])[:, 0].contiguous(),
        "last_logprobs": logp[-1].contiguous(),
    }
    meta = {"host": f"{type(model).__name__} (TransformerLens {version('transformer-lens')})"}
    save_file(tensors, str(folder / _files.REFERENCE), metadata=meta)
    _files.write_checksums(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tl_dynamics.zoo.train", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, help="folder to write (default: the package's own)")
    parser.add_argument("--steps", type=int, help="override the recipe's step count (for trials)")
    parser.add_argument(
        "--reference-only", action="store_true", help="only rewrite reference.safetensors"
    )
    parser.add_argument("--init", type=Path, help="induction-2l: start from this folder's weights")
    parser.add_argument(
        "--card-only", action="store_true", help=f"only rewrite the card from {_cards.TRAINING_LOG}"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with torch_threads(1):  # training is reproducible on one thread
        _main(args)


def _main(args: argparse.Namespace) -> None:
    torch.manual_seed(SEED)
    folder = args.out or model_folder(args.name)
    if args.reference_only:
        write_reference(folder, args.name)
        return
    if args.card_only:
        _cards.write_card(folder, args.name)
        return
    if args.steps:
        RECIPES[args.name]["steps"] = args.steps
    trainers = {
        "induction-2l": lambda: train_induction(folder, args.init),
        "code-2l": lambda: train_code(folder),
        "regression-2l": lambda: train_regression(folder),
    }
    result = trainers[args.name]()
    (folder / _cards.TRAINING_LOG).write_text(json.dumps(result, indent=1) + "\n")
    write_reference(folder, args.name)
    _cards.write_card(folder, args.name)
    log.info("wrote %s", folder)


if __name__ == "__main__":
    main()
