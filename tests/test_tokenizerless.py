"""Bring your own model, any family (issue 40): a Hugging Face folder written by
``save_pretrained`` of the model alone (config and weights, no tokenizer files) loads for every
architecture of the tiny matrix, without a tokenizer (never a stand-in that reads text as
``[0, 0]``), says so once, takes token ids (its logits are the Hugging Face model's), refuses
text by name, and reports with ``--prompt-ids``."""

from __future__ import annotations

import warnings

import pytest
import torch

from tl_dynamics import cli, models, testing
from tl_dynamics._hf_folder import NoTokenizerWarning
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

IDS = torch.tensor([[0, 5, 9, 12, 5, 9, 12]])
LOGIT_TOL = 1e-4  # the bridge against its own Hugging Face model, float32


def bare_folder(root, arch: str):
    """``save_pretrained`` of a tiny random ``arch`` model, nothing else: ``(folder, model)``."""
    import transformers

    config_name, model_name, kwargs = testing.HF_ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=len(testing.tokenizer()), bos_token_id=0, eos_token_id=0, **kwargs
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    folder = root / arch
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("arch", sorted(testing.HF_ARCHS))
def test_a_folder_without_tokenizer_files_loads_without_one(tmp_path, arch):
    folder, hf = bare_folder(tmp_path, arch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = models.load_model(str(folder))
    said = [w for w in seen if issubclass(w.category, NoTokenizerWarning)]
    assert len(said) == 1 and "no tokenizer files" in str(said[0].message), arch
    assert model.tokenizer is None
    ad = ModelAdapter(model)  # the self-check runs on token ids
    with torch.no_grad():
        got = ad.forward(ad.tokenize(IDS))
        want = hf(IDS).logits
    if not ad.is_encoder:
        assert float((got.float() - want).abs().max()) < LOGIT_TOL, arch
    with pytest.raises(TLDynamicsError, match="has no tokenizer: pass a token tensor"):
        ad.tokenize("some text")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_folder_without_tokenizer_reports_with_prompt_ids(tmp_path, capsys, arch):
    folder, _ = bare_folder(tmp_path, arch)
    out = tmp_path / "r.html"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoTokenizerWarning)
        code = cli.main(
            ["report", "--model", str(folder), "--out", str(out), "--prompt", "def f(): pass"]
        )
        err = capsys.readouterr().err
        assert code == 2 and "has no tokenizer" in err and "--prompt-ids" in err
        code = cli.main(
            [
                "report",
                "--model",
                str(folder),
                "--out",
                str(out),
                "--prompt-ids",
                "0 5 9 12 5 9 12",
                "--sections",
                "odds_ratio,trajectories",
            ]
        )
    assert code == 0 and "0 5 9 12 5 9 12" in out.read_text()
