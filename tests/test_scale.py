"""Dataset scale: exact sums, the statistics file, and byte-identical results for one process,
torchrun (gloo, 2 processes) and an interrupted-then-resumed run (Ray: tests/test_scale_ray.py)."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tl_dynamics import cli, odds_ratio, scale, testing
from tl_dynamics import trajectories as T
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.collect import ExactSum

from helpers import requires_hooked
from tl_dynamics.scale import _run

NAME = "tiny-random:gpt2"
CORPUS = [
    f"def f{i}(x):\n    return x * {i} + {i % 7}" if i % 3 else f"import os  # {i}"
    for i in range(22)
]
BATCH = 4


@pytest.fixture(scope="module")
def model():
    return testing.cached_model("gpt2")


def run(model, prompts, out=None, **kw):
    kw.setdefault("progress", False)
    return scale.run_stats(model, prompts, out, batch_size=BATCH, model_name=NAME, **kw)


@pytest.fixture(scope="module")
def whole(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "stats.safetensors"
    run(model, CORPUS, path)
    return path


# ---------------------------------------------------------------------- exact sums
def test_exact_sums_are_canonical_compact_and_correctly_rounded():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((9, 6)) * 10.0 ** rng.integers(-30, 30, size=(9, 6))
    xs[2, 0], xs[3, 0] = 5e-324, -1e300  # a subnormal and a huge value in one column
    parts = [ExactSum.of(torch.tensor(x)) for x in xs]
    order = list(range(9))
    random.Random(1).shuffle(order)
    left = functools.reduce(lambda a, b: a + b, parts)
    shuffled = ExactSum.total([parts[i] for i in order])
    assert left == shuffled and left.limbs.dtype == np.int64
    assert np.array_equal(left.limbs, shuffled.limbs) and left.exponent == shuffled.exponent
    for j in range(6):
        assert left.value()[j] == math.fsum(xs[:, j].tolist())
    assert left + ExactSum.zeros([6]) == left  # the empty sum is the identity
    assert ExactSum.from_arrays(left.arrays()) == left
    # a 33 x 4,096 array of ordinary values stays a few limbs deep (not Python big integers)
    big = ExactSum.of(torch.randn(33, 4096, dtype=torch.float64))
    assert big.limbs.shape[0] <= 4 and sum(a.nbytes for a in big.arrays().values()) < 5e6
    special = ExactSum.of(
        torch.tensor([math.inf, 1.0, math.nan], dtype=torch.float64)
    ) + ExactSum.of(torch.tensor([-math.inf, math.inf, 2.0], dtype=torch.float64))
    v = special.value()
    assert math.isnan(v[0]) and v[1] == math.inf and math.isnan(v[2])


def test_weighted_exact_sums_are_exact_up_to_the_weights_bound():
    """``ExactSum.weighted`` (the bootstrap replicates) against exact rational arithmetic, with
    column sums of the weights just under their bound (2**30) and values of both signs from
    subnormal to 1e298: one limb more than the input's holds every carry, and the result is
    canonical (equal to the same values summed by ``ExactSum.of``)."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5)) * 10.0 ** rng.integers(-300, 290, size=(3, 5))
    x[0, 0], x[1, 1], x[2, 2] = 5e-324, -1.7e298, 0.0
    w = np.array([[2**29 - 1, 0, 7], [2**29, 1, 0], [0, 3, 2**29 + 2**28]])
    got = ExactSum.of(torch.tensor(x)).weighted(w)
    assert got.limbs.shape[0] <= ExactSum.of(torch.tensor(x)).limbs.shape[0] + 1
    for c in range(w.shape[1]):
        exact = [
            sum(Fraction(int(w[n, c])) * Fraction(x[n, j]) for n in range(3)) for j in range(5)
        ]
        assert got.value()[c].tolist() == [float(v) for v in exact]  # rounded once, correctly
    again = got + ExactSum.zeros(got.shape)  # canonical: forming it again changes no limb
    assert again.exponent == got.exponent and np.array_equal(again.limbs, got.limbs)


def test_corrupt_exact_arrays_are_refused():
    good = ExactSum.of(torch.tensor([1.5, -2.25], dtype=torch.float64)).arrays()
    bad = dict(good, limbs=np.concatenate([good["limbs"], np.zeros_like(good["limbs"])]))
    with pytest.raises(TLDynamicsError, match="not in canonical form"):
        ExactSum.from_arrays(bad)
    with pytest.raises(TLDynamicsError, match="not an exact sum"):
        ExactSum.from_arrays(
            {"limbs": good["limbs"].astype(np.float64), "exponent": good["exponent"]}
        )


def test_head_stats_merge_exactly_in_any_order(model):
    def collect(prompts):
        ad = odds_ratio.compute(model, prompts[:BATCH], keep_tensors=False).stats
        for i in range(BATCH, len(prompts), BATCH):
            ad = ad.merge(
                odds_ratio.compute(model, prompts[i : i + BATCH], keep_tensors=False).stats
            )
        return ad

    full = collect(CORPUS[:12])
    a, b = collect(CORPUS[:8]), collect(CORPUS[8:12])
    assert b.merge(a).exact == full.exact == a.merge(b).exact
    assert b.merge(a).n_prompts == 12
    np.testing.assert_array_equal(b.merge(a).sums["var_r"], full.sums["var_r"])
    one = odds_ratio.compute(model, CORPUS[:BATCH], keep_tensors=False).stats
    other = odds_ratio.compute(model, CORPUS[:BATCH], layers=0, keep_tensors=False).stats
    with pytest.raises(TLDynamicsError, match=r"computed differently: they differ in \['layers'"):
        one.merge(other)


def test_empty_stream_is_the_merge_identity(model):
    empty = T.stream(model, [], progress=False)
    some = T.stream(model, CORPUS[:4], batch_size=BATCH, progress=False)
    assert empty.n_prompts == 0 and empty.merge(some) == some and some.merge(empty) == some


# ---------------------------------------------------------------------- the file
def test_statistics_are_the_analyses_own(model, whole):
    stats = scale.load_stats(whole)
    assert stats.n_prompts == len(CORPUS) and stats.analyses == ("odds_ratio", "trajectories")
    assert stats.trajectories == T.stream(model, CORPUS, batch_size=BATCH, progress=False)
    with odds_ratio.attach(model) as collector:
        for i in range(0, len(CORPUS), BATCH):
            collector.forward(CORPUS[i : i + BATCH])
    assert collector.result().stats.exact == stats.odds_ratio.exact


def test_save_load_merge_round_trip(model, whole, tmp_path):
    data = whole.read_bytes()
    loaded = scale.load_stats(whole)
    assert _run.stats_bytes(loaded) == data
    assert scale.save_stats(loaded, tmp_path / "again.safetensors").read_bytes() == data
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    fields = json.loads(header["tl_dynamics_stats"])
    assert fields["model"] == NAME and fields["n_prompts"] == len(CORPUS)
    assert {"settings", "prompts_hash", "analyses"} <= set(fields)
    assert not {"time", "world_size", "workers"} & set(fields)
    # halves split at a batch boundary merge to the very same bytes, in either order
    first = run(model, CORPUS[:8], tmp_path / "a.safetensors")
    second = run(model, CORPUS[8:], tmp_path / "b.safetensors")
    merged = scale.merge_stats(tmp_path / "b.safetensors", tmp_path / "a.safetensors")
    assert _run.stats_bytes(merged) == data == _run.stats_bytes(first.merge(second))


def test_mismatched_and_corrupt_files_are_refused(model, whole, tmp_path):
    other = run(model, CORPUS[:4], analyses=["trajectories"], eps=(0.2,))
    with pytest.raises(
        TLDynamicsError, match="cannot merge statistics of different runs: they differ in analyses"
    ):
        scale.merge_stats(whole, other)
    renamed = scale.run_stats(model, CORPUS[:4], batch_size=BATCH, progress=False, model_name="x")
    with pytest.raises(TLDynamicsError, match="differ in model"):
        scale.load_stats(whole).merge(renamed)
    data = whole.read_bytes()
    cases = {
        "truncated": data[:-5],
        "garbage": b"not a statistics file at all",
        "flipped": data[:-9] + bytes([data[-9] ^ 1]) + data[-8:],
    }
    for name, broken in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(broken)
        with pytest.raises(TLDynamicsError, match="corrupt"):
            scale.load_stats(path)
    with pytest.raises(TLDynamicsError, match="does not exist"):
        scale.load_stats(tmp_path / "missing.safetensors")


def test_empty_shard_and_bad_inputs(model, whole, tmp_path):
    empty = run(model, [], tmp_path / "empty.safetensors")
    assert empty.n_prompts == 0
    loaded = scale.load_stats(tmp_path / "empty.safetensors")
    assert _run.stats_bytes(loaded.merge(scale.load_stats(whole))) == whole.read_bytes()
    assert "no prompts" in scale.stats_page(loaded).to_html()
    with pytest.raises(TLDynamicsError, match="analyses \\['heads'\\]: choose one or more of"):
        run(model, CORPUS, analyses=["heads"])
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"text": "a = 1"}\n{"txt": "b"}\n')
    with pytest.raises(TLDynamicsError, match="c.jsonl:2: no non-empty string 'text' field"):
        run(model, lines)


# ---------------------------------------------------------------------- resume
def test_interrupted_run_resumes_to_the_same_bytes(model, whole, tmp_path, monkeypatch):
    out = tmp_path / "resumed.safetensors"
    part = run(model, CORPUS, out, max_batches=2, checkpoint_every=1)
    assert part.n_prompts == 2 * BATCH and not out.exists()
    checkpoint = Path(str(out) + ".partial")
    assert checkpoint.is_file()
    with pytest.raises(TLDynamicsError, match="made by a different run"):
        scale.run_stats(
            model, CORPUS, out, batch_size=2, model_name=NAME, resume=True, progress=False
        )
    # a crash during the second resumed batch: the checkpoint keeps the batch before it
    from tl_dynamics.scale import _run

    original, calls = _run.ShardRunner.add, []

    def crash(self, texts, skipped=None):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, texts, skipped)

    monkeypatch.setattr(_run.ShardRunner, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        run(model, CORPUS, out, resume=True, checkpoint_every=1)
    monkeypatch.setattr(_run.ShardRunner, "add", original)
    with pytest.raises(TLDynamicsError, match="checkpoint of an unfinished run"):
        scale.load_stats(checkpoint)
    assert scale.load_stats(checkpoint, allow_partial=True).n_prompts == 3 * BATCH
    run(model, CORPUS, out, resume=True)
    assert out.read_bytes() == whole.read_bytes()
    assert not checkpoint.exists()


# ---------------------------------------------------------------------- processes
def test_cli_stats_and_dataset_page(whole, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS[:5]).replace("\n    ", " ") + "\n\n")
    out = tmp_path / "cli.safetensors"
    assert (
        cli.main(
            [
                "stats",
                "--model",
                NAME,
                "--prompts",
                str(corpus),
                "--out",
                str(out),
                "--batch-size",
                "2",
                "--analyses",
                "odds_ratio",
                "--no-progress",
            ]
        )
        == 0
    )
    assert scale.load_stats(out).n_prompts == 5 and scale.load_stats(out).trajectories is None
    page = tmp_path / "page.html"
    assert cli.main(["report", "--stats", str(whole), "--out", str(page)]) == 0
    html = page.read_text()
    assert "sink mass" in html and "prior attribution" in html and "clusters" in html
    assert cli.main(["report", "--stats", str(tmp_path / "nope.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _corpus_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    return path


@pytest.mark.slow
def test_torchrun_two_processes_byte_identical(whole, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "dist.safetensors"
    # on CPU (gloo) like the in-process run it is compared with, even on a GPU machine
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(29500 + os.getpid() % 400),
            "-m",
            "tl_dynamics",
            "stats",
            "--model",
            NAME,
            "--prompts",
            str(_corpus_file(tmp_path)),
            "--out",
            str(out),
            "--batch-size",
            str(BATCH),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes() == whole.read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torchrun_on_cuda_byte_identical_to_one_process(tmp_path):
    """GPU ranks (issue 22): with two GPUs or more each rank runs on its own ``cuda:LOCAL_RANK``
    and the group is NCCL (``--device cuda``); on one GPU both ranks share ``cuda:0`` and the
    group is gloo (NCCL refuses two ranks on one GPU). Either way the file equals a one-process
    run on ``cuda:0``, the same device kind and the same batches."""
    torchrun = Path(sys.executable).with_name("torchrun")
    corpus = _corpus_file(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    common = [
        "stats",
        "--model",
        NAME,
        "--prompts",
        str(corpus),
        "--batch-size",
        str(BATCH),
        "--no-progress",
    ]
    one, dist = tmp_path / "one.safetensors", tmp_path / "dist.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "tl_dynamics", *common, "--out", str(one), "--device", "cuda:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    device = "cuda" if torch.cuda.device_count() >= 2 else "cuda:0"
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(29900 + os.getpid() % 90),
            "-m",
            "tl_dynamics",
            *common,
            "--out",
            str(dist),
            "--device",
            device,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert dist.read_bytes() == one.read_bytes()


@requires_hooked
def test_hooked_transformer_host_streams_and_merges_exactly():
    hooked = testing.tiny_hooked("gpt2-like")
    whole = scale.run_stats(hooked, CORPUS[:12], batch_size=BATCH, progress=False)
    halves = scale.merge_stats(
        scale.run_stats(hooked, CORPUS[8:12], batch_size=BATCH, progress=False),
        scale.run_stats(hooked, CORPUS[:8], batch_size=BATCH, progress=False),
    )
    assert _run.stats_bytes(halves) == _run.stats_bytes(whole)
    assert whole.trajectories == T.stream(hooked, CORPUS[:12], batch_size=BATCH, progress=False)


def test_a_file_from_before_the_learned_sink_sum_says_so(whole):
    """Files written before ``HeadStats.SUM_KEYS`` gained ``learned_sink`` are refused with the
    reason and what to do, not only the key lists."""
    from tl_dynamics.scale import _validate

    data = whole.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    fields = json.loads(meta["tl_dynamics_stats"])
    _validate.check_header(fields, "x")  # today's keys pass
    fields["odds_ratio"]["sum_keys"].remove("learned_sink")
    with pytest.raises(
        TLDynamicsError,
        match="written before tl_dynamics kept the learned-sink "
        "sum: recompute it with `tl-dynamics stats`",
    ):
        _validate.check_header(fields, "x")
