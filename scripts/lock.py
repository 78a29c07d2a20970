"""Lock files for the project's own environments, and the newest-release canary's report.

    python scripts/lock.py freeze VENV LOCKFILE   # write VENV's exact versions as LOCKFILE
    python scripts/lock.py diff VENV LOCKFILE     # print the packages whose version differs

``make lock`` resolves the newest releases into fresh environments (``.venv-latest``,
``.venv-latest-tl3``) and freezes them with ``freeze``; ``make setup``/``make test`` install
``pip install -c LOCKFILE``, so they get exactly those versions; ``make test-latest`` resolves
the newest releases again, prints ``diff`` against the locks, and runs the suite there.

A lock is ``pip freeze --all`` less the project itself, one ``name==version`` a line, after a
header saying when and on which Python it was made. torch keeps no local label (``+cpu``):
``torch==2.13.0`` is the CPU wheel the Makefile installs first (``TORCH``), and the pin then
matches it.
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

PROJECT = "tl-dynamics"
_LINE = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(venv: Path) -> dict[str, str]:
    """``{canonical name: version}`` of every package in ``venv`` but the project."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = {}
    for line in out.splitlines():
        match = _LINE.match(line.strip())
        if match and _canon(match.group(1)) != PROJECT:
            name, version = _canon(match.group(1)), match.group(2)
            pins[name] = version.split("+")[0] if name == "torch" else version
    return pins


def read_lock(path: Path) -> dict[str, str]:
    """The pins of a lock file (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _LINE.match(line.strip())
        if match:
            pins[_canon(match.group(1))] = match.group(2)
    return pins


def freeze(venv: Path, lock: Path) -> None:
    pins = installed(venv)
    python = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    head = [
        f"# {lock.name}: exact versions for {venv.name}, written by `make lock` on "
        f"{datetime.date.today().isoformat()}",
        f"# (Python {python}, {platform.system()} {platform.machine()}). The Makefile installs "
        "with `pip install -c` this file; do not edit by hand.",
    ]
    lock.parent.mkdir(parents=True, exist_ok=True)
    body = [f"{name}=={version}" for name, version in sorted(pins.items())]
    lock.write_text("\n".join(head + body) + "\n", encoding="utf-8")
    print(f"wrote {lock}: {len(body)} pins")


def diff(venv: Path, lock: Path) -> int:
    """Print every package whose newest-resolved version differs from the lock; return the
    number of differences."""
    now, locked = installed(venv), read_lock(lock)
    rows = []
    for name in sorted(set(now) | set(locked)):
        if now.get(name) != locked.get(name):
            rows.append(f"  {name}: lock {locked.get(name, '-')} -> newest {now.get(name, '-')}")
    print(f"{venv.name} against {lock}: {len(rows)} package(s) differ from the lock")
    print("\n".join(rows) if rows else "  (none)")
    return len(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("freeze", "diff"):
        print(__doc__, file=sys.stderr)
        return 2
    venv, lock = Path(argv[1]), Path(argv[2])
    if not (venv / "bin" / "python").exists():
        print(f"{venv} is not a virtual environment", file=sys.stderr)
        return 2
    if argv[0] == "freeze":
        freeze(venv, lock)
    else:
        diff(venv, lock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
