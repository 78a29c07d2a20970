"""regression-2l, the zoo's model trained on in-context linear regression (docs/math.md §8.5,
the issue's planted cases (b) and (c)): it solves its task in context, beating the best
context-free predictor and improving with the pairs it has seen; the regression view reads its
heads on held-out sequences, beside the same weights shuffled and the same configuration
untrained. Numbers in the model card (``tl_dynamics/zoo/models/regression-2l/MODEL_CARD.md``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from tl_dynamics import zoo
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.regression._measure import MARGIN
from tl_dynamics.zoo import _load
from tl_dynamics.zoo import _regression_card as card
from tl_dynamics.zoo import _regression_task as task

HOSTS = ["hooked", "bridge"] if _load.tl_major_version() < 4 else ["bridge"]
SEED = 11  # held-out sequences of these tests (the card uses 3 and 7, training 1 and 2)
# In-context learning, nats per y-token (the card has the numbers on 2,048 sequences).
BEATS_CONTEXT_FREE = 0.3  # late pairs: model at least this far below the context-free predictor
IMPROVES = 0.3  # late pairs at least this far below the first four


@pytest.fixture(scope="module")
def trained():
    return ModelAdapter(zoo.load("regression-2l"))


@pytest.mark.parametrize("host", HOSTS)
def test_solves_its_task_in_context(host):
    """On held-out sequences the loss at the late pairs is well below the best context-free
    predictor's and below the loss at the first pairs; the ridge oracle bounds it from below."""
    model = zoo.load("regression-2l", host=host)
    reg = task.RegressionTask.build(0)
    sample = task.heldout_sample(256, SEED)
    nll = task.model_nll(model, sample.tokens)
    late = slice(-task.LATE_PAIRS, None)
    free = reg.context_free_nll(sample)[:, late].mean().item()
    oracle = reg.oracle_nll(sample)[:, late].mean().item()
    model_late, model_early = nll[:, late].mean().item(), nll[:, :4].mean().item()
    assert model_late < free - BEATS_CONTEXT_FREE, (model_late, free)
    assert model_late < model_early - IMPROVES, (model_late, model_early)
    assert oracle < model_late, (oracle, model_late)


@pytest.fixture(scope="module")
def readings(trained):
    """The regression view (x-token destinations, ``stride=2``) on 64 held-out sequences: the
    trained model, its weights shuffled, its configuration untrained."""
    return card.controls(trained, stride=2, seed=SEED)


def test_controls_claim_no_regression(readings):
    """(c) The same weights shuffled and the same configuration untrained: no head's best ridge
    or GD predictor beats its best linear or control predictor by more than a fifth of the margin,
    even at the point estimate (measured: at most +0.003; most of their heads read ``linear``,
    since small scores are the near-linear regime of softmax)."""
    for label in ("shuffled", "untrained"):
        res = next(r for k, r in readings.items() if k.startswith(label))
        assert not res.regression_like.any(), label
        assert (res.reading() != "regression").all(), label
        assert np.nanmax(res.delta_regression[..., 0]) < MARGIN / 5, label


def test_trained_model_has_heads_that_read_regression_well_above_their_controls(readings):
    """(b) The trained model, 64 held-out sequences (32 held out): layer-1 head L1H4 is the head
    whose best ridge or GD predictor most beats its best rival on the held-out units (ridge@0.1,
    held-out R² 0.57 against ``gd1``'s 0.34: +0.23, interval +0.15 to +0.32), and it reads
    ``regression``; every control head's difference is at most +0.003. L0H1 (ridge@1 0.84 against
    ``linear_norm``'s 0.76: +0.08, interval +0.05 to +0.11) is undecided at this size: its
    interval reaches the margin (docs/math.md §8.5, §9.2)."""
    res = readings["trained"]
    delta = res.delta_regression[..., 0]
    layer, head = np.unravel_index(np.nanargmax(delta), delta.shape)
    assert (res.layers[layer], res.heads[head]) == (1, 4)
    controls = max(
        np.nanmax(r.delta_regression[..., 0]) for k, r in readings.items() if k != "trained"
    )
    assert delta[layer, head] > controls + 0.15, (delta[layer, head], controls)
    table = res.claims().set_index(["layer", "head_index"])
    assert table.loc[(1, 4), "reading"] == "regression"
    assert table.loc[(0, 1), "reading"] in ("regression", "undecided")
