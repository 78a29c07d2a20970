"""Citations that resolve anywhere: the package ships docs/math.md (one source, copied into the
wheel), ``tl_dynamics.docs.math`` returns its sections, and report pages carry the sections
they cite, collapsed, with every "§N" linked to them inside the page."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tl_dynamics import TLDynamicsError, docs, report, testing, viz
from tl_dynamics.viz import _cite
from tl_dynamics.viz import _page

ROOT = Path(__file__).resolve().parent.parent
MATH = ROOT / "docs" / "math.md"
LINK = re.compile(r'<a class="tld-cite" href="#(math-[\d-]+)">§(\d+(?:\.\d+)?)</a>')
# Scripts (data), SVG figures and the carried sections' own headings are not citations.
BLOCKS = re.compile(r"<script\b.*?</script>|<svg\b.*?</svg>|<summary>.*?</summary>", re.DOTALL)


def test_math_sections_are_the_text_of_docs_math_md():
    text = MATH.read_text(encoding="utf-8")
    assert docs.source() == MATH and docs.math() == text  # a checkout reads the file itself
    part = docs.math("2.3")
    start = text.index("### 2.3 Sink statistics")
    assert part == text[start : text.index("### 2.4 ")].rstrip() + "\n"
    assert docs.math("§2.3") == docs.math(" 2.3 ") == part
    whole = docs.math(2)
    assert whole.startswith("## 2. The odds-ratio split") and "### 2.5 " in whole
    assert "## 3. " not in whole
    assert part._repr_markdown_() == str(part)  # a notebook renders it as markdown
    with pytest.raises(
        TLDynamicsError,
        match=r"docs/math.md has no §12; valid: 1, 2, 3, 4, 5, "
        r"6, 7, 8, 9, 10, 11 and their numbered subsections, e\.g\. '2\.3'",
    ):
        docs.math("12")


def test_the_wheel_carries_docs_math_md_byte_for_byte(tmp_path):
    # built offline, with this environment's setuptools (pyproject.toml needs 77 or newer)
    pytest.importorskip("setuptools", minversion="77", reason="setuptools >= 77 builds the wheel")
    src = tmp_path / "src"
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name if src.exists() else (src.mkdir() or src / name))
    (src / "docs").mkdir()
    shutil.copy(MATH, src / "docs" / "math.md")
    shutil.copytree(
        ROOT / "tl_dynamics",
        src / "tl_dynamics",
        ignore=shutil.ignore_patterns("__pycache__", "math.md"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("tl_dynamics/data/math.md") == MATH.read_bytes()
        assert "tl_dynamics/docs.py" in archive.namelist()


def test_markdown_renders_escaped_with_the_constructs_math_md_uses():
    html = _cite.markdown_html(
        "A **bold** `x<y*` and *it*.\n\n    r_ij = c <q, k>\n\n- one\n  more\n- two"
    )
    assert html == (
        "<p>A <b>bold</b> <code>x&lt;y*</code> and <i>it</i>.</p>\n"
        "<pre>r_ij = c &lt;q, k&gt;</pre>\n<ul><li>one more</li><li>two</li></ul>"
    )


def unlinked(html):
    """Known "§N" left as plain text (outside scripts, SVG and section headings)."""
    text = LINK.sub("", BLOCKS.sub("", html))
    known = set(docs.sections())
    return [
        m.group(0)
        for m in docs.CITATION.finditer(re.sub(r"<[^>]*>", "", text))
        if m.group(1) in known
    ]


def test_a_page_links_every_citation_to_the_sections_it_carries():
    page = viz.Page("cites")
    page.add_section(
        "A",
        [
            viz.text("the split (docs/math.md §2.1, §2.2) and §99"),
            viz.line_plot(["a"], {"§3": [1.0]}),
        ],
        intro="x",
        math="docs/math.md §4",
    )
    html = page.to_html()
    links = LINK.findall(html)
    assert {n for _, n in links} >= {"2.1", "2.2", "4"} and unlinked(html) == []
    ids = re.findall(r'<details class="tld-math" id="([^"]+)">', html)
    targets = set(re.findall(r'id="(math-[\d-]+)"', html))
    assert {a for a, _ in links} <= targets  # every link resolves inside the page
    expected = _cite.closure(["4", "2.1", "2.2"], docs.sections())
    blocks = [n for n in expected if "." not in n or n.split(".")[0] not in expected]
    assert ids == [_cite.anchor(n) for n in blocks] and {"math-4", "math-2-1"} <= set(ids)
    # a subsection of a carried section is read inside it (its heading has the id), not repeated
    assert "math-4-2" not in ids and '<h5 id="math-4-2">4.2 Rotary offsets</h5>' in html
    assert len(targets) == len(re.findall(r'id="math-[\d-]+"', html))  # no id twice
    assert "§99" in html and "#math-99" not in html  # not a section: left as written
    assert '<details class="tld-math" id="math-2-1"><summary>docs/math.md §2.1 The split' in html
    assert "open" not in re.search(r"<details[^>]*>", html).group(0)  # collapsed
    assert "file://" not in html and 'href="#tld-maths-cited"' in html  # in the contents
    assert (
        viz.Page("none", sections=[_page.Section("A", [viz.text("no cites")])])
        .to_html()
        .count('class="tld-math"')
        == 0
    )


def test_the_report_carries_what_it_cites():
    page = report.build_report(testing.tiny_model("gpt2"), "a b a b", sections=(), threads=None)
    html = page.to_html()
    assert '(maths: docs/math.md <a class="tld-cite" href="#math-1-4">§1.4</a>)' in html
    assert 'id="math-1-4"' in html and unlinked(html) == []


@pytest.mark.browser
@pytest.mark.skipif(
    not os.path.exists(shutil.which("chromium") or "/usr/bin/chromium"),
    reason="Debian chromium not installed",
)
def test_following_a_citation_opens_its_section_in_the_browser(tmp_path):
    sync = pytest.importorskip("playwright.sync_api")
    page = viz.Page("cites")
    page.add_section("A", [viz.text("see docs/math.md §2.3; §4 and §4.2")])
    path = page.write(tmp_path / "p.html")
    with sync.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium",
            args=["--headless", "--no-sandbox", "--disable-gpu"],
        )
        tab = browser.new_page()
        errors, requests = [], []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.on("request", lambda r: requests.append(r.url))
        tab.goto(path.as_uri())
        assert tab.evaluate("document.getElementById('math-2-3').open") is False
        tab.click("section#a a.tld-cite")
        tab.wait_for_function("document.getElementById('math-2-3').open")
        assert "Sink statistics" in tab.inner_text("#math-2-3")
        assert tab.evaluate("document.getElementById('math-4').open") is False
        tab.click("section#a a.tld-cite[href='#math-4-2']")  # inside the carried §4
        tab.wait_for_function("document.getElementById('math-4').open")
        assert tab.is_visible("#math-4-2")
        browser.close()
    assert errors == [] and requests == [path.as_uri()]


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(docs)
    assert result.attempted > 0 and result.failed == 0
