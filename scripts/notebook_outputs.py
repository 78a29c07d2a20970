"""Execute the notebooks and keep their outputs as static images, for viewers that cannot run
scripts (GitHub, an untrusted notebook in JupyterLab).

    .venv/bin/python scripts/notebook_outputs.py [notebooks/x.ipynb ...] [--budget-mb 3]
    .venv-tl3/bin/python scripts/notebook_outputs.py notebooks/sae.ipynb   # needs sae-lens

Each notebook is executed offline (nbclient, as ``tests/test_notebooks.py`` does); then every
output that holds tl_dynamics views is opened in headless Debian chromium (playwright, no
browser download), each view is drawn by the page's runtime and photographed, and the output's
HTML is rewritten without scripts: each view's placeholder holds its picture, SVG plots, tables
and figures stay as they are; warnings on stderr are dropped. Re-running a cell brings the
interactive view back. A notebook
over the budget is reported and the command exits 1 (``tests/test_notebook_outputs.py`` holds
committed notebooks to the same budget).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_MB = 3.0
VIEW = re.compile(r'(<div class="tld-view" id="([\w-]+)"[^>]*>)(</div>)')
SCRIPT = re.compile(r"<script\b.*?</script>", re.DOTALL | re.IGNORECASE)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]


def execute(path: Path):
    """The notebook executed top to bottom in a scratch folder (offline), with its outputs."""
    import nbclient
    import nbformat

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the kernel imports this checkout's tl_dynamics, whatever the environment has installed
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        nbclient.NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": scratch}},
        ).execute()
    return notebook


def frozen(html: str, tab, shell: str) -> str:
    """``html`` (one output) drawn in ``tab`` and rewritten without scripts: each view's
    placeholder holds a PNG of what the runtime drew there."""
    tab.set_content(shell.replace("{{body}}", html))
    views = "[...document.querySelectorAll('.tld-view')]"
    shots = {}
    for i in range(tab.evaluate(f"{views}.length")):
        tab.evaluate(f"{views}[{i}].scrollIntoView()")
        tab.wait_for_function(
            f"() => ['done', 'error'].includes({views}[{i}].dataset.state)", timeout=60_000
        )
        tab.wait_for_timeout(150)  # React commits asynchronously
        element = tab.locator(".tld-view").nth(i)
        shots[tab.evaluate(f"{views}[{i}].id")] = base64.b64encode(element.screenshot()).decode()

    def picture(match: re.Match) -> str:
        data = shots.get(match.group(2))
        img = (
            f'<img class="tld-static" alt="view (re-run the cell to interact)" '
            f'src="data:image/png;base64,{data}">'
            if data
            else ""
        )
        opening = re.sub(r' style="min-height:\d+px"', "", match.group(1))  # a placeholder's
        return opening + img + match.group(3)

    return VIEW.sub(picture, SCRIPT.sub("", html))


def freeze(notebook) -> int:
    """Rewrite every output with tl_dynamics views in place; returns how many were rewritten."""
    import circuitsvis
    from playwright.sync_api import sync_playwright

    from tl_dynamics import viz

    style = re.search(r"<style>.*?</style>", viz.Page("x").to_html(), re.DOTALL).group(0)
    bundle = (Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js").read_text("utf-8")
    shell = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'>{style}<script>"
        + bundle.replace("</script", "<\\/script")
        + "</script></head><body>{{body}}</body></html>"
    )
    for cell in notebook.cells:  # the environment's warnings (e.g. tqdm without ipywidgets)
        if "outputs" in cell:
            cell["outputs"] = [o for o in cell["outputs"] if o.get("name") != "stderr"]
    count = 0
    chromium = os.environ.get("TL_DYNAMICS_CHROMIUM") or shutil.which("chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        tab = browser.new_page(viewport={"width": 1100, "height": 1000})
        for cell in notebook.cells:
            for output in cell.get("outputs", []):
                html = output.get("data", {}).get("text/html")
                if html is None:
                    continue
                text = "".join(html) if isinstance(html, list) else html
                if "tld-view" in text or "TLD.start" in text:
                    output["data"]["text/html"] = frozen(text, tab, shell)
                    count += 1
        browser.close()
    return count


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--budget-mb", type=float, default=BUDGET_MB)
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    over = []
    for path in paths:
        meta = nbformat.read(path, as_version=4).metadata.get("tl_dynamics", {})
        missing = [m for m in meta.get("requires", []) if importlib.util.find_spec(m) is None]
        if missing:  # e.g. sae.ipynb in .venv: sae-lens needs TransformerLens 3.x (.venv-tl3)
            print(f"{path}: skipped, needs {', '.join(missing)} ({meta.get('why', '')})")
            continue
        notebook = execute(path)
        n = freeze(notebook)
        nbformat.write(notebook, path)
        size = path.stat().st_size / 1e6
        print(f"{path}: {n} outputs frozen, {size:.2f} MB")
        if size > args.budget_mb:
            over.append(f"{path} ({size:.2f} MB)")
    if over:
        print(f"over the {args.budget_mb} MB budget: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
