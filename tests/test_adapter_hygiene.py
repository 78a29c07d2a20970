"""Hook capture registers only its own hooks and removes exactly those, even on errors."""

import pytest
import torch

from tl_dynamics import TLDynamicsError, testing
from tl_dynamics.adapter import ModelAdapter
from helpers import HAS_HOOKED

MODELS = ["gpt2", "llama"] + (["rotary"] if HAS_HOOKED else [])


def _hook_counts(model):
    return {
        name: len(point.fwd_hooks) + len(point.bwd_hooks) for name, point in model.hook_dict.items()
    }


def _user_hook(activation, hook):
    return None


@pytest.fixture(params=MODELS)
def model(request):
    # A fresh model: these tests add user hooks, which must not leak into shared fixtures.
    return testing.tiny_model(request.param)


def test_hooks_removed_after_exception_and_user_hooks_kept(model):
    adapter = ModelAdapter(model)
    user_point = adapter.hook_name("pattern", 0)
    model.hook_dict[user_point].add_hook(_user_hook, dir="fwd")
    before = _hook_counts(model)
    torch_hooks_before = len(model._forward_hooks), len(model._forward_pre_hooks)

    def explode(layer_attention):
        raise RuntimeError("boom in layer %d" % layer_attention.layer)

    batch = adapter.tokenize("x = 1")
    # a bug in a collector reaches the caller as itself (not as a refusal), the hook named
    with pytest.raises(RuntimeError, match="boom in layer 0") as info:
        with adapter.capture(explode):
            adapter.forward(batch)
    assert not isinstance(info.value, TLDynamicsError)
    assert any(
        "raised inside the tl_dynamics hook" in n for n in getattr(info.value, "__notes__", [])
    )
    assert _hook_counts(model) == before
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == torch_hooks_before
    assert [
        h.user_hook if hasattr(h, "user_hook") else None
        for h in model.hook_dict[user_point].fwd_hooks
    ][-1] in (_user_hook, None)
    assert len(model.hook_dict[user_point].fwd_hooks) == 1
    model.hook_dict[user_point].remove_hooks("fwd")
    assert all(count == 0 for count in _hook_counts(model).values())


def test_hooks_removed_after_exception_in_the_with_block(model):
    adapter = ModelAdapter(model)
    with pytest.raises(KeyError):
        with adapter.capture(lambda la: None, reference=True, inputs=True):
            raise KeyError("user code failed")
    assert all(count == 0 for count in _hook_counts(model).values())
    assert len(model._forward_hooks) == 0


def test_normal_exit_leaves_nothing_and_holds_one_layer_at_a_time(model):
    adapter = ModelAdapter(model)
    seen = []
    with adapter.capture(lambda la: seen.append(la.layer)):
        adapter.forward(adapter.tokenize("a b c"))
        adapter.forward(adapter.tokenize("d e"))
    assert seen == [0, 1, 0, 1]
    assert all(count == 0 for count in _hook_counts(model).values())


def test_results_do_not_depend_on_user_hooks_that_read(model):
    adapter = ModelAdapter(model)
    plain = adapter.attention("hello there", layers=[1])[1].pattern()
    model.hook_dict[adapter.hook_name("pattern", 1)].add_hook(_user_hook, dir="fwd")
    try:
        again = adapter.attention("hello there", layers=[1])[1].pattern()
    finally:
        model.hook_dict[adapter.hook_name("pattern", 1)].remove_hooks("fwd")
    assert torch.equal(plain, again)
