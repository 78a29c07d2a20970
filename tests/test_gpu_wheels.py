"""The GPU machine's wheelhouse (issues 33, 34; ``make gpu-wheels``, benchmarks/gpu/wheels.txt)
and the contract of ``benchmarks/gpu_check.sh`` that installs it there.

It must stay within what travels to the machine (64 MiB with the repository), hold exactly the
pinned wheels for CPython 3.12 on x86_64 Linux and nothing the machine already has, Ray as its
trimmed archive, and its packages must import when installed the machine's way (``pip install
--no-index --no-deps --target``, the archive extracted into the same folder, then
``PYTHONPATH``). The wheelhouse is ``.gpu-wheels/`` where ``make gpu-wheels`` made it, else its
wheels are downloaded from PyPI here (skipped, with the reason, where PyPI cannot be reached);
Ray's archive is checked where ``make gpu-wheels`` made it (a 79 MB download and a minute or
two of xz), and run (``benchmarks/gpu/ray_smoke.py``) where ``GPU_CHECK_PYTHON`` names a
CPython 3.12 with Ray's needs that the machine has.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import wheels  # noqa: E402  (benchmarks/gpu/wheels.py)


MADE = ROOT / ".gpu-wheels"
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
# Ray's part of the wheelhouse: ray and rpds-py are binaries for CPython 3.12 only
RAY_PART = {"ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py"}


def _made() -> bool:
    return (MADE / ".complete").exists() and not wheels.check(MADE)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    if _made():
        return MADE
    folder = tmp_path_factory.mktemp("gpu-wheels")
    try:
        wheels.download(folder, trimmed=False)  # the wheels; Ray's archive: `make gpu-wheels`
    except subprocess.CalledProcessError as err:
        pytest.skip(f"could not download the wheelhouse from PyPI (offline?): {err}")
    return folder


def _lock() -> dict[str, str]:
    lines = (ROOT / "requirements" / "lock-tl4.txt").read_text().splitlines()
    return {wheels.norm(n): v for n, _, v in (ln.partition("==") for ln in lines if "==" in ln)}


def test_wheel_list_names_only_what_the_machine_lacks():
    pins, device = wheels.pins(), wheels.device_packages()
    assert "transformer-lens" in pins and "circuitsvis" in pins
    assert {"torch", "transformers", "numpy", "einops", "jaxtyping"} <= device
    assert not set(pins) & device
    assert set(wheels.MODULES) == set(pins)
    # Ray travels trimmed, at the version the project locks, with its needs at theirs
    assert set(wheels.TRIM) == {"ray"} and RAY_PART <= set(pins)
    lock = _lock()
    assert {n: pins[n] for n in RAY_PART} == {n: lock[n] for n in RAY_PART}


def _needs(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """What ``name`` (installed here) asks for on CPython 3.12 on Linux, with ``extras``."""
    out = set()
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux"}
        if req.marker is None or any(
            req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras)
        ):
            out.add(wheels.norm(req.name))
    return out


def test_ray_and_ray_data_needs_are_on_the_machine_or_carried():
    ray = pytest.importorskip("ray", reason="Ray's metadata is read from its installed copy")
    assert ray.__version__ == wheels.pins()["ray"]
    have = wheels.device_packages() | set(wheels.pins())
    needs = _needs("ray", ("data",))
    assert {"jsonschema", "pyarrow", "pandas", "msgpack"} <= needs  # the metadata was read
    assert needs <= have, needs - have
    for name in sorted(RAY_PART - {"ray", "rpds-py"}):  # pure Python: installed with ray here
        assert _needs(name) <= have, (name, _needs(name) - have)


def _fake_wheel(folder: Path) -> Path:
    """A small wheel named as Ray's, with a folder TRIM drops and an executable."""
    path = folder / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, mode in [
            ("ray/__init__.py", 0o644),
            ("ray/core/src/ray/raylet/raylet", 0o755),
            ("ray/jars/ray_dist.jar", 0o644),
            ("ray/rllib/__init__.py", 0o644),
            ("ray/dashboard/client/build/index.html", 0o644),
            ("ray/dashboard/agent.py", 0o644),
            ("ray-2.60.0.dist-info/METADATA", 0o644),
        ]:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (stat.S_IFREG | mode) << 16
            zf.writestr(info, f"contents of {name}\n")
    return path


def test_trim_leaves_out_the_named_folders_and_unpacks_as_pip_would(tmp_path):
    wheel = _fake_wheel(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, again = wheels.trim(wheel, tmp_path / "a"), wheels.trim(wheel, tmp_path / "b")
    assert first.name == "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.tar.xz"
    assert first.read_bytes() == again.read_bytes()  # the same bytes from the same wheel
    site = tmp_path / "site"
    assert wheels.unpack(tmp_path / "a", site) == 0
    kept = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert kept == [
        "ray-2.60.0.dist-info/METADATA",
        "ray-2.60.0.dist-info/TRIMMED",
        "ray/__init__.py",
        "ray/core/src/ray/raylet/raylet",
        "ray/dashboard/agent.py",
    ]
    assert os.access(site / "ray/core/src/ray/raylet/raylet", os.X_OK)
    assert (site / "ray/__init__.py").read_text() == "contents of ray/__init__.py\n"
    trimmed = (site / "ray-2.60.0.dist-info/TRIMMED").read_text().split()
    assert trimmed == list(wheels.TRIM["ray"])
    # the wheelhouse's check: Ray as a wheel is refused, as an archive it is named for
    problems = wheels.check(tmp_path / "a")
    assert not any(p.startswith("ray") for p in problems), problems
    assert "ray==2.60.0: missing" not in problems
    problems = wheels.check(tmp_path)  # the wheel itself
    assert any("ray travels trimmed" in p for p in problems), problems


@pytest.mark.slow
def test_wheelhouse_fits_and_its_packages_import(wheelhouse, tmp_path):
    trimmed = list(wheelhouse.glob("*" + wheels.ARCHIVE))
    missing = [] if trimmed else [f"{n}=={wheels.pins()[n]}: missing" for n in wheels.TRIM]
    assert wheels.check(wheelhouse) == missing
    total = sum(p.stat().st_size for p in wheelhouse.iterdir() if p.is_file())
    assert 0 < total + (wheels.tree_size() or 0) <= wheels.LIMIT
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        # the machine's Python (multiprocess ships one wheel per Python version)
        + ["--python-version", "3.12", "--only-binary=:all:"]
        + ["--no-compile", "--target", str(site)]
        + [str(p) for p in sorted(wheelhouse.glob("*.whl"))],
        check=True,
    )
    assert wheels.unpack(wheelhouse, site) == (0 if trimmed else 1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    # Ray's part only on the machine's Python (its binaries are for CPython 3.12)
    modules = [m for n, m in wheels.MODULES.items() if n not in RAY_PART]
    if sys.version_info[:2] == (3, 12) and trimmed:
        modules = list(wheels.MODULES.values()) + ["ray.data"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "wheels.py"), "imports"]
        + modules
        + ["tl_dynamics", "tl_dynamics.report"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "absent wandb, transformers_stream_generator: yes" in proc.stdout
    # the packages came from the wheelhouse, not from this environment
    where = subprocess.run(
        [sys.executable, "-c", "import transformer_lens, circuitsvis as c; print(c.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr


@pytest.mark.slow
@pytest.mark.skipif(not _made(), reason="no .gpu-wheels: `make gpu-wheels` builds Ray's archive")
def test_trimmed_ray_archive_holds_ray_less_what_trim_names():
    (archive,) = MADE.glob("ray-*" + wheels.ARCHIVE)
    assert archive.name == f"ray-{wheels.pins()['ray']}-cp312-cp312-manylinux2014_x86_64.tar.xz"
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        meta = tar.extractfile(members[f"ray-{wheels.pins()['ray']}.dist-info/METADATA"])
        version = re.search(r"^Version: (\S+)$", meta.read().decode(), re.M)
    assert version and version.group(1) == _lock()["ray"]
    for binary in ("ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server"):
        assert members[binary].mode & 0o111, binary
    assert "ray/_raylet.so" in members and "ray/data/__init__.py" in members
    assert "ray/dashboard/agent.py" in members  # the dashboard's agent stays (the cluster runs it)
    assert not [n for n in members if n.startswith(wheels.TRIM["ray"])]
    assert archive.stat().st_size < 32 * 2**20


@pytest.mark.slow
@pytest.mark.skipif(
    not _made() or not os.environ.get("GPU_CHECK_PYTHON"),
    reason="needs .gpu-wheels and GPU_CHECK_PYTHON: a CPython 3.12 with Ray's needs the machine has",
)
def test_trimmed_ray_runs_a_local_cluster_actors_and_ray_data(tmp_path):
    python = os.environ["GPU_CHECK_PYTHON"]
    site = tmp_path / "site"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--target", str(site)]
        + [str(p) for p in sorted(MADE.glob("*.whl"))],
        check=True,
    )
    assert wheels.unpack(MADE, site) == 0
    proc = subprocess.run(
        [python, str(ROOT / "benchmarks" / "gpu" / "ray_smoke.py")],
        env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"ray {wheels.pins()['ray']} from {site / 'ray'}" in proc.stdout
    assert "ray smoke: ok" in proc.stdout


def _stub_run(
    tmp_path: Path, parts: str, fail: str = ""
) -> tuple[subprocess.CompletedProcess, Path]:
    """gpu_check.sh with a stub for Python that records each call (and fails the ones whose
    arguments contain ``fail``), over a wheelhouse of one empty file."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/bash\n"
        f'echo "$* | COMPILE=$TL_DYNAMICS_COMPILE RAY_STATS=$RAY_USAGE_STATS_ENABLED" >>{calls}\n'
        f'[[ -n "{fail}" && "$*" == *"{fail}"* ]] && exit 3\n'
        '[[ "$*" == *pytest* ]] && echo "1 passed, 5 deselected in 1.00s"\n'
        "exit 0\n"
    )
    stub.chmod(0o755)
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "x-1-py3-none-any.whl").write_bytes(b"")
    env = dict(
        os.environ,
        GPU_CHECK_PARTS=parts,
        GPU_CHECK_PYTHON=str(stub),
        GPU_CHECK_WHEELS=str(tmp_path / "wh"),
        GPU_CHECK_SITE=str(tmp_path / "site"),
    )
    env.pop("TL_DYNAMICS_COMPILE", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=60
    )
    return proc, out


def test_gpu_check_installs_ray_then_runs_its_gpu_test_within_the_budgets(tmp_path):
    proc, out = _stub_run(tmp_path, "install ray")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all steps add up to 540 s" in proc.stdout  # at most 9 minutes, printed first
    budgets = re.findall(r"^\s+[ -] (\S+)\s+(\d+) s", proc.stdout, re.M)
    assert [b[0] for b in budgets][:3] == ["install", "tests", "ray"]
    assert sum(int(b[1]) for b in budgets) == 540
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    site, wh = tmp_path / "site", tmp_path / "wh"
    install = [c for c in calls if "pip install" in c or "wheels.py" in c]
    assert install[0].startswith("-m pip install -q --no-index --no-deps")
    assert f"--target {site}" in install[0]
    assert install[1].startswith(f"benchmarks/gpu/wheels.py unpack {wh} {site} ")
    assert install[2].startswith("benchmarks/gpu/wheels.py imports")
    ray = [c for c in calls if c.startswith(("-c import ray", "-m pytest"))]
    assert ray[0].startswith("-c import ray, ray.data")
    assert ray[1].startswith("-m pytest tests/test_scale_ray.py -k gpu_share")
    assert ray[1].endswith("COMPILE=never RAY_STATS=0")
    # at most six files; the Ray test's output goes into tests.log, its summary into gpu-check.md
    files = sorted(p.name for p in out.iterdir())
    assert set(files) <= {"gpu-check.md", "gpu-check.log", "tests.log", "bench.log"}.union(
        {"install.log", "env.txt"}
    )
    assert "===== ray =====" in (out / "tests.log").read_text()
    summary = (out / "gpu-check.md").read_text()
    assert re.search(r"^\| ray \| ok, \d+ s \|$", summary, re.M), summary
    assert "Ray test: 1 passed, 5 deselected" in summary


def test_gpu_check_records_a_ray_that_does_not_import_as_failed(tmp_path):
    proc, out = _stub_run(tmp_path, "ray", fail="import ray")
    assert proc.returncode == 1
    assert re.search(r"^\| ray \| FAILED \(exit 3\)", (out / "gpu-check.md").read_text(), re.M)
    assert "pytest" not in (tmp_path / "calls.txt").read_text()  # no test file that skips itself


def test_the_ray_step_selects_exactly_the_gpu_test():
    text = (ROOT / "tests" / "test_scale_ray.py").read_text()
    names = re.findall(r"^def (test_\w+)", text, re.M)
    assert [n for n in names if "gpu_share" in n] == ["test_each_actor_computes_on_its_gpu_share"]
    assert "-k gpu_share" in SCRIPT.read_text()
