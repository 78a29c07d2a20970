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
    or GD predictor beats its best linear or control predictor, even at the point estimate
    (measured: every difference below -0.07; most of their heads read ``linear``, since small
    scores are the near-linear regime of softmax)."""
    for label in ("shuffled", "untrained"):
        res = next(r for k, r in readings.items() if k.startswith(label))
        assert not res.regression_like.any(), label
        assert np.nanmax(res.delta_regression[..., 0]) < 0, label


def test_trained_model_has_one_head_closer_to_ridge_than_to_linear_attention(readings):
    """(b), what is found: the trained model's layer-1 head L1H4 is the head whose best ridge or
    GD predictor most beats its best linear-attention or control predictor (here ridge@0.01,
    held-out R² 0.43 against linear_norm's 0.23: +0.20, the lower end of its interval +0.05;
    +0.08 and +0.10 on the sequences of seeds 3 and 12), above every control head (all
    negative, at most -0.05); the other heads read ``linear`` or a baseline."""
    res = readings["trained"]
    delta = res.delta_regression[..., 0]
    layer, head = np.unravel_index(np.nanargmax(delta), delta.shape)
    assert (res.layers[layer], res.heads[head]) == (1, 4)
    controls = max(
        np.nanmax(r.delta_regression[..., 0]) for k, r in readings.items() if k != "trained"
    )
    assert delta[layer, head] > controls + 0.1, (delta[layer, head], controls)
    assert delta[layer, head] > 0.05


@pytest.mark.xfail(
    strict=True,
    reason="issue 32 (b) not met: L1H4's ridge predictor explains under half of its z (R² 0.43) "
    "and clears the margin only on some held-out sets, so no head reads 'regression' "
    "(docs/math.md §8.5)",
)
def test_trained_model_has_a_head_that_reads_regression(readings):
    """(b), what the issue asks: a head read as in-context regression (beyond its linear and
    control predictors by the margin, and explaining at least half of z's variance)."""
    assert (readings["trained"].reading() == "regression").any()
