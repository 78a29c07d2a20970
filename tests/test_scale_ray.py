"""``ray_stats`` on a local Ray cluster (2 CPUs, one per module): the workers read the data, the
driver only merges, and the bytes are those of ``run_stats`` however the data is cut into blocks
or files; ``on_long``, checkpoints and resume as in ``run_stats``; a GPU per actor where there is
one. Ray is an optional extra: without it every test here skips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tl_dynamics import cli, scale, testing
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale import _corpus, _ray_session, _ray_worker

ray = pytest.importorskip("ray", reason="Ray is the optional extra tl-dynamics[ray]")
pa = pytest.importorskip("pyarrow", reason="Ray Data needs pyarrow")

pytestmark = pytest.mark.slow  # a local cluster and two model-loading actors per run
NAME = "tiny-random:gpt2"
CORPUS = [
    f"def f{i}(x):\n    return x * {i} + {i % 7}" if i % 3 else f"import os  # {i}"
    for i in range(22)
]
LONG = "x = 1 + " * 40  # more tokens than the tiny model's context (64)
BATCH = 4
LOADER = NAME  # a model name: the actors the CLI test makes are the same (kept) ones


@pytest.fixture(scope="module")
def cluster():
    root = str(Path(__file__).resolve().parents[1])  # the workers import this checkout too
    here = str(Path(__file__).resolve().parent)  # and fault_points (issue 43's kill points)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, here] + ([] if old is None else [old]))
    try:
        try:  # ray_stats's own start: room for a loaded machine, nothing left if it fails
            _ray_session.start(ray, "local", num_cpus=2)
        except TLDynamicsError as exc:  # the machine, not the code: said, never a failure
            pytest.skip(str(exc))
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        ray.shutdown()
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def single(prompts, out=None, **kw):
    return scale.run_stats(
        testing.cached_model("gpt2"),
        prompts,
        out,
        batch_size=BATCH,
        model_name=NAME,
        progress=False,
        **kw,
    )


def on_ray(dataset, out=None, **kw):
    kw.setdefault("batches_per_task", 1)
    kw.setdefault("keep_workers", True)  # one pair of model-loading actors for the module
    return scale.ray_stats(
        LOADER, dataset, out, model_name=NAME, batch_size=BATCH, progress=False, **kw
    )


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "stats.safetensors"
    single(CORPUS, path)
    return path


class _DriverGuard:
    """Unpickles on a worker; raises in the process that made it (the driver)."""

    def __init__(self, pid: int):
        self.pid = pid

    def __reduce__(self):
        return eval, (f"__import__('os').getpid() != {self.pid} or 1 / 0",)


def blocks(texts, sizes, guard=False):
    """A Ray Dataset of ``texts`` in blocks of ``sizes`` rows (with a column that raises if
    read on the driver)."""
    tables, start = [], 0
    for size in sizes:
        part = texts[start : start + size]
        columns = {"text": part}
        if guard:
            columns["guard"] = [_DriverGuard(os.getpid()) for _ in part]
        tables.append(columns)
        start += size
    assert start == len(texts)
    if not guard:
        return ray.data.from_arrow([pa.table(c) for c in tables])
    return ray.data.from_items(
        [{"text": t, "guard": g} for c in tables for t, g in zip(c["text"], c["guard"])]
    ).repartition(len(sizes))


def test_uneven_blocks_and_several_files_give_run_stats_bytes(cluster, whole, tmp_path):
    out = tmp_path / "blocks.safetensors"
    on_ray(blocks(CORPUS, [3, 1, 5, 13]), out)  # batches of 4 cut by every block boundary
    assert out.read_bytes() == whole.read_bytes()
    files = [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.txt"]
    files[0].write_text("a = 1\n\nb = 2\n")  # a blank line, skipped by both
    files[1].write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:9]))
    files[2].write_text("\r\n".join(f"c = {i}" for i in range(10)) + "\r\n")
    lines = [text for f in files for _, text in _corpus.iter_records(f)]
    assert len(lines) == 21 and lines[2] == CORPUS[0]  # JSON keeps a prompt's newlines
    assert on_ray(files, batches_per_task=2) == single(lines)


def test_no_row_is_read_on_the_driver(cluster, whole):
    dataset = blocks(CORPUS, [5, 6, 11], guard=True)
    with pytest.raises(Exception, match="division by zero"):
        dataset.take(1)  # the guard works: reading a row here raises
    assert on_ray(dataset) == scale.load_stats(whole)


def test_on_long_names_file_line_or_row_and_counts_like_run_stats(cluster, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["a = 1", "b = 2", LONG, "c = 3", "d = 4", "e = 5"]) + "\n")
    with pytest.raises(TLDynamicsError, match=r"corpus.txt:3: the prompt has \d+ tokens"):
        on_ray(corpus)
    rows = ["a = 1"] * 6 + [LONG] + ["b = 2"] * 4
    with pytest.raises(TLDynamicsError, match=r"^row 6: the prompt has \d+ tokens but"):
        on_ray(blocks(rows, [4, 4, 3]))
    for policy in ("skip", "truncate"):
        out, ref = tmp_path / f"{policy}.safetensors", tmp_path / f"{policy}-1.safetensors"
        single(rows, ref, on_long=policy)
        on_ray(blocks(rows, [4, 4, 3]), out, on_long=policy)
        assert out.read_bytes() == ref.read_bytes()
        key = {"skip": "skipped_long", "truncate": "truncated"}[policy]
        assert scale.load_stats(out).skipped == {key: 1}


def test_interrupted_run_resumes_to_the_same_bytes(cluster, whole, tmp_path):
    out = tmp_path / "stats.safetensors"
    broken = CORPUS[:17] + [LONG] + CORPUS[17:]
    with pytest.raises(TLDynamicsError, match="row 17: the prompt has"):
        on_ray(blocks(broken, [8, 8, 7]), out, checkpoint_every=1)
    partial = scale.load_stats(str(out) + ".partial", allow_partial=True)
    assert partial.n_prompts == 16 and not out.exists()  # the first two blocks' batches
    with pytest.raises(TLDynamicsError, match="checkpoint of an unfinished run exists"):
        on_ray(CORPUS, out)
    with pytest.raises(TLDynamicsError, match="was made from different prompts"):
        on_ray(CORPUS[1:], out, resume=True)
    on_ray(blocks(CORPUS, [2, 20]), out, resume=True)
    assert out.read_bytes() == whole.read_bytes()
    assert not Path(str(out) + ".partial").exists()
    # a run_stats checkpoint resumes on Ray (same format, same batch numbers)
    again = tmp_path / "again.safetensors"
    single(CORPUS, again, max_batches=2, checkpoint_every=1)
    on_ray(CORPUS, again, resume=True)
    assert again.read_bytes() == whole.read_bytes()


def test_cli_ray_joins_the_cluster_and_names_long_lines(cluster, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["a = 1", LONG, "b = 2"] * 3) + "\n")
    ref, out = tmp_path / "ref.safetensors", tmp_path / "cli.safetensors"
    scale.run_stats(NAME, corpus, ref, batch_size=BATCH, progress=False, on_long="skip")
    argv = ["stats", "--model", NAME, "--prompts", str(corpus), "--batch-size", str(BATCH)]
    argv += ["--ray", "auto", "--workers", "2", "--no-progress"]
    assert cli.main([*argv, "--out", str(tmp_path / "e.safetensors")]) == 2
    assert "corpus.txt:2: the prompt has" in capsys.readouterr().err
    assert cli.main([*argv, "--out", str(out), "--on-long", "skip"]) == 0
    assert "skipped_long 3" in capsys.readouterr().out
    assert out.read_bytes() == ref.read_bytes()
    assert cli.main([*argv, "--out", str(out), "--max-batches", "1"]) == 2
    assert "--max-batches is not available with --ray" in capsys.readouterr().err


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device (the GPU checks)"
)
def test_each_actor_computes_on_its_gpu_share(cluster, tmp_path):
    out, ref = tmp_path / "gpu.safetensors", tmp_path / "one.safetensors"
    scale.run_stats(NAME, CORPUS, ref, batch_size=BATCH, progress=False, device="cuda")
    actor = ray.remote(_ray_worker.StatsActor).options(num_gpus=0.5)
    placed = actor.remote(NAME, 1, "cuda")
    assert ray.get(placed.device.remote()).startswith("cuda:0/")
    ray.kill(placed)  # its half GPU back before the run's two actors ask for theirs
    scale.ray_stats(
        NAME,
        CORPUS,
        out,
        model_name=NAME,
        batch_size=BATCH,
        progress=False,
        device="cuda",
        num_gpus=0.5,
        batches_per_task=1,
    )
    assert out.read_bytes() == ref.read_bytes()


# ---------------------------------------------------------------------- lost workers (issue 43)
# batch 3 holds "mid" (a worker is killed inside it), batch 9 "hold" (a worker waits there until
# the test has killed it, after the first checkpoint); 10 batches of 4
FAULT_CORPUS = [f"x{i} = {i} * 2" for i in range(40)]
FAULT_CORPUS[13], FAULT_CORPUS[37] = "mid = 13", "hold = 37"


@pytest.fixture(scope="module")
def fault_whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("fault") / "one.safetensors"
    single(FAULT_CORPUS, path)
    return path


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return True


def _killer(folder: Path, out: Path, stop):
    """Kill (SIGKILL) each worker that waits at a kill point: at loading and inside the "mid"
    batch at once; inside the "hold" batch once the first checkpoint exists (then let the
    retried batch through). Returns the points it killed at."""
    import signal
    import threading

    killed: dict[str, int] = {}

    def loop():
        while not stop.is_set():
            for point in ("loading", "mid", "hold"):
                marker = folder / f"{point}.pid"
                if point in killed or not marker.exists() or not marker.read_text():
                    continue
                if point == "hold" and not Path(str(out) + ".partial").exists():
                    continue
                killed[point] = int(marker.read_text())
                os.kill(killed[point], signal.SIGKILL)
                if point == "hold":
                    (folder / "go").touch()
            stop.wait(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return killed, thread


def _fault_run(tmp_path, points, **kw):
    import threading

    from fault_points import KillPoints

    folder, out = tmp_path / "points", tmp_path / "ray.safetensors"
    folder.mkdir()
    stop = threading.Event()
    killed, thread = _killer(folder, out, stop)
    loader = KillPoints(NAME, str(folder), points)
    try:
        scale.ray_stats(
            loader,
            FAULT_CORPUS,
            out,
            model_name=NAME,
            batch_size=BATCH,
            batches_per_task=1,
            checkpoint_every=1,
            progress=False,
            **kw,
        )
    finally:
        stop.set()
        thread.join()
    pids = [int(p.name.split("-")[1]) for p in folder.glob("loaded-*")]
    return out, killed, pids


def _all_dead(pids) -> bool:
    import time

    for _ in range(200):  # ray.kill ends the actors' processes soon after the call returns
        if all(_dead(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_workers_killed_loading_mid_batch_and_after_a_checkpoint_change_no_byte(
    cluster, fault_whole, tmp_path
):
    """SIGKILL of a worker while it loads, inside a batch, and inside a batch after the first
    checkpoint: Ray restarts it and runs its batches again; the run finishes by itself with the
    one-process bytes and leaves no worker process behind."""
    out, killed, pids = _fault_run(tmp_path, ("loading", "mid", "hold"), num_workers=1)
    assert sorted(killed) == ["hold", "loading", "mid"]
    assert len(pids) == 1 + 3  # one worker (the fewest processes to start), three restarts
    assert out.read_bytes() == fault_whole.read_bytes()
    assert not Path(str(out) + ".partial").exists()
    assert _all_dead(pids)


def test_a_worker_lost_past_its_restarts_stops_in_one_line_and_resumes(
    cluster, fault_whole, tmp_path
):
    with pytest.raises(TLDynamicsError) as caught:
        _fault_run(tmp_path, ("mid",), num_workers=1, max_restarts=0)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith("a Ray worker died more often than the 0 restarts allowed"), message
    assert "keeps the batches before 3; resume with" in message, message
    out = tmp_path / "ray.safetensors"
    partial = scale.load_stats(str(out) + ".partial", allow_partial=True)
    assert partial.n_prompts == 12 and not out.exists()
    on_ray(FAULT_CORPUS, out, resume=True)  # the module's kept workers
    assert out.read_bytes() == fault_whole.read_bytes()


def test_a_model_a_worker_cannot_load_is_named_in_one_line(cluster):
    """A worker's start-up failure is the loader's own error, by name (it was a raw
    ActorDiedError with the worker's traceback)."""
    with pytest.raises(TLDynamicsError) as caught:
        scale.ray_stats(
            "tiny-random:no-such-arch", ["a = 1"], model_name=NAME, num_workers=1, progress=False
        )
    assert str(caught.value).startswith(
        "tiny-random architecture 'no-such-arch' does not run on TransformerLens"
    )
    assert "\n" not in str(caught.value)


@pytest.mark.cluster
def test_sigterm_ends_the_cli_and_every_ray_process_it_started(tmp_path):
    """``tl-dynamics stats --ray local`` starts its own cluster; SIGTERM mid-run checkpoints,
    exits with 128 + 15 and shuts the cluster down: no process it started is left (Ray's
    dashboard and runtime-env agents outlived a terminated driver before). The CLI waits just
    after its first checkpoint until the signal comes (``tests/fault_points.py``)."""
    import signal
    import subprocess
    import sys
    import uuid

    from fault_points import reached
    from helpers import marked_processes, processes_left

    corpus, out = tmp_path / "corpus.txt", tmp_path / "stats.safetensors"
    corpus.write_text("\n".join(f"x{i} = {i} * 2" for i in range(2000)) + "\n")
    points = tmp_path / "points"
    points.mkdir()
    marker = f"TL_DYNAMICS_TEST_{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({marker: "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    argv = [sys.executable, str(Path(__file__).parent / "fault_points.py"), str(points)]
    argv += ["checkpoint", "stats", "--model", NAME, "--no-progress", "--prompts", str(corpus)]
    argv += ["--out", str(out), "--ray", "local", "--workers", "1"]
    argv += ["--batch-size", "1", "--checkpoint-every", "1"]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        if reached(points, "checkpoint", proc) is None:  # the cluster up and computing, or:
            _, err = proc.communicate()
            if proc.returncode == 2 and "Ray could not start a local cluster" in err:
                pytest.skip(err.strip())  # the machine, not the code
            pytest.fail(f"the run ended before its first checkpoint: {err}")
        started = marked_processes(marker)
        assert len(started) >= 4, started  # the driver, the GCS, the raylet, a worker, agents
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert not out.exists()
    assert 1 <= scale.load_stats(str(out) + ".partial", allow_partial=True).n_prompts < 2000
    left = processes_left(marker)
    assert not left, left
