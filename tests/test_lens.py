"""The logit lens reads what it shows (issue 48): by default the trajectories' lens is read at the
cells the view shows (the last 8 positions of each prompt at up to 8 points), in blocks of rows
and chunks of the vocabulary; where both the view and the full lens are read, they are equal bit
for bit, on the shipped models and on a random model with a large vocabulary.

Cost: the three shipped models and two tiny random models, a few seconds."""

import functools
import tempfile

import pytest
import torch

from tl_dynamics import testing, trajectories, zoo
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories import _lens

FIELDS = ("rank", "lens_top", "lens_top_logit")


@functools.lru_cache(maxsize=None)
def large_vocab(n_layer: int = 9) -> ModelAdapter:
    """A random GPT-2 of d_model 32 and 50,257 tokens: the lens spans 13 vocabulary chunks."""
    import transformers

    testing.tiny_model("gpt2")  # quiet transformers' loading messages the same way
    folder = tempfile.mkdtemp(prefix="tld_lens_")
    config = transformers.GPT2Config(
        n_layer=n_layer, n_head=2, n_embd=32, n_positions=64, vocab_size=50257,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    return ModelAdapter(testing.bridge_class().boot_transformers(folder).eval())


def shipped(name: str) -> ModelAdapter:
    try:
        return ModelAdapter(zoo.load(name))
    except TLDynamicsError as exc:
        pytest.skip(f"shipped model {name} cannot be used on this host: {exc}")


def padded_batch(ad: ModelAdapter, lengths: tuple[int, ...], vocab: int):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=gen)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    return ad.tokenize(tokens, attention_mask=mask.long())


def assert_view_is_the_full_lens(ad: ModelAdapter, batch, **kwargs) -> trajectories.Trajectory:
    view = trajectories.compute(ad, batch, **kwargs)
    full = trajectories.compute(ad, batch, lens="full", **kwargs)
    cells = view.lens_cells
    assert cells is not None and full.lens_cells is not None
    assert cells.any() and bool((full.lens_cells | ~cells).all())  # full reads every view cell
    for name in FIELDS:
        mine, theirs = getattr(view, name), getattr(full, name)
        assert torch.equal(mine[cells], theirs[cells]), name  # bit for bit
        outside = mine[~cells]
        assert bool((outside == -1).all() if name != "lens_top_logit" else outside.isnan().all())
    for name in ("cos_embed", "dist_embed", "cos_unembed", "dist_unembed", "settling"):
        assert getattr(view, name) is None and getattr(full, name) is not None  # full only
    return view


@pytest.mark.parametrize("name", ["induction-2l", "code-2l", "regression-2l"])
def test_the_view_equals_the_full_lens_on_the_shipped_models(name):
    ad = shipped(name)
    vocab = int(ad.model.cfg.d_vocab)
    assert_view_is_the_full_lens(ad, padded_batch(ad, (20, 5, 13), vocab))


def test_the_view_equals_the_full_lens_on_a_large_vocabulary_over_many_points():
    ad = large_vocab()
    batch = padded_batch(ad, (40, 6, 23, 40), 50257)
    view = assert_view_is_the_full_lens(ad, batch, flattened=True)  # 19 points: 8 shown
    points = _lens.view_points(view.n_points)
    assert view.n_points == 19 and len(points) == 8 and points[0] == 0 and points[-1] == 18
    for row, length in enumerate((40, 6, 23, 40)):
        real = batch.key_valid[row].nonzero().flatten()
        shown = real[-_lens.VIEW_POSITIONS :]
        expect = torch.zeros(view.n_points, batch.tokens.shape[1], dtype=torch.bool)
        expect[torch.tensor(points)[:, None], shown[None]] = True
        assert torch.equal(view.lens_cells[row], expect), row
        assert int(view.lens_cells[row].sum()) == len(points) * min(length, 8)
    html = view.show(0)._repr_html_()
    assert "logit lens, prompt 0" in html and html.count("<tr>") >= len(points)


def test_chunked_rows_are_the_whole_vocabularys_rank_and_top_tokens():
    """``read_rows`` against one product over the whole vocabulary: ranks (the target never
    counted against itself), top ids and logits, with targets in every chunk."""
    ad = large_vocab(2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, ad.d_model, generator=gen)
    targets = torch.randint(0, 50257, (300,), generator=gen)
    targets[:3] = torch.tensor([0, 50256, -1])
    rank, ids, logits = _lens.read_rows(ad, x, targets)
    whole = x @ ad.W_U + ad.b_U
    t = _lens.target_logits(ad, x, targets.clamp_min(0))
    own = whole.gather(1, targets.clamp_min(0)[:, None])[:, 0] > t
    expect = (whole > t[:, None]).sum(-1) - own.long()
    near = ((whole - t[:, None]).abs() < 1e-4).sum(-1)  # another BLAS may round these apart
    assert bool(((rank - torch.where(targets >= 0, expect, -1)).abs() <= near - 1).all())
    assert bool((rank[targets < 0] == -1).all()) and bool((rank[targets >= 0] >= 0).all())
    top_v, top_i = whole.topk(_lens.TOP_K, -1)
    torch.testing.assert_close(logits, top_v, rtol=1e-5, atol=1e-5)
    assert (ids == top_i).float().mean() > 0.99  # the same tokens, up to ties in the last bits
    assert _lens.vocab_chunk(50257, False) < 50257  # the vocabulary went in chunks


def test_lens_options():
    ad = ModelAdapter(testing.tiny_model("gpt2"))
    off = trajectories.compute(ad, "a = 1", lens=False)
    assert off.rank is None and off.lens_top is None and "lens=False" in off.lens_note
    view = trajectories.compute(ad, "def f(x): return x + 1")
    assert not view.stats.has_lens and "lens='full'" in view.stats.meta["lens_note"]
    with pytest.raises(TLDynamicsError, match="mean_rank needs .*lens='full'"):
        view.stats.mean_rank()
    with pytest.raises(TLDynamicsError, match="cos_unembed needs .*lens='full'"):
        view.stats.mean("cos_unembed")
    assert trajectories.compute(ad, "a = 1", lens=True).stats.has_lens
    with pytest.raises(TLDynamicsError, match="lens must be 'view'"):
        trajectories.compute(ad, "a = 1", lens="some")
