"""The GPU machine's wheelhouse (issue 33; ``make gpu-wheels``, benchmarks/gpu/wheels.txt).

It must stay within what travels to the machine (64 MiB), hold exactly the pinned wheels for
CPython 3.12 on x86_64 Linux and nothing the machine already has, and its packages must import
when installed the machine's way (``pip install --no-index --no-deps --target``, then
``PYTHONPATH``). The wheelhouse is ``.gpu-wheels/`` where ``make gpu-wheels`` made it, else it is
downloaded from PyPI here (skipped, with the reason, where PyPI cannot be reached).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import wheels  # noqa: E402  (benchmarks/gpu/wheels.py)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    made = ROOT / ".gpu-wheels"
    if (made / ".complete").exists() and not wheels.check(made):
        return made
    folder = tmp_path_factory.mktemp("gpu-wheels")
    try:
        wheels.download(folder)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"could not download the wheelhouse from PyPI (offline?): {err}")
    return folder


def test_wheel_list_names_only_what_the_machine_lacks():
    pins, device = wheels.pins(), wheels.device_packages()
    assert "transformer-lens" in pins and "circuitsvis" in pins
    assert {"torch", "transformers", "numpy", "einops", "jaxtyping"} <= device
    assert not set(pins) & device
    assert set(wheels.MODULES) == set(pins)


@pytest.mark.slow
def test_wheelhouse_fits_and_its_packages_import(wheelhouse, tmp_path):
    assert wheels.check(wheelhouse) == []
    total = sum(p.stat().st_size for p in wheelhouse.iterdir() if p.is_file())
    assert 0 < total <= wheels.LIMIT
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        # the machine's Python (multiprocess ships one wheel per Python version)
        + ["--python-version", "3.12", "--only-binary=:all:"]
        + ["--no-compile", "--target", str(site)]
        + [str(p) for p in sorted(wheelhouse.glob("*.whl"))],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "wheels.py"), "imports"],
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
