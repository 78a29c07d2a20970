"""The wheelhouse for the air-gapped GPU machine (issues 33, 34), and the checks of it.

    python benchmarks/gpu/wheels.py download .gpu-wheels   # `make gpu-wheels`: fetch, then check
    python benchmarks/gpu/wheels.py check .gpu-wheels      # exactly wheels.txt, <= 64 MiB, 3.12
    python benchmarks/gpu/wheels.py unpack .gpu-wheels SITE  # the trimmed archives into SITE
    python benchmarks/gpu/wheels.py extras                 # this Python's packages the GPU lacks
    python benchmarks/gpu/wheels.py imports [MODULE ...]   # import what the wheels bring

``wheels.txt`` names what the machine lacks; ``device-packages.txt`` what it has (the device tool's
KINDS.md). Every wheel is fetched with ``--no-deps`` for CPython 3.12 on manylinux x86_64, so that
``pip install --no-index --no-deps --target`` there needs nothing else. A package of ``TRIM``
(Ray: its wheel alone is 79 MB) travels instead as its wheel unpacked, less the folders ``TRIM``
names, in a ``.tar.xz`` named after the wheel; ``unpack`` extracts it into the same site folder.
"""

from __future__ import annotations

import calendar
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
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
    # Ray (tests/test_scale_ray.py's GPU test), and what it needs that the machine lacks
    "ray": "ray",
    "jsonschema": "jsonschema",
    "jsonschema-specifications": "jsonschema_specifications",
    "referencing": "referencing",
    "rpds-py": "rpds",
}
# imported too: Ray Data (tl_dynamics.scale.ray_stats), tl_dynamics itself
MORE_MODULES = ("ray.data", "tl_dynamics", "tl_dynamics.report")
# travel unpacked and trimmed (a .tar.xz): what each leaves out, none of it used by a local
# cluster's actors and Ray Data's reading and mapping (benchmarks/gpu/ray_smoke.py runs them
# without it; benchmarks/README.md "GPU check" has the sizes)
TRIM = {
    "ray": (
        "ray/jars/",  # 33 MB: the Java workers (cross-language calls)
        "ray/rllib/",  # reinforcement learning
        "ray/serve/",  # model serving (imported by serve's own dashboard handlers, lazily)
        "ray/llm/",  # LLM serving and batch inference (ray.data.llm imports it on use)
        "ray/dashboard/client/build/",  # the dashboard's web page (include_dashboard=False)
    ),
}
ARCHIVE = ".tar.xz"
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
    """``(name, version)`` of a wheel file (``name-version-tags.whl``) or of a trimmed
    archive (``name-version-tags.tar.xz``)."""
    name, version = path.name.split("-")[:2]
    return norm(name), version


def _tags(path: Path) -> list[str]:
    stem = path.name[: -len(ARCHIVE)] if path.name.endswith(ARCHIVE) else path.stem
    return stem.split("-")[-3:]


def carried(folder: Path) -> list[Path]:
    """The wheels and trimmed archives in ``folder``."""
    return sorted([*folder.glob("*.whl"), *folder.glob("*" + ARCHIVE)])


def tree_size(root: Path = HERE.parent.parent) -> int | None:
    """Bytes of the files that travel with the repository besides the wheelhouse (tracked and
    untracked-not-ignored, as ``git ls-files`` lists them); None where git cannot tell."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = {root / p for p in out.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def check(folder: Path) -> list[str]:
    """What is wrong with the wheelhouse in ``folder`` (empty: nothing): every pin of
    ``wheels.txt`` once, nothing else, nothing the machine has, wheels for CPython 3.12 on
    x86_64 Linux, at most 64 MiB in all."""
    want, device = pins(), device_packages()
    problems = []
    found: dict[str, list[str]] = {}
    for path in carried(folder):
        name, version = wheel_name(path)
        found.setdefault(name, []).append(version)
        tags = _tags(path)
        if not (tags[0] in ("py3", "cp312", "py312") and tags[2] == "any" or "x86_64" in tags[2]):
            problems.append(f"{path.name}: not for CPython 3.12 on x86_64 Linux")
        if path.name.endswith(ARCHIVE) != (name in TRIM):
            how = "trimmed, as a " + ARCHIVE if name in TRIM else "as a wheel"
            problems.append(f"{path.name}: {name} travels {how} (wheels.py TRIM)")
    for name, versions in found.items():
        if name not in want:
            problems.append(f"{name} {versions}: not in wheels.txt")
        elif versions != [want[name]]:
            problems.append(f"{name}: found {versions}, wheels.txt pins {want[name]}")
        if name in device:
            problems.append(f"{name}: already on the GPU machine (device-packages.txt)")
    problems += [f"{name}=={v}: missing" for name, v in want.items() if name not in found]
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    tree = tree_size() or 0  # the repository travels too
    if total + tree > LIMIT:
        problems.append(
            f"{total / 2**20:.1f} MiB in {folder} and {tree / 2**20:.1f} MiB of repository: "
            "over the 64 MiB that travels"
        )
    return problems


def _pip_download(folder: Path, names: list[str]) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    subprocess.run(argv + ["-d", str(folder)] + names, check=True)


def download(folder: Path, trimmed: bool = True) -> None:
    """Every pin of ``wheels.txt`` into ``folder``: the wheels, then (``trimmed``) each package
    of ``TRIM`` as its trimmed archive (its wheel downloaded elsewhere, then left there)."""
    folder.mkdir(parents=True, exist_ok=True)
    pinned = pins()
    _pip_download(folder, [f"{n}=={v}" for n, v in pinned.items() if n not in TRIM])
    if not trimmed:
        return
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download(Path(tmp), [f"{n}=={v}" for n, v in pinned.items() if n in TRIM])
        for wheel in sorted(Path(tmp).glob("*.whl")):
            trim(wheel, folder)


def trim(wheel: Path, folder: Path) -> Path:
    """``wheel`` as pip would unpack it, less the folders ``TRIM`` names for it, as
    ``folder/<the wheel's name>.tar.xz`` (xz -6; the same bytes from the same wheel: entries
    sorted, times the wheel's, no owner). Its dist-info gets ``TRIMMED``: what was left out."""
    name, version = wheel_name(wheel)
    drop = TRIM[name]
    out = folder / (wheel.name[: -len(".whl")] + ARCHIVE)
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=6) as tar:
        entries = sorted(zf.infolist(), key=lambda e: e.filename)
        dist_info = next(e.filename.split("/")[0] for e in entries if ".dist-info/" in e.filename)
        for entry in entries:
            if entry.is_dir() or entry.filename.startswith(drop):
                continue
            info = tarfile.TarInfo(entry.filename)
            info.size = entry.file_size
            info.mode = (entry.external_attr >> 16) & 0o777 or 0o644
            info.mtime = calendar.timegm((*entry.date_time, 0, 0, 0))
            with zf.open(entry) as data:
                tar.addfile(info, data)
        note = "".join(f"{d}\n" for d in drop).encode()
        info = tarfile.TarInfo(f"{dist_info}/TRIMMED")
        info.size, info.mode = len(note), 0o644
        info.mtime = calendar.timegm((*entries[0].date_time, 0, 0, 0))
        tar.addfile(info, io.BytesIO(note))
    kept = sum(e.file_size for e in entries if not e.filename.startswith(drop))
    print(
        f"{wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB) -> {out.name}: "
        f"{kept / 2**20:.1f} MiB unpacked, {out.stat().st_size / 2**20:.1f} MiB; "
        f"left out {', '.join(drop)}"
    )
    return out


def unpack(folder: Path, site: Path) -> int:
    """Extract every trimmed archive in ``folder`` into ``site`` (after the wheels' install)."""
    archives = sorted(folder.glob("*" + ARCHIVE))
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="data")
        print(f"unpacked {archive.name} into {site}")
    return 0 if archives or not TRIM else 1


def report(folder: Path) -> int:
    problems = check(folder)
    paths = carried(folder)
    total = sum(p.stat().st_size for p in paths)
    for path in paths:
        print(f"  {path.stat().st_size / 2**20:6.2f} MiB  {path.name}")
    tree = tree_size()
    with_tree = "" if tree is None else f"; with the repository {(total + tree) / 2**20:.1f} MiB"
    print(f"{len(paths)} files, {total / 2**20:.1f} MiB{with_tree} (limit 64 MiB)")
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


def imports(modules: list[str] | None = None) -> int:
    """Import ``modules`` (default: every package the wheels bring, Ray Data and tl_dynamics),
    each named with its failure if it fails; none of ``ABSENT`` may come with them."""
    import importlib

    modules = modules or [*MODULES.values(), *MORE_MODULES]
    failed = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # every failure named, not only the first
            failed.append(module)
            print(f"FAILED import {module}: {type(exc).__name__}: {exc}", file=sys.stderr)
    ok = [m for m in modules if m not in failed]
    if "ray" in ok:
        ray = sys.modules["ray"]
        print(f"ray {ray.__version__} from {Path(ray.__file__).parent}")
    loaded = sorted(m for m in ABSENT if m in sys.modules)
    print(f"imported {', '.join(ok)}; absent {', '.join(ABSENT)}: {loaded or 'yes'}")
    return 1 if loaded or failed else 0


def main() -> int:
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    if verb == "download" and len(sys.argv) == 3:
        download(Path(sys.argv[2]))
        return report(Path(sys.argv[2]))
    if verb == "check" and len(sys.argv) == 3:
        return report(Path(sys.argv[2]))
    if verb == "unpack" and len(sys.argv) == 4:
        return unpack(Path(sys.argv[2]), Path(sys.argv[3]))
    if verb == "extras":
        print("\n".join(extras()))
        return 0
    if verb == "imports":
        return imports(sys.argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
