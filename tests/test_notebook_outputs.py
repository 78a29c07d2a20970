"""Notebook outputs for viewers that cannot run scripts: ``scripts/notebook_outputs.py`` keeps
each view as a picture of what the runtime drew, with no script left; committed notebooks stay
under its size budget."""

import base64
import importlib.util
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
spec = importlib.util.spec_from_file_location(
    "notebook_outputs", ROOT / "scripts" / "notebook_outputs.py"
)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebooks_are_small_and_their_outputs_static(path):
    assert path.stat().st_size <= tool.BUDGET_MB * 1e6
    outputs = [o for c in json.loads(path.read_text())["cells"] for o in c.get("outputs", [])]
    html = ["".join(o.get("data", {}).get("text/html", "")) for o in outputs]
    assert [h for h in html if "<script" in h] == []  # frozen by scripts/notebook_outputs.py


@pytest.mark.browser
@pytest.mark.notebook
@pytest.mark.skipif(not shutil.which("chromium"), reason="Debian chromium not installed")
def test_freezing_keeps_a_picture_of_every_view_and_no_script(tmp_path):
    pytest.importorskip("playwright.sync_api")
    nbformat = pytest.importorskip("nbformat")
    from PIL import Image

    cells = [
        nbformat.v4.new_code_cell("from tl_dynamics import viz\nimport numpy as np"),
        nbformat.v4.new_code_cell("viz.heatmap(np.arange(6.0).reshape(2, 3), title='m')"),
        nbformat.v4.new_code_cell(
            "viz.group(viz.colored_tokens(['a', 'b'], [0.0, 1.0]),"
            " viz.line_plot(['x', 'y'], {'s': [0.0, 1.0]}))"
        ),
    ]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "n.ipynb"
    nbformat.write(notebook, path)
    os.environ.setdefault("TL_DYNAMICS_CHROMIUM", shutil.which("chromium"))
    executed = tool.execute(path)
    assert tool.freeze(executed) == 2
    html = [
        o["data"]["text/html"]
        for c in executed.cells
        for o in c.get("outputs", [])
        if "text/html" in o.get("data", {})
    ]
    assert len(html) == 2 and not any("<script" in h for h in html)
    pictures = re.findall(
        r'<div class="tld-view" id="[\w-]+"><img class="tld-static" alt="[^"]*" '
        r'src="data:image/png;base64,([^"]+)"></div>',
        "".join(html),
    )
    assert len(pictures) == 2  # the heat map and the coloured tokens; the SVG plot stays SVG
    assert "<svg" in html[1]
    for data in pictures:
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
        assert (np.abs(image.astype(int) - 255).sum(-1) > 30).mean() > 0.01  # not blank
