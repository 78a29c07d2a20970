"""``--device`` and ``--dtype`` on every command, and ``load_model(device=, dtype=)`` (issue 22):
one parser (``tl_dynamics.devices``), every bad value refused before a model loads, and a
bfloat16 model from the command line is the same model the half-precision tests cover
(``tiny_model(arch).to(dtype)``)."""

import json
import re

import pytest
import torch

from tl_dynamics import TLDynamicsError, cli, devices, load_model, models, testing
from tl_dynamics.scale import _distributed
from tl_dynamics.scale import _run

NO_CUDA = f"torch sees no CUDA device here (torch {torch.__version__}"


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model gets loaded: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"model {args!r} was loaded before the inputs were checked")

    monkeypatch.setattr(models, "resolve", refuse)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


COMMANDS = {
    "report": ["report"],
    "heads": ["heads"],
    "stats": ["stats", "--prompts", "corpus.txt", "--out", "s.safetensors"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    "option, value, message",
    [
        (
            "--device",
            "gpu",
            "--device 'gpu': valid are auto, cpu, cuda, cuda:N (N: a CUDA device index, from 0)",
        ),
        ("--device", "cuda:x", "--device 'cuda:x': valid are auto, cpu, cuda, cuda:N"),
        ("--dtype", "fp8", "--dtype 'fp8': valid are auto, float32, bfloat16, float16"),
        ("--dtype", "float64", "--dtype 'float64': valid are auto, float32, bfloat16, float16"),
    ],
)
def test_bad_values_are_refused_before_loading(
    command, option, value, message, capsys, no_loading, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("one prompt\n")  # a real corpus: only the option is wrong
    code, _, err = run(capsys, *COMMANDS[command], option, value)
    assert code == 2 and f"tl-dynamics: error: {message}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_where_there_is_none_is_refused_before_loading(
    command, value, capsys, no_loading, tmp_path, monkeypatch
):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("one prompt\n")  # a real corpus: only the option is wrong
    code, _, err = run(capsys, *COMMANDS[command], "--device", value)
    assert code == 2 and f"--device {value!r}: {NO_CUDA}" in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cuda_index_past_the_last_device_is_refused(
    command, capsys, no_loading, tmp_path, monkeypatch
):
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("one prompt\n")  # a real corpus: only the option is wrong
    code, _, err = run(capsys, *COMMANDS[command], "--device", "cuda:2")
    assert (
        code == 2 and "--device 'cuda:2': this machine has 2 CUDA devices (cuda:0 to cuda:1)" in err
    ), err


def test_resolve_device_and_dtype():
    cpu = torch.device("cpu")
    assert devices.resolve_device("cpu") == cpu
    assert devices.resolve_device("auto") == (
        torch.device("cuda", 0) if torch.cuda.is_available() else cpu
    )
    assert devices.resolve_device(None) == devices.resolve_device("auto")
    assert devices.resolve_dtype("auto") is None and devices.resolve_dtype(None) is None
    assert devices.resolve_dtype("float16") is torch.float16
    assert devices.resolve_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(TLDynamicsError, match=r"^dtype torch.float64: valid are auto"):
        devices.resolve_dtype(torch.float64)
    with pytest.raises(TLDynamicsError, match=r"^device 'tpu': valid are"):
        load_model("tiny-random:gpt2", device="tpu")


def test_cuda_checks_with_a_pretend_device_count(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    assert devices.resolve_device("cuda") == torch.device("cuda", 0)
    assert devices.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert devices.resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(TLDynamicsError, match=r"this machine has 1 CUDA device \(cuda:0\)$"):
        devices.resolve_device("cuda:1")


@pytest.mark.parametrize(
    "fields, want",
    [
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "float16"}, torch.float16),
        ({"dtype": "torch.bfloat16"}, torch.bfloat16),
        ({}, torch.float32),
        ({"torch_dtype": "float64"}, torch.float32),
        ({"torch_dtype": None}, torch.float32),
    ],
)
def test_config_dtype(fields, want):
    assert devices.config_dtype(fields) is want


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_load_model_dtype_is_the_cast_the_half_precision_tests_cover(arch):
    """``load_model(dtype=)`` on a tiny model gives exactly ``tiny_model(arch).to(dtype)``."""
    got = load_model(f"tiny-random:{arch}", device="cpu", dtype="bfloat16")
    want = testing.tiny_model(arch).to(torch.bfloat16)
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state) == sorted(want_state)
    for key, value in want_state.items():
        assert got_state[key].dtype == value.dtype, key
        assert torch.equal(got_state[key], value), key
    assert next(load_model(f"tiny-random:{arch}").parameters()).dtype == torch.float32  # auto


def _bf16_folder(tmp_path):
    folder = testing.hf_folder("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_hf_folder_auto_dtype_is_the_configs_and_loads_straight_into_it(tmp_path):
    folder = _bf16_folder(tmp_path)
    auto = load_model(str(folder))
    assert {p.dtype for p in auto.parameters()} == {torch.bfloat16}
    forced = load_model(str(folder), dtype="float32")
    assert {p.dtype for p in forced.parameters()} == {torch.float32}
    # loading in bfloat16 rounds the saved float32 weights as .to(bfloat16) does
    cast = forced.to(torch.bfloat16).state_dict()
    for key, value in auto.state_dict().items():
        assert torch.equal(value, cast[key]), key


def test_report_builds_in_bfloat16_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "r.html"
    code, stdout, err = run(
        capsys,
        "report",
        "--model",
        "tiny-random:llama",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--threads",
        "1",
        "--sections",
        "odds_ratio,trajectories",
    )
    assert code == 0, err
    html = out.read_text()
    assert "cpu, bfloat16" in html  # the page's "runs on" row
    assert "This section failed" not in html and "Not shown for this model" not in html
    assert stdout.startswith("wrote ")


def test_heads_runs_in_bfloat16_from_the_command_line(capsys):
    code, stdout, err = run(
        capsys,
        "heads",
        "--model",
        "tiny-random:gpt2",
        "--dtype",
        "bfloat16",
        "--no-causal",
        "--n-seq",
        "2",
        "--seq-len",
        "8",
    )
    assert code == 0, err
    assert stdout.startswith("Head atlas of tiny-random:gpt2")


def test_stats_runs_in_bfloat16_and_matches_the_library_on_the_cast_model(tmp_path, capsys):
    from tl_dynamics import scale

    corpus = ["def f(x): return x + 1", "import os", "a = b * 3", "print(a)"]
    (tmp_path / "c.txt").write_text("\n".join(corpus) + "\n")
    out = tmp_path / "s.safetensors"
    code, _, err = run(
        capsys,
        "stats",
        "--model",
        "tiny-random:gpt2",
        "--prompts",
        str(tmp_path / "c.txt"),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--no-progress",
    )
    assert code == 0, err
    want = scale.run_stats(
        testing.tiny_model("gpt2").to(torch.bfloat16),
        corpus,
        batch_size=2,
        progress=False,
        model_name="tiny-random:gpt2",
    )
    assert out.read_bytes() == _run.stats_bytes(want)


@pytest.mark.parametrize(
    "request_, world, local, count, want",
    [
        ("auto", 1, 0, 0, ("cpu", "none")),
        ("auto", 2, 1, 0, ("cpu", "gloo")),
        ("cpu", 2, 1, 2, ("cpu", "gloo")),
        ("auto", 2, 1, 2, ("cuda:1", "nccl")),
        ("cuda", 4, 3, 4, ("cuda:3", "nccl")),
    ],
)
def test_torchrun_plan_each_rank_its_own_gpu_with_nccl(request_, world, local, count, want):
    device, backend = _distributed.plan(request_, world, local, count)
    assert (str(device), backend) == want


def test_torchrun_plan_refuses_more_ranks_than_gpus_and_cuda_without_one(monkeypatch):
    with pytest.raises(
        TLDynamicsError,
        match=r"^--device 'cuda' under torchrun: LOCAL_RANK 1 "
        r"has no GPU of its own \(1 CUDA device here\)",
    ):
        _distributed.plan("cuda", 2, 1, 1, "--device")
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    with pytest.raises(TLDynamicsError, match="^" + re.escape(f"--device 'cuda': {NO_CUDA}")):
        _distributed.plan("cuda", 2, 0, 0, "--device")


def test_transformerlens_checkpoint_takes_its_configs_dtype_or_the_asked_one(tmp_path):
    """A TransformerLens checkpoint is built in float32 and cast (``model.to(dtype)``, as the
    half-precision tests do): ``dtype`` in its config is the ``auto`` choice."""
    import shutil

    from test_cli import ZOO

    def checkpoint(name, dtype=None):
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((ZOO / "induction-2l" / "config.json").read_text())
        if dtype:
            config["dtype"] = dtype
        (folder / "tl_config.json").write_text(json.dumps(config))
        shutil.copy(ZOO / "induction-2l" / "model.safetensors", folder / "model.safetensors")
        return str(folder)

    plain, half = checkpoint("plain"), checkpoint("half", "torch.bfloat16")
    assert {p.dtype for p in load_model(plain).parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(half).parameters()} == {torch.bfloat16}
    asked = load_model(plain, dtype="float16")
    assert {p.dtype for p in asked.parameters()} == {torch.float16}
    want = load_model("induction-2l").to(torch.float16).state_dict()
    for key, value in asked.state_dict().items():
        if key in want and value.dtype.is_floating_point:
            assert torch.equal(value, want[key]), key
