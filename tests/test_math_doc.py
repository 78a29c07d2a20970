"""``docs/math.md`` is the project's maths reference: every citation of it names a section that
exists, it is cited by its repository path, and nothing cites material outside the repository.

Scanned: the library (``tl_dynamics/**/*.py``), the notebooks' cell sources, ``README.md`` and
``docs/**/*.md`` (``docs/math.md`` included, for its own cross-references).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATH = ROOT / "docs" / "math.md"

SECTION = re.compile(r"^## (\d+)\. \S", re.MULTILINE)  # "## 2. The odds-ratio split"
SUBSECTION = re.compile(r"^### (\d+)\.(\d+) \S", re.MULTILINE)  # "### 2.3 Sink statistics"
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)?)")  # "§2" or "§2.3"
MENTION = re.compile(r"(?P<path>[\w./-]*)math\.md`?(?P<after>[^\n]{0,24})")
SECTION_IN_WORDS = re.compile(r"^[\s\"'`,;:(]*(section|sec\.|chapter)\b", re.IGNORECASE)
# The file itself named in code, e.g. ``ROOT / "docs" / "math.md"``: a path, not a citation.
PATH_IN_CODE = re.compile(r"""["']docs["']\s*/\s*["']$""")
# Material that lives outside this repository (the workspace's shared notes and source texts).
OUTSIDE = {
    "the shared folder": re.compile(r"shared folder", re.IGNORECASE),
    "a seed document": re.compile(r"\bseeds? 0\d\d\b", re.IGNORECASE),
    "host-surface.md": re.compile(r"host-surface", re.IGNORECASE),
    "a path outside the repository": re.compile(r"\.\./shared|/work/shared|\bseeds/"),
}


# Where each part of the library and each notebook has its definitions (docs/math.md's parts);
# §1 (the score, masks, rotary) and §7 (tolerances) may be cited from anywhere.
HOME = {
    "tl_dynamics/odds_ratio/": {"2"},
    "notebooks/odds_ratio.ipynb": {"2"},
    "tl_dynamics/contextual_mlp/": {"3"},
    "notebooks/contextual_mlp.ipynb": {"3"},
    "tl_dynamics/circuits/": {"4"},
    "notebooks/circuits.ipynb": {"4"},
    "tl_dynamics/trajectories/": {"5", "6"},
    "notebooks/attractors.ipynb": {"5", "6"},
    "tl_dynamics/sphere.py": {"5", "6"},
    "tl_dynamics/particles/": {"5", "6"},
    "notebooks/particles.ipynb": {"6"},
    "tl_dynamics/regression/": {"8"},
    "notebooks/regression.ipynb": {"8"},
    "tl_dynamics/qk_attribution/": {"10"},
    "notebooks/qk_attribution.ipynb": {"10"},
}
ANYWHERE = {"1", "7", "9"}  # notation, tolerances and the evidence rule every label follows


def sections(text: str) -> set[str]:
    """Section numbers of a maths reference: ``"2"`` for ``## 2.``, ``"2.3"`` for ``### 2.3``."""
    return {m.group(1) for m in SECTION.finditer(text)} | {
        f"{m.group(1)}.{m.group(2)}" for m in SUBSECTION.finditer(text)
    }


def scanned_files() -> list[Path]:
    files = sorted((ROOT / "tl_dynamics").rglob("*.py"))
    files += sorted((ROOT / "notebooks").glob("*.ipynb"))
    files += [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def text_of(path: Path) -> str:
    """A file's text; for a notebook, its cells' sources (outputs are generated, not written)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return raw
    cells = json.loads(raw)["cells"]
    return "\n".join("".join(cell.get("source", [])) for cell in cells)


def problems(name: str, text: str, known: set[str]) -> list[str]:
    """Every bad citation in ``text`` as ``"name:line: what"``."""
    found = []

    def where(pos: int) -> str:
        return f"{name}:{text.count(chr(10), 0, pos) + 1}"

    for m in CITATION.finditer(text):
        if m.group(1) not in known:
            found.append(
                f"{where(m.start())}: cites §{m.group(1)}, which docs/math.md does not have"
            )
    for m in MENTION.finditer(text):
        if PATH_IN_CODE.search(text[max(0, m.start() - 16) : m.start()]):
            continue
        if m.group("path") != "docs/":
            found.append(
                f"{where(m.start())}: cite the maths reference by its path, "
                f"'docs/math.md', not {m.group(0).strip()!r}"
            )
        if SECTION_IN_WORDS.match(m.group("after")):
            found.append(
                f"{where(m.start())}: cite a section as 'docs/math.md §N' or "
                f"'docs/math.md §N.M', not {m.group(0).strip()!r}"
            )
    for what, pattern in OUTSIDE.items():
        for m in pattern.finditer(text):
            found.append(
                f"{where(m.start())}: cites {what} ({m.group(0)!r}), which is outside "
                "the repository"
            )
    return found


def test_math_reference_exists_with_numbered_sections_in_order():
    text = MATH.read_text(encoding="utf-8")
    tops = [int(m.group(1)) for m in SECTION.finditer(text)]
    assert tops == list(range(1, len(tops) + 1)) and len(tops) >= 7, tops
    subs = [(int(m.group(1)), int(m.group(2))) for m in SUBSECTION.finditer(text)]
    for top in tops:
        numbers = [s for t, s in subs if t == top]
        assert numbers == list(range(1, len(numbers) + 1)), (top, numbers)
    assert {t for t, _ in subs} <= set(tops)


def test_the_checker_flags_each_kind_of_bad_citation():
    """The checks below can fail: each kind of mistake is caught, good citations pass."""
    known = {"2", "2.3"}
    good = "see docs/math.md §2.3 and `docs/math.md` §2; the reference is docs/math.md."
    assert problems("good", good, known) == []
    bad = {
        "docs/math.md §9": "§9",
        "docs/math.md §2.7": "§2.7",
        "(math.md §2)": "by its path",
        "docs/math.md section 2": "not 'docs/math.md section",
        "docs/host-surface.md in the shared folder": "shared folder",
        "as in seed 000": "seed document",
        "see ../shared/docs": "outside the repository",
    }
    for text, message in bad.items():
        found = problems("bad", text, known)
        assert found and any(message in p for p in found), (text, found)
    assert problems("bad", "a\nb docs/math.md §9", known)[0].startswith("bad:2:")
    assert problems("code", 'MATH = ROOT / "docs" / "math.md"', known) == []


def test_every_maths_citation_resolves_and_nothing_cites_outside_the_repository():
    known = sections(MATH.read_text(encoding="utf-8"))
    files = scanned_files()
    assert MATH in files and any(f.suffix == ".ipynb" for f in files)
    found = [p for f in files for p in problems(str(f.relative_to(ROOT)), text_of(f), known)]
    assert not found, "\n".join(found)


def misplaced(name: str, text: str) -> list[str]:
    """Citations from a package or notebook to a part of docs/math.md that is not its own."""
    home = next((parts for prefix, parts in HOME.items() if name.startswith(prefix)), None)
    if home is None:
        return []
    return [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: cites §{m.group(1)}, but its "
        f"definitions are in §{' or §'.join(sorted(home))} of docs/math.md"
        for m in CITATION.finditer(text)
        if m.group(1).split(".")[0] not in home | ANYWHERE
    ]


def test_each_package_and_notebook_cites_its_own_part_of_the_reference():
    assert misplaced("tl_dynamics/circuits/_x.py", "docs/math.md §4.2 and §1.5") == []
    assert misplaced("notebooks/circuits.ipynb", "`docs/math.md` §3")  # the part before
    found = [p for f in scanned_files() for p in misplaced(str(f.relative_to(ROOT)), text_of(f))]
    assert not found, "\n".join(found)
