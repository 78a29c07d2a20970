"""Windows per layer (issue 31): read from the layer's module, else from the configuration of the
text model it belongs to, with the layer types honoured; each case against the Hugging Face model
itself (eager attention) on a prompt longer than the window, where a wrong window is 0.3-1.0 off.
"""

import subprocess
import tempfile

import pytest
import torch
from test_architectures import boot_tiny

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter, _readers

WINDOW = 3
LONG = "the quick brown fox jumps over the lazy dog again and again and again"
EXACT_TOL = 1e-5


def _exact_against_hf(model) -> list[int | None]:
    adapter = ModelAdapter(model)
    assert adapter.tokenize(LONG).tokens.shape[1] > 2 * WINDOW
    errors = testing.hf_truth_errors(adapter, testing.hf_twin(model), LONG)
    assert errors["pattern"] <= EXACT_TOL and errors["out"] <= 1e-4, errors
    return [spec.window for spec in adapter.specs]


def test_qwen2_moe_full_layers_past_max_window_layers_do_not_slide():
    # use_sliding_window with max_window_layers=1: layer 0 slides, layer 1 (no sliding_window
    # attribute on its module) attends to everything; the config's window is not every layer's
    model = boot_tiny(
        "Qwen2MoeForCausalLM", use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW
    )
    assert model.original_model.config.layer_types == ["sliding_attention", "full_attention"]
    assert _exact_against_hf(model) == [WINDOW, None]


@pytest.fixture
def no_installs(monkeypatch):
    """TransformerLens 4.3 pip-installs torchvision for a multimodal folder: never here."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a package installer was started: {args}")

    for name in ("check_call", "run", "Popen", "call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    try:
        from transformer_lens.model_bridge.sources.transformers import helpers
    except ImportError:
        return
    if hasattr(helpers, "_ensure_torchvision"):
        monkeypatch.setattr(helpers, "_ensure_torchvision", lambda: False)


def test_mistral_inside_llava_takes_the_text_configs_window(no_installs):
    import transformers

    text = transformers.MistralConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        vocab_size=len(testing.tokenizer()),
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    config = transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.architectures = ["LlavaForConditionalGeneration"]
    assert getattr(config, "sliding_window", None) is None  # the wrapper's config has none
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    hf.set_attn_implementation("eager")
    folder = tempfile.mkdtemp(prefix="tl_dynamics_llava_")
    config.save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    try:
        model = testing.bridge_class().boot_transformers(folder, device="cpu", hf_model=hf)
    except Exception as exc:  # an older TransformerLens without a Llava bridge
        pytest.skip(f"TransformerLens cannot boot Llava here ({type(exc).__name__}: {exc})")
    model.eval()
    assert _exact_against_hf(model) == [WINDOW, WINDOW]


def test_exaone4_global_layers_read_as_full_attention():
    # Exaone 4 keeps sliding_window on its global layers too; is_sliding says which slide
    model = boot_tiny("Exaone4ForCausalLM", sliding_window=WINDOW, sliding_window_pattern=2)
    text = _readers.text_config(model)
    modules = [block.attn.original_component for block in model.blocks]
    assert [m.sliding_window for m in modules] == [WINDOW, WINDOW]
    read = [_readers.window(m, layer, text) for layer, m in enumerate(modules)]
    assert read == [WINDOW, None]
    # the Hugging Face model's own weights: zero past the window on layer 0 only
    twin = testing.hf_twin(model)
    ids = model.to_tokens(LONG)
    with torch.no_grad():
        attentions = twin(ids, output_attentions=True).attentions
    n = ids.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    beyond = (j <= i - WINDOW).expand(1, 4, n, n)
    assert attentions[0][beyond].abs().max() == 0
    assert attentions[1][beyond].abs().min() > 0
    # its global (no-rotary) layer reads q and k before their norms: exact against the twin
    # (issue 43; it was refused before, its global layers firing no cos/sin)
    layers = ModelAdapter(model).attention(LONG)
    for layer in (0, 1):
        got = layers[layer].pattern()
        assert (got - attentions[layer]).abs().max() < 1e-5, layer
