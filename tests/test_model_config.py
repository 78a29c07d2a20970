"""Checks before torch (issue 48): ``--layers``, ``--heads`` and token ids are checked against a
shipped model's or a folder's config file before torch is imported, with the loaded model's own
messages; the sizes read from the file are the loaded model's.

Cost: one subprocess that never imports torch, and a few tiny models loaded."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tl_dynamics import _loading, _model_config, load_model, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

ROOT = Path(__file__).resolve().parent.parent
REFUSED = {  # argv -> the message, as the loaded model says it
    ("report", "--model", "induction-2l", "--layers", "5"): (
        "layer 5 is out of range: this model has 2 layers (valid: 0..1)"
    ),
    ("report", "--model", "induction-2l", "--heads", "L1H4"): (
        "head 4 in layer 1 is out of range: this model has 4 heads per layer (valid: 0..3)"
    ),
    ("report", "--model", "induction-2l", "--prompt-ids", "1 2 64"): (
        "--prompt-ids: token ids 64 are outside this model's vocabulary (valid: 0..63)"
    ),
    ("heads", "--model", "code-2l", "--heads", "9"): (
        "head 9 is out of range: this model has 4 heads per layer (valid: 0..3)"
    ),
    ("stats", "--model", "code-2l", "--layers", "3", "--prompts", "README.md", "--out", "s.safetensors"): (
        "layer 3 is out of range: this model has 2 layers (valid: 0..1)"
    ),
}  # fmt: skip


def test_out_of_range_selections_fail_before_torch_is_imported(tmp_path):
    script = (
        "import contextlib, io, sys\n"
        "from tl_dynamics import cli\n"
        f"for argv, message in {list(REFUSED.items())!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = cli.main(list(argv))\n"
        "    assert code == 2, (argv, code, err.getvalue())\n"
        "    assert err.getvalue().strip() == 'tl-dynamics: error: ' + message, err.getvalue()\n"
        "print(sorted({'torch', 'transformer_lens', 'transformers'} & set(sys.modules)))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("name", ["induction-2l", "code-2l", "regression-2l"])
def test_a_shipped_models_sizes_are_the_loaded_models_and_so_are_the_messages(name):
    adapter = ModelAdapter.of(load_model(name))
    found = _model_config.sizes(name)
    assert (found.n_layers, found.n_heads, found.d_vocab) == (
        adapter.n_layers,
        adapter.n_heads,
        int(adapter.model.cfg.d_vocab),
    )
    for kwargs in (
        {"layers": [adapter.n_layers]},
        {"heads": [(0, adapter.n_heads)]},
        {"head_indices": [adapter.n_heads + 1]},
    ):
        with pytest.raises(TLDynamicsError) as before:
            _model_config.check_selection(name, **kwargs)
        with pytest.raises(TLDynamicsError) as after:
            _loading.loaded_and_checked(name, ("cpu", "auto"), None, **kwargs)
        assert str(before.value) == str(after.value)


@pytest.mark.parametrize("arch", ["gpt2", "gptneo", "llama", "gemma2"])
def test_a_hugging_face_folders_sizes_are_the_loaded_models(arch, tmp_path):
    folder = testing.hf_folder(arch, tmp_path)
    adapter = ModelAdapter.of(load_model(str(folder)))
    found = _model_config.sizes(str(folder))
    assert (found.n_layers, found.n_heads, found.d_vocab) == (
        adapter.n_layers,
        adapter.n_heads,
        int(adapter.model.cfg.d_vocab),
    )


def test_smollm2s_config_states_its_sizes():
    folder = os.environ.get("TL_DYNAMICS_SMOLLM2")
    if not folder or not Path(folder, "config.json").is_file():
        pytest.skip("TL_DYNAMICS_SMOLLM2 names no SmolLM2 folder (make smollm2 builds it)")
    assert _model_config.sizes(folder) == _model_config.Sizes(30, 9, 49152)


def test_what_no_file_states_is_left_to_the_loaded_model(tmp_path):
    assert _model_config.sizes("tiny-random:gpt2") == _model_config.Sizes()
    assert _model_config.sizes(str(tmp_path)) == _model_config.Sizes()  # a folder, no config
    (tmp_path / "config.json").write_text("{not json")
    assert _model_config.sizes(str(tmp_path)) == _model_config.Sizes()
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 3}}')
    assert _model_config.sizes(str(tmp_path)) == _model_config.Sizes(n_layers=3)
    _model_config.check_selection(str(tmp_path), layers=[2], head_indices=[99], token_ids=[10**6])
