"""Nothing wrong after any fault (issue 43): a resume checks what its checkpoint was computed from
(the model's weights, configuration and tokenizer by fingerprint, the corpus's prompts in their
batches and order), a file that passes its checksum gives no raw error however its values were
crafted, a model with NaN weights is refused naming the tensor, a killed write's temporary file
is removed by the next run of the same output, and ``--stats`` names what it was given before it
reads more than a header. Real files, real subprocesses and real signals; a real small tmpfs
where the machine lets an unprivileged namespace mount one. Ray's faults: test_scale_ray.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tl_dynamics import cli, files, scale, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.collect import ExactSum
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale import _format, _ray_session
from tl_dynamics.scale._read import from_bytes

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [f"def f{i}(x):  return x * {i}" for i in range(12)]
BATCH = 4


@pytest.fixture(scope="module")
def model():
    return testing.cached_model("gpt2")


def run(model, prompts, out=None, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("model_name", "tiny")
    return scale.run_stats(model, prompts, out, batch_size=BATCH, **kw)


def main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    """The CLI's error: one line, no traceback."""
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("tl-dynamics: "), err
    return err


def folder_model(folder: Path, seed: int = 0) -> Path:
    """A tiny GPT-2 as a Hugging Face folder (config, model.safetensors, tokenizer)."""
    import transformers

    config = testing.cached_model("gpt2").original_model.config
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    return folder


def nudge_weight(folder: Path, name: str = "transformer.h.0.attn.c_attn.weight") -> None:
    """Overwrite the folder's weights with one value changed (a fine-tune writing its checkpoint
    in place, a re-download of another revision)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    weights[name][0, 0] += 0.25
    save_file(weights, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------- 1. what was computed
def test_weights_changed_under_the_same_path_refuse_the_resume_by_name(tmp_path, capsys):
    folder = folder_model(tmp_path / "model")
    corpus, out = tmp_path / "corpus.txt", tmp_path / "stats.safetensors"
    corpus.write_text("\n".join(CORPUS) + "\n")
    argv = ["stats", "--model", folder, "--prompts", corpus, "--out", out, "--no-progress"]
    argv += ["--batch-size", BATCH]
    assert main(capsys, *argv, "--max-batches", 1)[0] == 0
    nudge_weight(folder)
    code, _, err = main(capsys, *argv, "--resume")
    assert code == 2 and not out.exists()
    assert "was computed from another model than this run loads: the model's weights" in one_line(
        err
    )
    assert "configuration" not in err and "tokenizer" not in err  # only what changed
    partial = scale.load_stats(str(out) + ".partial", allow_partial=True)
    assert partial.n_prompts == BATCH  # the checkpoint is kept, unchanged


def test_lines_reordered_inside_the_checkpointed_part_refuse_the_resume(model, tmp_path):
    corpus, out = tmp_path / "corpus.txt", tmp_path / "stats.safetensors"
    corpus.write_text("\n".join(CORPUS) + "\n")
    run(model, corpus, out, max_batches=2)  # batches 0 and 1: lines 1..8
    for swap in ((1, 2), (3, 5)):  # inside batch 0; across batches 0 and 1
        lines = list(CORPUS)
        lines[swap[0]], lines[swap[1]] = lines[swap[1]], lines[swap[0]]
        corpus.write_text("\n".join(lines) + "\n")
        with pytest.raises(TLDynamicsError, match="made from the same 8 prompts in another order"):
            run(model, corpus, out, resume=True)
    lines = list(CORPUS)  # after the checkpointed part: nothing computed yet, accepted
    lines[9], lines[10] = lines[10], lines[9]
    corpus.write_text("\n".join(lines) + "\n")
    resumed = run(model, corpus, out, resume=True)
    assert resumed == run(model, lines) and resumed != run(model, CORPUS)


def test_the_file_says_what_it_was_made_from_and_a_merge_of_two_models_is_refused(
    model, tmp_path, capsys
):
    stats = run(model, CORPUS[:4])
    assert stats.fingerprints == ModelAdapter(model).fingerprints()
    path = scale.save_stats(stats, tmp_path / "a.safetensors")
    assert scale.load_stats(path).fingerprints == stats.fingerprints  # recorded, read back
    other = testing.tiny_model("gpt2")
    with torch.no_grad():
        other.blocks[1].attn.original_component.c_proj.weight[0, 0] += 1.0
    theirs = run(other, CORPUS[4:8])
    with pytest.raises(TLDynamicsError, match=r"differ in the model's weights \(fingerprint"):
        scale.merge_stats(stats, theirs)
    page = tmp_path / "a.html"
    assert main(capsys, "report", "--stats", path, "--out", page)[0] == 0
    html = page.read_text()
    for value in (*stats.fingerprints.values(), f"{stats.batches_hash:064x}"):
        assert value in html


def test_a_version_2_file_loads_as_written_and_its_checkpoint_is_not_resumed(model, tmp_path):
    import dataclasses

    old = dataclasses.replace(run(model, CORPUS[:4]), fingerprints=None, batches_hash=None)
    path = scale.save_stats(old, tmp_path / "v2.safetensors")
    loaded = scale.load_stats(path)
    assert loaded.version == 2 and loaded.fingerprints is None
    assert _format.to_bytes(loaded) == path.read_bytes()  # read and written back unchanged
    with pytest.raises(TLDynamicsError, match="versions 2 and 3: version 2 files predate the fi"):
        scale.merge_stats(path, run(model, CORPUS[4:8]))
    out = tmp_path / "s.safetensors"
    scale.save_stats(old, str(out) + ".partial", {"next_batch": 1})
    with pytest.raises(TLDynamicsError, match="is of format version 2, written before checkpoi"):
        run(model, CORPUS, out, resume=True)


# ---------------------------------------------------------------------- 2. no raw error
def _repack(data: bytes, tensors: dict) -> bytes:
    n = int.from_bytes(data[:8], "little")
    meta = dict(json.loads(data[8 : 8 + n])["__metadata__"])
    meta[_format.CHECKSUM_KEY] = _format._checksum(tensors, meta[_format.HEADER_KEY])
    return _format._pack(tensors, meta)


def _with_value(data: bytes, prefix: str, index: tuple, value: float) -> bytes:
    """The file with one value of the exact sum ``prefix`` replaced, checksum recomputed."""
    from safetensors.numpy import load

    tensors = load(data)
    parts = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    values = ExactSum.from_arrays(parts).value().copy()
    values[index] = value
    kept = {k: v for k, v in tensors.items() if not k.startswith(prefix + ".")}
    kept.update({f"{prefix}.{k}": v for k, v in ExactSum.of(values).arrays().items()})
    return _repack(data, kept)


def test_a_nan_count_that_passes_the_checksum_is_named_not_raised(model, tmp_path, capsys):
    data = _format.to_bytes(run(model, CORPUS[:6]))
    path, page = tmp_path / "nan.safetensors", tmp_path / "nan.html"
    path.write_bytes(_with_value(data, "odds_ratio.sums", (1, 0, 1), float("nan")))  # rows
    code, _, err = main(capsys, "report", "--stats", path, "--out", page)
    assert code == 2 and not page.exists()
    assert (
        "tensor 'odds_ratio.sums' holds nan at layer 1, head 1 of the count 'rows' "
        "(index [1, 0, 1]): a count must be a whole number" in one_line(err)
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow in the crafted values
def test_no_crafted_value_in_any_tensor_gives_a_raw_error(model, tmp_path):
    """Every exact sum and count, one value at a time made NaN, infinite, huge, negative or
    fractional (the checksum recomputed): the page renders and a merge works, or the file is
    refused with a ``TLDynamicsError``; nothing else is raised."""
    from safetensors.numpy import load

    stats = run(model, CORPUS[:6])
    data, other = _format.to_bytes(stats), run(model, CORPUS[6:])
    tensors = load(data)
    sums = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".limbs")})
    n_keys = len(stats.odds_ratio.sum_keys) + len(stats.odds_ratio.sink_keys)
    cases = [
        (prefix, index, value)
        for prefix in sums
        for index in ([(0, k, 1) for k in range(n_keys)] if prefix == "odds_ratio.sums" else [(0,)])
        for value in (float("nan"), float("inf"), -1e300, 0.5, -1.0)
    ]
    raw, refused = [], 0
    for prefix, index, value in cases:
        try:
            loaded = from_bytes(_with_value(data, prefix, index, value))[0]
            scale.stats_page(loaded).to_html()
            loaded.merge(other)
        except TLDynamicsError:
            refused += 1
        except Exception as exc:  # noqa: BLE001 - what this test looks for
            raw.append((prefix, index, value, f"{type(exc).__name__}: {exc}"))
    assert not raw, raw[:5]
    assert refused >= 4 * 5  # the four counts refuse every one of these values
    big = dict(tensors)  # a count that would wrap around when two files are merged
    big["trajectories.ints.n_tokens"] = np.array(1 << 62, dtype=np.int64)
    with pytest.raises(TLDynamicsError, match="would overflow when files are merged"):
        from_bytes(_repack(data, big))[0].merge(other)


def test_a_model_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path, capsys):
    bad = testing.tiny_model("gpt2")
    with torch.no_grad():
        bad.original_model.transformer.ln_f.weight[3] = float("nan")  # after every attention
    with pytest.raises(TLDynamicsError) as caught:
        ModelAdapter(bad)
    message = str(caught.value)
    assert message.startswith("the model's weight 'transformer.ln_f.weight' holds nan at [3]")
    assert "does not reproduce" not in message  # not blamed on the adapter's reading
    folder = folder_model(tmp_path / "model")  # the same by the CLI, from a folder
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights["transformer.h.1.attn.c_attn.weight"][2, 5] = float("inf")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    corpus = tmp_path / "c.txt"
    corpus.write_text("a = 1\n")
    code, _, err = main(
        capsys, "stats", "--model", folder, "--prompts", corpus, "--out", tmp_path / "s.st"
    )
    assert code == 2 and "'transformer.h.1.attn.c_attn.weight' holds inf at [2, 5]" in one_line(err)


# ---------------------------------------------------------------------- 3. leftovers, reading
def test_a_write_killed_midway_leaves_a_temporary_file_the_next_run_removes(
    model, tmp_path, capsys
):
    from fault_points import reached

    stats = scale.save_stats(run(model, CORPUS[:4]), tmp_path / "s.safetensors")
    page, points = tmp_path / "page.html", tmp_path / "points"
    points.mkdir()
    argv = ["report", "--stats", str(stats), "--out", str(page)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stop = [sys.executable, str(ROOT / "tests" / "fault_points.py"), str(points), "write"]
    proc = subprocess.Popen([*stop, *argv], env=env)  # waits inside the write: temporary written
    try:
        assert reached(points, "write", proc), "the subprocess never reached its write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (left,) = tmp_path.glob(".page.html.*.tmp")  # what SIGKILL inside a write leaves
    others = [tmp_path / ".page.html.tmp", tmp_path / ".other.html.abcd1234.tmp"]
    for path in others:  # not this output's pattern: never touched
        path.write_text("x")
    (tmp_path / ".page.html.dir45678.tmp").mkdir()  # the pattern, but a folder: kept
    held = tmp_path / ".page.html.held1234.tmp"  # a live writer's: kept
    held.write_text("being written")
    with open(held) as handle:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        assert main(capsys, *argv)[0] == 0
        assert held.exists()
    assert page.read_text().startswith("<!DOCTYPE html>") and not left.exists()
    assert all(p.exists() for p in others) and (tmp_path / ".page.html.dir45678.tmp").is_dir()
    assert files.remove_stale_temporaries(page) == [held]  # its writer gone: removed


def _rchar() -> int:
    return int(
        next(
            line for line in Path("/proc/self/io").read_text().splitlines() if "rchar" in line
        ).split()[1]
    )


def test_stats_names_what_it_was_given_and_reads_a_header_first(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for given, words in (
        (tmp_path, "is a directory"),
        (fifo, "is a named pipe (FIFO)"),
        (Path("/dev/zero"), "is a character device"),
        (tmp_path / "none.safetensors", "does not exist"),
    ):
        code, _, err = main(capsys, "report", "--stats", given, "--out", tmp_path / "p.html")
        assert code == 2 and f"'{given}' {words}" in one_line(err)
    big = tmp_path / "big.safetensors"  # 3 GiB, sparse: only a header's worth is read
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    with open(big, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(3 << 30)
    bogus = tmp_path / "bogus.safetensors"
    with open(bogus, "wb") as handle:
        handle.write((1 << 40).to_bytes(8, "little"))
        handle.truncate(3 << 30)
    for path, words in (
        (big, "is a safetensors file but not tl-dynamics statistics"),
        (bogus, "give a header of 1099511627776 bytes, but 3221225464 follow them"),
    ):
        before = _rchar()
        with pytest.raises(TLDynamicsError, match=words):
            scale.load_stats(path)
        assert _rchar() - before < 1 << 20  # not the 3 GiB


def test_ray_start_up_failure_is_one_line_with_what_to_try():
    class NoRay:
        shut = 0

        def is_initialized(self):
            return False

        def init(self, **kw):
            raise RuntimeError("The current node timed out during startup. This could happen...")

        def shutdown(self):
            self.shut += 1

    ray = NoRay()
    with pytest.raises(TLDynamicsError) as caught:
        with _ray_session.cluster(ray, "local"):
            pass
    message = str(caught.value)
    assert "\n" not in message and ray.shut == 1
    assert message.startswith(
        "Ray could not start a local cluster (RuntimeError: The current node timed out during "
        "startup); try again when the machine is less busy"
    )


# a process whose parent has ended (its pid on stdout), as a raylet's agents after it aborted
_ORPHAN = """import subprocess
child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid)
"""


class StartingRay:
    """A Ray whose ``init`` begins processes as a real start does (one of them orphaned, as the
    agents of a raylet that aborted are) and then fails, or not."""

    def __init__(self, fails: bool):
        self.fails, self.options, self.started = fails, {}, []
        self.initialized = False

    def is_initialized(self):
        return self.initialized

    def init(self, **options):
        self.options = options
        self.started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
        parent = subprocess.run(
            [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, check=True
        )
        self.orphan = int(parent.stdout)  # its parent gone: no longer under this process
        if self.fails:
            raise RuntimeError("The current node timed out during startup. This could...")
        self.initialized = True

    def shutdown(self):  # as Ray's after a failed start: reaches nothing
        self.initialized = False


def test_a_local_cluster_starts_with_ray_settings_for_a_loaded_machine():
    ray = StartingRay(fails=False)
    try:
        with _ray_session.cluster(ray, "local") as started:
            assert started and ray.options["address"] == "local"
            assert _ray_session.MARK not in os.environ  # only while Ray starts
        assert ray.options["include_dashboard"] is False
        assert ray.options["_system_config"] == {"worker_register_timeout_seconds": 600}
    finally:
        for process in ray.started:
            process.kill()
            process.wait()
        os.kill(ray.orphan, signal.SIGKILL)


def test_a_failed_start_of_a_local_cluster_leaves_no_process():
    """Ray's ``shutdown`` cannot reach what a failed start began (Ray's dashboards outlived the
    pytest run's failed starts, and a raylet's agents outlive it): every process the start
    began is ended, orphans included."""
    ray = StartingRay(fails=True)
    with pytest.raises(TLDynamicsError, match="^Ray could not start a local cluster"):
        with _ray_session.cluster(ray, "local"):
            pass
    assert ray.started[0].wait(timeout=60) == -signal.SIGTERM  # ended, not waited out
    assert not _ray_session._alive(ray.orphan) and _ray_session.MARK not in os.environ


# ---------------------------------------------------------------------- 4. a full disk
_IN_A_SMALL_TMPFS = """
import json, subprocess, sys
from tl_dynamics import cli
stats, root = sys.argv[1], sys.argv[2]
out = {}
for name, options in (("full", "size=8k"), ("inodes", "nr_inodes=1")):
    folder = f"{root}/{name}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", folder], check=True)
    code = cli.main(["report", "--stats", stats, "--out", f"{folder}/page.html"])
    out[name] = [code, sorted(__import__("os").listdir(folder))]
print("RESULT " + json.dumps(out))
"""


def test_a_full_disk_and_no_inodes_are_one_line_and_leave_nothing(model, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs without privileges")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine allows no user namespace mount: {probe.stderr.decode()[:80]}")
    stats = scale.save_stats(run(model, CORPUS[:4]), tmp_path / "s.safetensors")
    for name in ("full", "inodes"):
        (tmp_path / name).mkdir()
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", _IN_A_SMALL_TMPFS, str(stats), str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=600,
    )
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"full": [2, []], "inodes": [2, []]}, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tl-dynamics: ")]
    assert "Traceback" not in proc.stderr and len(errors) == 2, proc.stderr
    assert "page.html (No space left on device); nothing was written there" in errors[0]
    assert "cannot create a file in" in errors[1] and "No space left on device" in errors[1]
