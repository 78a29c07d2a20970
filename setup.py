"""Build hook: the wheel carries docs/math.md (the one source of the maths reference) as
package data, tl_dynamics/data/math.md, so `tl_dynamics.docs` and report pages have it outside
a checkout. Everything else about the package is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

MATH = Path(__file__).resolve().parent / "docs" / "math.md"


class BuildWithMath(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "tl_dynamics" / "data" / "math.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(MATH, target)


setup(cmdclass={"build_py": BuildWithMath})
