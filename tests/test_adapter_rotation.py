"""The adapter's one rotation per layer against the model itself.

On every rotary architecture of the exactness matrix (bridges raw and compat, native, and the
HookedTransformer configs in the TransformerLens 3.x environment): ``adapter.rotation(l)``
applied at ``adapter.positions(batch)`` to the unrotated query ``x W_Q + b_Q`` (normalised on
qk-norm layers) gives the query the model itself rotated (its ``hook_rot_q``), on a single
prompt and on left- and right-padded batches. Where the model fires no rotated query (native),
the rotated queries and keys must give the model's own pattern.
"""

import dataclasses

import pytest
import torch

from helpers import HAS_HOOKED, adapter_for, requires_hooked
from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter, Rotation

# fp32: the rotated x W_Q + b_Q and the model's own rotated query are the same ~64-term sums in
# another order (relative errors seen <= 2e-7).
EXACT_RTOL = 1e-5
PROMPTS = [(testing.PROMPTS[0], "right"), (testing.PROMPTS, "right"), (testing.PROMPTS, "left")]
ROTARY_HF = [a for a in testing.HF_ARCHS if a not in ("gpt2", "gptneo", "opt", "bloom", "bert")]
MATRIX = [(arch, compat) for arch in ROTARY_HF for compat in (False, True)]
ROTARY_NATIVE = [
    v
    for v, cfg in testing.NATIVE_VARIANTS.items()
    if cfg.get("positional_embedding_type") == "rotary"
]
ROTARY_HOOKED = [
    v
    for v, cfg in testing.HOOKED_VARIANTS.items()
    if cfg.get("positional_embedding_type") == "rotary"
]


def _own_rotated_queries(adapter: ModelAdapter, batch, layer: int):
    """The model's own hook_rot_q and the adapter's captured attention input, one forward pass."""
    got = {}
    la = {}
    keep = [("rot_q", layer, lambda t: got.__setitem__("rot_q", t.detach().float()))]
    with adapter.hooks(keep if adapter.hook_name("rot_q", layer) is not None else []):
        with adapter.capture(
            lambda a: la.__setitem__("la", a), [layer], reference=True, inputs=True, batch=batch
        ):
            adapter.forward(batch)
    return got.get("rot_q"), la["la"]


def _relative_error(adapter: ModelAdapter, prompt, side: str) -> float:
    worst = 0.0
    batch = adapter.tokenize(prompt, padding_side=side)
    valid = batch.key_valid
    for layer in range(adapter.n_layers):
        rotation = adapter.rotation(layer)
        assert isinstance(rotation, Rotation), (adapter.info.architecture, layer)
        own, la = _own_rotated_queries(adapter, batch, layer)
        q = adapter.unrotated_queries(layer, la.reference["x"])
        mine = rotation.rotate(q, adapter.positions(batch))
        if own is None:  # no rotated-query hook: the model's own pattern is the reference
            k = torch.einsum("bpm,hmd->bphd", la.reference["x"], adapter.W_K(layer)) + adapter.b_K(
                layer
            )
            mine_k = rotation.rotate(k, adapter.positions(batch))
            pattern = dataclasses.replace(la, q=mine, k=mine_k).pattern()
            rows = la.query_valid[:, None, :, None]
            worst = max(worst, ((pattern - la.reference["pattern"]).abs() * rows).max().item())
            continue
        own = own.reshape(q.shape)
        err = (mine - own)[valid].abs().max() / own[valid].abs().max()
        worst = max(worst, err.item())
    return worst


@pytest.mark.parametrize("prompt,side", PROMPTS, ids=["single", "batch-right", "batch-left"])
@pytest.mark.parametrize(
    "arch,compat", MATRIX, ids=[f"{a}-{'compat' if c else 'raw'}" for a, c in MATRIX]
)
def test_rotation_reproduces_the_bridges_own_rotated_query(arch, compat, prompt, side):
    assert _relative_error(adapter_for(arch, compat), prompt, side) <= EXACT_RTOL


@pytest.mark.skipif(HAS_HOOKED or not ROTARY_NATIVE, reason="boot_native is TransformerLens 4.x")
@pytest.mark.parametrize("variant", ROTARY_NATIVE)
def test_rotation_reproduces_the_native_models_own_pattern(variant):
    adapter = adapter_for(variant)
    assert adapter.rotation(0).table is not None  # its own cached tables, used as they are
    for prompt, side in PROMPTS:
        assert _relative_error(adapter, prompt, side) <= EXACT_RTOL


@requires_hooked
@pytest.mark.parametrize("variant", ROTARY_HOOKED)
def test_rotation_reproduces_hooked_transformers_own_rotated_query(variant):
    adapter = adapter_for(variant)
    for prompt, side in PROMPTS:
        if adapter.is_encoder and side == "left":
            continue
        assert _relative_error(adapter, prompt, side) <= EXACT_RTOL


def test_non_rotary_layers_have_no_rotation_and_positions_skip_left_padding():
    adapter = adapter_for("gpt2")
    assert [adapter.rotation(layer) for layer in range(adapter.n_layers)] == [None, None]
    batch = adapter.tokenize(list(testing.PROMPTS), padding_side="left")
    positions = adapter.positions(batch)
    for row in range(positions.shape[0]):
        real = batch.key_valid[row]
        assert positions[row][real].tolist() == list(range(int(real.sum())))
    assert torch.equal(adapter.positions(batch), adapter.positions(batch.key_valid))


def test_rotation_algebra():
    """``R_a R_b^T = m^2 R_(a-b)``; a negative position is the transpose; pass-through dims."""
    adapter = adapter_for("stablelm")  # partial rotary: 4 of 16 dims
    rotation = adapter.rotation(1)
    x = torch.randn(5, adapter.d_head, generator=torch.Generator().manual_seed(0))
    p = torch.tensor([0, 1, 7, 20, 63])
    back = rotation.rotate(rotation.rotate(x, p), p, transpose=True)
    assert torch.allclose(back, x * rotation.magnitude**2, atol=1e-5)
    assert torch.allclose(rotation.rotate(x, -p), rotation.rotate(x, p, transpose=True), atol=1e-6)
    assert torch.equal(rotation.rotate(x, p)[:, rotation.rotary_dim :], x[:, rotation.rotary_dim :])
    R = lambda d: rotation.matrix(d, adapter.d_head)  # noqa: E731
    assert torch.allclose(R(9) @ R(4).T, R(5) * rotation.magnitude**2, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rot", [16, 4])  # full and partial rotary of a 16-wide head
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotary_apply_is_the_one_expression_bit_for_bit(layout, rot, transpose, dtype):
    """``_rotary.apply`` writes each half of a pair in place, a block at a time; it is the same
    products and sums as ``x cos + turned(x) sin``, bit for bit, on parts that share the tables
    (QK attribution's ``[part, batch, pos, head, d]``) and on tables with their own leading axis;
    with a graph to record it takes the one expression (``out=`` records none)."""
    from tl_dynamics.adapter import _rotary

    gen = torch.Generator().manual_seed(0)
    angles = torch.randn(3, 7, 1, rot // 2, generator=gen)
    cos = _rotary.layout_order(torch.cos(angles), layout)
    sin = _rotary.layout_order(torch.sin(angles), layout)
    for x, c, s in (
        (torch.randn(2000, 3, 7, 2, 16, generator=gen), cos, sin),  # many blocks, shared tables
        (torch.randn(3, 7, 2, 16, generator=gen), cos[0], sin[0]),
        (torch.randn(3, 7, 1, 16, generator=gen), cos, sin),  # tables with their own leading axis
    ):
        x = x.to(dtype)
        got = _rotary.apply(x, c, s, layout, transpose)
        s_t = -s if transpose else s
        want = _rotary._apply_differentiable(x, c.to(dtype), s_t.to(dtype), layout)
        assert got.shape == want.shape and torch.equal(got, want)
    x = torch.randn(4, 7, 1, 16, requires_grad=True)
    _rotary.apply(x, cos[0], sin[0], layout, transpose).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rotation_is_read_once_and_cached_per_layer():
    adapter = ModelAdapter(testing.cached_model("llama"))
    assert adapter.rotation(0) is adapter.rotation(0)
    assert adapter.rotation(1) is not adapter.rotation(0)


def test_reading_a_rotation_inside_an_attached_analysis_leaves_it_intact():
    """The probe pass that reads a rotation is invisible to collectors and patches around it."""
    model = testing.tiny_model("llama")  # a fresh model: no rotation read yet
    outer, inner = ModelAdapter(model), ModelAdapter(model)
    batch = outer.tokenize(testing.PROMPTS[0])
    seen, fired = [], []
    with (
        outer.capture(seen.append, layers=[0], batch=batch),
        outer.patch([("resid_pre", 0, lambda t: fired.append(1) or t * 0)]),
    ):
        assert inner.rotation(0) is not None  # runs a probe forward pass on the same model
        assert seen == [] and fired == []
        own, la = _own_rotated_queries(inner, batch, 0)
    assert len(seen) == 1 and len(fired) == 1  # only the real forward pass was seen / patched
