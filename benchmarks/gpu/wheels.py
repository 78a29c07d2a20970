"""The wheelhouse for the air-gapped GPU machine (issue 33), and the checks of it.

    python benchmarks/gpu/wheels.py download .gpu-wheels   # `make gpu-wheels`: fetch, then check
    python benchmarks/gpu/wheels.py check .gpu-wheels      # exactly wheels.txt, <= 64 MiB, 3.12
    python benchmarks/gpu/wheels.py extras                 # this Python's packages the GPU lacks
    python benchmarks/gpu/wheels.py imports                # import what the wheels bring

``wheels.txt`` names what the machine lacks; ``device-packages.txt`` what it has (the device tool's
KINDS.md). Every wheel is fetched with ``--no-deps`` for CPython 3.12 on manylinux x86_64, so that
``pip install --no-index --no-deps --target`` there needs nothing else.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT = 64 * 2**20  # what travels with the repository to the machine, all of it
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# the packages the wheels bring, as imported (distribution name -> module name)
MODULES = {
    "transformer-lens": "transformer_lens",
    "circuitsvis": "circuitsvis",
    "importlib-metadata": "importlib_metadata",
    "datasets": "datasets",
    "dill": "dill",
    "multiprocess": "multiprocess",
    "beartype": "beartype",
    "typeguard": "typeguard",
    "fancy-einsum": "fancy_einsum",
}
# left out of the wheelhouse: nothing that runs on the machine may import them
ABSENT = ("wandb", "transformers_stream_generator")


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: Path) -> list[str]:
    return [
        line.split("#")[0].strip()
        for line in path.read_text().splitlines()
        if line.split("#")[0].strip()
    ]


def pins() -> dict[str, str]:
    """``{name: version}`` of ``wheels.txt``."""
    out = {}
    for line in _lines(HERE / "wheels.txt"):
        name, _, version = line.partition("==")
        out[norm(name)] = version
    return out


def device_packages() -> set[str]:
    """The names of the machine's own packages (``device-packages.txt``)."""
    return {norm(line.partition("==")[0]) for line in _lines(HERE / "device-packages.txt")}


def wheel_name(path: Path) -> tuple[str, str]:
    """``(name, version)`` of a wheel file (``name-version-tags.whl``)."""
    name, version = path.name.split("-")[:2]
    return norm(name), version


def check(folder: Path) -> list[str]:
    """What is wrong with the wheelhouse in ``folder`` (empty: nothing): every pin of
    ``wheels.txt`` once, nothing else, nothing the machine has, wheels for CPython 3.12 on
    x86_64 Linux, at most 64 MiB in all."""
    want, device = pins(), device_packages()
    wheels = sorted(folder.glob("*.whl"))
    problems = []
    found: dict[str, list[str]] = {}
    for path in wheels:
        name, version = wheel_name(path)
        found.setdefault(name, []).append(version)
        tags = path.name[: -len(".whl")].split("-")[-3:]
        if not (tags[0] in ("py3", "cp312", "py312") and tags[2] == "any" or "x86_64" in tags[2]):
            problems.append(f"{path.name}: not for CPython 3.12 on x86_64 Linux")
    for name, versions in found.items():
        if name not in want:
            problems.append(f"{name} {versions}: not in wheels.txt")
        elif versions != [want[name]]:
            problems.append(f"{name}: found {versions}, wheels.txt pins {want[name]}")
        if name in device:
            problems.append(f"{name}: already on the GPU machine (device-packages.txt)")
    problems += [f"{name}=={v}: missing" for name, v in want.items() if name not in found]
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if total > LIMIT:
        problems.append(f"{total / 2**20:.1f} MiB in {folder}: over the 64 MiB that travels")
    return problems


def download(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    argv += ["-d", str(folder)] + [f"{n}=={v}" for n, v in pins().items()]
    subprocess.run(argv, check=True)


def report(folder: Path) -> int:
    problems = check(folder)
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    for path in sorted(folder.glob("*.whl")):
        print(f"  {path.stat().st_size / 2**20:6.2f} MiB  {path.name}")
    print(f"{len(list(folder.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB (limit 64 MiB)")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def extras() -> list[str]:
    """This Python's distributions that the GPU machine does not have (the dry run removes
    them from its virtualenv, so that an import the machine would miss fails here too)."""
    from importlib import metadata

    device = device_packages() | {"pip"}
    names = {norm(d.metadata["Name"]) for d in metadata.distributions()}
    return sorted(n for n in names if n not in device and n not in pins())


def imports() -> int:
    """Import every package the wheels bring (and tl_dynamics with them); none of ``ABSENT``
    may come with them."""
    import importlib

    for module in list(MODULES.values()) + ["tl_dynamics", "tl_dynamics.report"]:
        importlib.import_module(module)
    loaded = sorted(m for m in ABSENT if m in sys.modules)
    print(f"imported {', '.join(MODULES.values())}; absent {', '.join(ABSENT)}: {loaded or 'yes'}")
    return 1 if loaded else 0


def main() -> int:
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    if verb == "download" and len(sys.argv) == 3:
        download(Path(sys.argv[2]))
        return report(Path(sys.argv[2]))
    if verb == "check" and len(sys.argv) == 3:
        return report(Path(sys.argv[2]))
    if verb == "extras":
        print("\n".join(extras()))
        return 0
    if verb == "imports":
        return imports()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
