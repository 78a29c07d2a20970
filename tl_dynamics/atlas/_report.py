"""The atlas section of the ``tl-dynamics report`` page: every head's roles, with the report's
prompts as the natural probes."""

from __future__ import annotations

import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.atlas._api import compute
from tl_dynamics.atlas._rules import LEARNED_SINK_FLOOR
from tl_dynamics.evidence import MIN_UNITS

# The report runs the interventions only up to this many heads (three patched variants each);
# larger models get the scores and a pointer to ``tl-dynamics heads``, which runs them all.
REPORT_CAUSAL_HEADS = 64
# Each natural probe is at most this many leading tokens of its prompt (the sink split costs the
# square of the length per head).
REPORT_NATURAL_TOKENS = 128


def first_tokens(batch: Batch, n: int) -> Batch:
    """Every prompt's first ``n`` real tokens, right-padded (``[prompts, <= n]``).

    Example:
        >>> b = Batch(torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]]),
        ...           torch.tensor([[False, True, True, True], [True, True, False, False]]), "left")
        >>> first_tokens(b, 2).tokens.tolist()
        [[5, 6], [8, 9]]
    """
    rows = [batch.real_tokens(r)[:n] for r in range(batch.tokens.shape[0])]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=batch.tokens.dtype, device=batch.tokens.device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=batch.tokens.device)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], valid[i, : len(r)] = r, True
    return Batch(tokens, valid, "right")


def _model_arg(page: viz.Page) -> str:
    """The ``--model`` a reader would pass to run this page's model again (its label's name)."""
    label = dict(page.meta).get("model", "") if page.meta else ""
    return label.split(" (")[0] or "MODEL"


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add "What each head does" to ``page``: the atlas, the report's prompts as natural probes.

    Each prompt's first 128 real tokens is a natural probe, beside the repeated random-token
    probes; the causal columns are run only on models with at most 64 heads. What the prompts
    are too few to decide is said once, with the command that decides it.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); every row is used.

    Example:
        >>> from tl_dynamics import atlas, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> atlas.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'What each head does'
    """
    n_heads = adapter.n_layers * adapter.n_heads
    causal = n_heads <= REPORT_CAUSAL_HEADS
    natural = first_tokens(batch, REPORT_NATURAL_TOKENS)
    n_prompts = int(natural.tokens.shape[0])
    result = compute(adapter, natural, causal=causal)
    page.results["atlas"] = result  # the heads a later section (QK attribution) explains
    cut = bool((batch.key_valid.sum(-1) > REPORT_NATURAL_TOKENS).any())
    read = f"the report's {n_prompts} prompt{'s' if n_prompts != 1 else ''}" + (
        f" (each cut to its first {REPORT_NATURAL_TOKENS} tokens)" if cut else ""
    )
    not_run = [n.split(": ", 1)[1] for n in result.notes if n.startswith("causal evidence not run")]
    if not_run:  # the host cannot patch these heads (delegated attention), or an encoder
        cost = f"The causal columns are left out: {not_run[0]}."
    elif causal:
        cost = (
            f"Numbers under a role: the change in next-token loss when the head is mean-ablated "
            f"on {read}."
        )
    else:
        cost = (
            f"The causal columns are left out of the report for {n_heads} heads (more than "
            f"{REPORT_CAUSAL_HEADS}); `tl-dynamics heads --model {_model_arg(page)}` runs them "
            f"(every head estimated by attribution patching, the strongest ablated exactly)."
        )
    few = ""
    if n_prompts < MIN_UNITS:
        few = (
            f" Sinks and locality are read on {read}: fewer than {MIN_UNITS} prompts decide "
            f"no sink or locality role, so those heads read 'undecided on {n_prompts} probe"
            f"{'s' if n_prompts != 1 else ''}'. `tl-dynamics heads --model {_model_arg(page)} "
            f"--prompts FILE`, with {MIN_UNITS} or more prompts one per line, decides them."
        )
    page.add_section(
        "What each head does",
        [result.show()],
        intro=(
            "Each head's roles from its pattern and the mechanism behind it, read on the model's "
            "own pass: the pattern on repeated random token sequences; for induction and "
            "duplicate-token heads, which components wrote the attended key and the query (QK "
            "attribution); for copying, whether what the head writes from a token raises that "
            "token's logit; the sink's dominance and its cause from the odds-ratio split (and, "
            "where the model has them, the mass each head's learned sink absorbs, named "
            f'"learned sink" from {LEARNED_SINK_FLOOR:.2f}). Each score is compared with a '
            f"weight-shuffled copy of the model by a margin of {result.margin}, with a 95% "
            f"interval over the probes. {cost}{few} Hover a cell for the evidence."
        ),
    )
