"""Host internals read by meaning (``adapter/_readers``) and the self-check at load
(``adapter/_selfcheck``), issue 31: a renamed or missing attribute is refused by name (never an
``AttributeError``, never a silent number), GPT-J's old and new scale names read to the same
number, and a planted wrong reading is caught by the self-check in every tiny family."""

import dataclasses
import math

import pytest
import torch
from helpers import HAS_HOOKED

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter, _core, _readers, _selfcheck
from tl_dynamics.compat import tl_major_version
from tl_dynamics.errors import TLDynamicsError

TINY = (
    list(testing.HF_ARCHS)
    + (list(testing.HOOKED_VARIANTS) if HAS_HOOKED else [])
    + (list(testing.NATIVE_VARIANTS) if tl_major_version() >= 4 else [])
)
READ_ON = ["gpt2", "gptj", "llama", "gptneo", "bloom", "bert", "gemma2", "qwen2-sliding"]
READ_ON += ["local", "softcap"] if HAS_HOOKED else ["native", "native-rotary-gqa"]


def _reads(monkeypatch, arch: str) -> list[tuple[str, str]]:
    """Every (class name, attribute) the readers look up while ``arch`` is adapted."""
    seen: dict[tuple[str, str], None] = {}
    lookup = _readers.lookup

    def recording(owner, path):
        if owner is not None:
            seen[(type(owner).__name__, path)] = None
        return lookup(owner, path)

    monkeypatch.setattr(_readers, "lookup", recording)
    ModelAdapter(testing.cached_model(arch), verify=False)
    monkeypatch.setattr(_readers, "lookup", lookup)
    return list(seen)


@pytest.mark.parametrize("arch", READ_ON)
def test_each_attribute_read_renamed_is_refused_or_changes_no_number(monkeypatch, arch):
    model = testing.cached_model(arch)
    truth = ModelAdapter(model).specs
    reads = _reads(monkeypatch, arch)
    assert reads, arch
    lookup, refused = _readers.lookup, []
    for hidden in reads:

        def renamed(owner, path, hidden=hidden):
            if owner is not None and (type(owner).__name__, path) == hidden:
                return lookup(owner, "tl_dynamics_renamed_" + path)  # absent under this name
            return lookup(owner, path)

        monkeypatch.setattr(_readers, "lookup", renamed)
        try:
            specs = ModelAdapter(model).specs  # the self-check runs where the reading changed
        except TLDynamicsError as exc:
            refused.append(hidden)
            message = str(exc)
            assert hidden[0] in message or "is refused" in message, (hidden, message)
            if "is refused" not in message:  # a reader's refusal: class, attribute, versions
                assert hidden[1].split(".")[0] in message
                assert "Installed: transformers" in message and "TransformerLens" in message
                assert "the tests ran on transformers" in message
        else:  # an attribute whose absence has a meaning: the very same numbers
            assert specs == truth, hidden
        finally:
            monkeypatch.setattr(_readers, "lookup", lookup)
    assert refused, reads  # every family reads at least one number it cannot do without


def test_gptj_scale_read_by_meaning_under_the_old_and_the_new_name(monkeypatch):
    model = testing.cached_model("gptj")
    attn = [block.attn.original_component for block in model.blocks]
    d_head = int(model.cfg.d_head)
    new = [spec.scale for spec in ModelAdapter(model).specs]
    assert new == pytest.approx([d_head**-0.5] * len(attn), rel=1e-7)
    for module in attn:  # transformers < 5.24: scale_attn, a divisor
        if "scaling" in vars(module):
            monkeypatch.delattr(module, "scaling")
        monkeypatch.setattr(module, "scale_attn", torch.tensor(math.sqrt(d_head)), raising=False)
    assert [spec.scale for spec in ModelAdapter(model).specs] == pytest.approx(new, rel=1e-7)
    for module in attn:  # a divisor under the multiplier's name: refused, not read as 4.0
        monkeypatch.setattr(module, "scaling", math.sqrt(d_head), raising=False)
    with pytest.raises(TLDynamicsError, match="GPTJAttention.scaling: .*its meaning changed"):
        ModelAdapter(model)


def _planted(spec, what: str):
    if not spec.is_attention:
        return spec
    if what == "scale":
        return dataclasses.replace(spec, scale=spec.scale * 1.5)
    if what == "window":
        return dataclasses.replace(spec, window=2)
    return dataclasses.replace(spec, rotary_base=spec.rotary_base * 3.0)


@pytest.mark.parametrize("what", ["scale", "window", "base"])
@pytest.mark.parametrize("arch", TINY)
def test_a_planted_wrong_reading_is_caught_by_the_self_check(monkeypatch, arch, what):
    model = testing.cached_model(arch)
    specs = ModelAdapter(model).specs
    uses_base = [s.layer for s in specs if s.rotary == "interleaved" and s.rotary_base]
    if what == "base" and not uses_base:
        pytest.skip(f"{arch}: no layer reads a rotary base (its rotation comes from its hooks)")
    if what == "base" and arch in testing.NATIVE_VARIANTS:
        pytest.skip(f"{arch}: rotated with the module's own cos/sin tables, not from the base")
    layer_specs = _core.layer_specs
    monkeypatch.setattr(
        _core, "layer_specs", lambda m, info: [_planted(s, what) for s in layer_specs(m, info)]
    )
    first = (
        uses_base[0] if what == "base" else ModelAdapter(model, verify=False).attention_layers[0]
    )
    with pytest.raises(TLDynamicsError, match=rf"layer {first} of .* is refused"):
        ModelAdapter(model)
    monkeypatch.setattr(_core, "layer_specs", layer_specs)
    ModelAdapter(model)  # the true reading passes again


@pytest.mark.parametrize(
    "reader,value,arch",
    [("scale", 0.5, "llama"), ("window", 2, "llama"), ("rotary_base", 30000.0, "gptj")],
)
def test_a_patched_reader_is_caught(monkeypatch, reader, value, arch):
    model = testing.cached_model(arch)
    monkeypatch.setattr(_readers, reader, lambda *args, **kwargs: value)
    with pytest.raises(TLDynamicsError, match="layer 0 of .* is refused"):
        ModelAdapter(model)
    ModelAdapter(model, verify=False)  # documented: skips the check


def test_self_check_probes_once_per_model_and_weights(monkeypatch):
    model = testing.tiny_model("llama")
    calls = []
    probe_pass = _selfcheck.probe_pass

    def counting(adapter, tokens, *args, **kwargs):
        calls.append(tokens.shape)
        return probe_pass(adapter, tokens, *args, **kwargs)

    monkeypatch.setattr(_selfcheck, "probe_pass", counting)
    for _ in range(3):
        ModelAdapter(model)
    assert calls == [torch.Size([1, _selfcheck.PROBE_TOKENS])]
    with torch.no_grad():
        next(iter(model.parameters())).mul_(1.01)  # weights edited in place
    ModelAdapter(model)
    assert len(calls) == 2


def _hooks_on(model) -> tuple[int, int]:
    """(TransformerLens hook functions, torch hooks) on every module of ``model``."""
    lens = sum(len(point.fwd_hooks) for point in model.hook_dict.values())
    torch_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return lens, torch_hooks


def _counting(forward, into: list, what, after: bool):
    """``forward``, noting ``what`` in ``into`` before it runs (or once it returned)."""

    def run(*args, **kwargs):
        if not after:
            into.append(what)
        out = forward(*args, **kwargs)
        if after:
            into.append(what)
        return out

    return run


@pytest.mark.parametrize("arch", ["gpt2", "llama"] + (["local"] if HAS_HOOKED else []))
def test_self_check_is_one_forward_stopped_after_the_last_attention_layer(arch):
    """One pass of 8 tokens serves the check and the rotations; the blocks after the last
    attention layer's attention, the final norm and the unembedding never run; no hook is left."""
    model = testing.tiny_model(arch)
    with torch.no_grad():  # TransformerLens 4.x wires hooks of its own at the first forward
        model(_selfcheck.probe_tokens(int(model.cfg.d_vocab), 8))
    before = _hooks_on(model)
    passes, ran = [], []
    last = model.blocks[len(model.blocks) - 1]
    # counted by their forward methods: the probe pass hides the user's own hooks (issue 40)
    watched = [(model, passes, 1, False), (last.attn, ran, "attn", True)]
    watched += [(model.unembed, ran, "unembed", False)]
    mlp = getattr(last, "mlp", None)
    if mlp is not None:
        watched.append((mlp, ran, "mlp", False))
    for module, into, what, after in watched:
        vars(module)["forward"] = _counting(module.forward, into, what, after)
    try:
        adapter = ModelAdapter(model)
        assert passes == [1] and ran == ["attn"], (passes, ran)
        rotations = [adapter.rotation(layer) for layer in adapter.attention_layers]
        assert passes == [1], "the rotations were read from the self-check's pass"
    finally:
        for module, *_ in watched:
            vars(module).pop("forward")
    assert _hooks_on(model) == before
    if arch == "llama":
        assert all(r is not None and r.rotary_dim > 0 for r in rotations)
        fresh = ModelAdapter(model, verify=False)  # read from a probe pass of its own
        for layer, mine in zip(adapter.attention_layers, rotations):
            theirs = fresh.rotation(layer)
            assert (mine.layout, mine.rotary_dim) == (theirs.layout, theirs.rotary_dim)
            assert torch.equal(mine.inv_freq, theirs.inv_freq)
        assert _hooks_on(model) == before


def test_self_check_stands_by_while_an_analysis_is_attached(monkeypatch):
    from tl_dynamics.collect import Collector

    class Passes(Collector):
        points = (("resid_post", 0),)
        seen = 0

        def on_layer(self, state):
            Passes.seen += 1

    model = testing.tiny_model("gpt2")
    adapter = ModelAdapter(model)
    with torch.no_grad():
        next(iter(model.parameters())).mul_(1.01)  # would be probed again
    with adapter.collecting(Passes()):
        ModelAdapter(model)  # the attached collector sees no probe pass
    assert Passes.seen == 0
    ModelAdapter(model)  # detached: probed now
    assert Passes.seen == 0


@pytest.mark.parametrize("arch", ["llama"] + (["rotary"] if HAS_HOOKED else []))
def test_a_stopped_probe_pass_inside_an_attached_analysis_leaves_it_intact(arch):
    """A rotation read while a collector is attached runs the probe pass, stopped early: the
    attached collector sees neither it nor a pass left unfinished, and collects the next pass."""
    from tl_dynamics.collect import Collector

    class Passes(Collector):
        points = (("resid_post", 1),)

        def __init__(self):
            self.starts, self.seen = 0, 0

        def start_pass(self, batch):
            self.starts += 1

        def on_layer(self, state):
            self.seen += 1

    adapter = ModelAdapter(testing.tiny_model(arch), verify=False)
    passes, seen = Passes(), []
    with adapter.collecting(passes):
        with adapter.capture(lambda la: seen.append(la.layer), layers=[1], inputs=True):
            _ = adapter.forward(adapter.tokenize("a b c"))  # the rotation read ran before it
    assert (passes.starts, passes.seen, seen) == (1, 1, [1])
    assert adapter.rotation(1) is not None
