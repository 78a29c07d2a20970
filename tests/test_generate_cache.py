"""``generate`` with the KV cache inside ``attach()`` (issue 40, docs/math.md §3.6): each cached
decoding step is collected as its new query rows against every cached key, and the steps
together are the pass ``model(generated sequence)`` runs (all but the last generated token,
which no step runs), within ``PAD_TOL``; or, where the host's own cached steps are wrong, refused
by name with the measured difference.

On the installed hosts: TransformerLens 3.x's ``HookedTransformer`` keeps a real cache (each step
runs one new token against it), a natively booted 4.x bridge reruns the whole sequence at each
"cached" step; both are exact. Bridges booted from transformers (4.3 and 3.9) fill no cache, so
each cached step attends to itself alone and the text they generate is not the model's:
refused, saying so, with ``use_past_kv_cache=False`` as the way out."""

from __future__ import annotations

import pytest
import torch

from tl_dynamics.errors import TLDynamicsError
from test_attach_entry_points import ANALYSES, inputs, model_of
from test_attach_entry_points import generating as generate_tokens
from test_padding import TEXTS, assert_close, results

N_NEW = 5  # tokens each generate adds


def generating(model, prompt, cache: bool = True, n: int = N_NEW):
    return generate_tokens(model, prompt, cache, n)


@pytest.mark.parametrize("name", ANALYSES)
def test_cached_generate_collects_the_rows_of_the_whole_sequence(name):
    model = model_of("zoo")  # a HookedTransformer (3.x) or a native bridge (4.x)
    prompt = inputs(model)[0][:1, 3:]
    with torch.no_grad(), ANALYSES[name](model) as collector:
        out = generating(model, prompt)
    with torch.no_grad():
        assert torch.equal(out, generating(model, prompt, cache=False)), "the host is exact"
        with ANALYSES[name](model) as whole:
            model(out[:, :-1])
    assert_close(results(name, collector), results(name, whole), f"zoo/{name}/generate")


def test_batched_cached_generate_follows_the_padding():
    """Texts of different lengths, left-padded by ``generate`` with the host's mask: the
    stitched pass is ``model(tokens, attention_mask=mask)`` of the padded sequence, its pads
    left out."""
    model = model_of("zoo")
    with torch.no_grad(), ANALYSES["odds_ratio"](model) as collector:
        out = model.generate(
            TEXTS,
            max_new_tokens=3,
            use_past_kv_cache=True,
            do_sample=False,
            stop_at_eos=False,
            verbose=False,
            return_type="tokens",
        )
    mask = torch.ones_like(out[:, :-1])
    for row, text in enumerate(TEXTS):  # left padding: the pads before each text
        mask[row, : model.to_tokens(TEXTS).shape[1] - model.to_tokens(text).shape[1]] = 0
    with torch.no_grad(), ANALYSES["odds_ratio"](model) as whole:
        model(out[:, :-1], attention_mask=mask)
    assert_close(results("odds_ratio", collector), results("odds_ratio", whole), "batched")


@pytest.mark.parametrize("name", ANALYSES)
def test_a_host_whose_cached_steps_are_wrong_is_refused_with_the_measure(name):
    """The tiny GPT-2 booted from transformers: its cached generation is not its uncached one
    (checked here, without tl_dynamics), and attach refuses it at the first cached step, naming
    the keys it saw and the measured difference; nothing is collected."""
    model = model_of("hf")
    prompt = inputs(model)[0][:1, 3:]
    with torch.no_grad():
        assert not torch.equal(generating(model, prompt), generating(model, prompt, cache=False))
        with pytest.raises(TLDynamicsError) as refused, ANALYSES[name](model) as collector:
            generating(model, prompt)
    text = str(refused.value)
    assert "the host's cached generation itself is wrong on this model" in text
    assert "sees 1 of the 7 positions (its cache held 0)" in text
    assert "differs from the model's own" in text and "use_past_kv_cache=False" in text
    with pytest.raises(TLDynamicsError, match="no forward pass has run"):
        collector.result()
    assert all(len(p.fwd_hooks) == 0 for p in model.hook_dict.values())
    assert "generate" not in vars(model) and "to_tokens" not in vars(model)


def test_a_cached_pass_outside_generate_is_refused():
    """A pass through a cache the adapter did not follow (no generate around it)."""
    model = model_of("zoo")
    tokens = inputs(model)[0][:1]
    with torch.no_grad(), ANALYSES["odds_ratio"](model):
        try:
            model(tokens, use_past_kv_cache=True)
        except TypeError:  # a HookedTransformer takes a cache object, not this flag
            pytest.skip("this host's forward takes no use_past_kv_cache flag")
        except TLDynamicsError as refusal:
            assert "outside generate" in str(refusal)
            return
    pytest.fail("a cached pass outside generate was collected")


def test_the_host_cache_is_read_by_its_reader_table():
    """The positions a cache holds are read through ``CACHE_READS``: a transformers ``Cache``'s
    ``get_seq_length()``, TransformerLens's entry's ``past_keys``; a cache that moved them is a
    refusal naming the attribute and the versions, never a guess."""
    from types import SimpleNamespace

    from tl_dynamics.adapter._generate import cached_positions

    assert cached_positions("past_key_values", SimpleNamespace(get_seq_length=lambda: 9)) == 9
    entry = SimpleNamespace(past_keys=torch.zeros(1, 7, 2, 4))
    assert cached_positions("past_kv_cache_entry", entry) == 7
    assert cached_positions("use_cache", None) == 0
    with pytest.raises(
        TLDynamicsError, match=r"SimpleNamespace\.get_seq_length: missing .* tests ran on"
    ):
        cached_positions("past_key_values", SimpleNamespace(seen_tokens=9))
    with pytest.raises(TLDynamicsError, match="recurrent state, not a KV cache"):
        cached_positions("cache_params", SimpleNamespace())
