"""``make test-stress`` (issue 49): the tests that once assumed an idle machine, run several times
beside CPU hogs that keep every core busy.

    python scripts/stress.py [--runs 5] [--hogs N] [--] PYTEST-ARGUMENTS...

Starts N hogs (default: one per core this process may use; each a Python busy loop at this
process's priority, so they compete with the tests as other work would), runs ``python -m pytest
PYTEST-ARGUMENTS`` RUNS times one after another beside them, and ends the hogs however it ends:
a normal end, an error, Ctrl-C or SIGTERM (a hog whose parent is gone ends itself, so SIGKILL of
this script leaves none either). Prints each run's counts and time and the total, and exits 0
only when every run passed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# A busy loop that ends once its parent (this script) is gone.
HOG = """import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def counts(report: Path) -> str:
    """``P passed, S skipped, F failed`` from a pytest JUnit report ("no report" without one)."""
    try:
        suite = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return "no report"
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    if suite is None:
        return "no report"
    n = {k: int(suite.get(k, 0)) for k in ("tests", "skipped", "failures", "errors")}
    passed = n["tests"] - n["skipped"] - n["failures"] - n["errors"]
    return f"{passed} passed, {n['skipped']} skipped, {n['failures'] + n['errors']} failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="pytest runs, one after another")
    parser.add_argument("--hogs", type=int, default=None, help="busy loops (default: one a core)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if args.runs < 1 or (args.hogs is not None and args.hogs < 0):
        parser.error("--runs must be at least 1 and --hogs at least 0")

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    hogs = start_hogs(cores() if args.hogs is None else args.hogs)
    passed, began = 0, time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as folder:
            for run in range(1, args.runs + 1):
                report = Path(folder) / f"run-{run}.xml"
                start = time.monotonic()
                command = [sys.executable, "-m", "pytest", f"--junitxml={report}", *pytest_args]
                code = subprocess.run(command).returncode
                ended = [h.pid for h in hogs if h.poll() is not None]
                if ended:
                    raise SystemExit(f"stress: the hogs {ended} ended early: not a loaded run")
                if code in (4, 5):  # pytest's usage error, or no tests: no run will differ
                    raise SystemExit(f"stress: pytest exit {code}: check the tests named")
                passed += code == 0
                verdict = "passed" if code == 0 else f"FAILED (pytest exit {code})"
                print(
                    f"stress: run {run} of {args.runs} {verdict}: {counts(report)} in "
                    f"{time.monotonic() - start:.0f} s beside {len(hogs)} CPU hogs (load average "
                    f"{os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        stop_hogs(hogs)
    print(f"stress: {passed} of {args.runs} runs passed, {time.monotonic() - began:.0f} s in all")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
