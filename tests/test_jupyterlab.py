"""Notebooks render in a real JupyterLab: a server on localhost, the notebook opened in headless
Debian chromium, every cell run from the UI, and then every view has drawn (canvases painted,
circuitsvis components mounted), with no page error, no error output and no request that
leaves the machine. Views share one circuitsvis bundle per kernel session, so this is also the
check that later outputs find the bundle an earlier one sent.

Where this test runs, it is the notebooks' one execution in the session (``test_notebooks``
skips the ones run here: ``conftest.py``). Cost on the 2-core development machine: the nine
notebooks of ``.venv`` in about 280 s of one worker (real_model.ipynb 62 s, attractors.ipynb 49 s;
server and kernel start, the cells, the drawing).
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from helpers import SMOLLM2, notebook_params

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
pytestmark = [
    pytest.mark.browser,
    pytest.mark.notebook,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium is not installed"),
]
playwright = pytest.importorskip("playwright.sync_api", reason="playwright-python not installed")
pytest.importorskip("jupyterlab", reason="jupyterlab is part of the test extra")
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
# JupyterLab settings: every cell stays in the page (no windowing), no news or update checks.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}
RUN_ALL = """async () => {
  const app = window.jupyterapp, panel = app.shell.currentWidget;
  await panel.context.ready; await panel.sessionContext.ready;
  for (const cell of panel.content.widgets) {  // committed outputs and counts go first
    if (cell.model.type !== 'code') continue;
    cell.model.outputs.clear(); cell.model.executionCount = null;
  }
  await app.commands.execute('notebook:run-all-cells');
}"""
# Done when the kernel is idle with no cell queued, and every cell ran or one failed (run-all
# stops at an error, leaving the later cells unrun: the error is then reported at once).
DONE = """() => {
  const panel = window.jupyterapp.shell.currentWidget, kernel = panel.sessionContext.session?.kernel;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  const queued = cells.some(c => c.node.querySelector('.jp-InputArea-prompt')?.textContent.includes('*'));
  const failed = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
  return kernel && kernel.status === 'idle' && !queued
    && (failed || cells.every(c => c.model.executionCount !== null));
}"""
OUTPUTS = """() => {
  const panel = window.jupyterapp.shell.currentWidget, out = {errors: [], views: 0, html: 0};
  for (const cell of panel.content.widgets) {
    if (cell.model.type !== 'code') continue;
    for (const o of cell.model.outputs.toJSON()) {
      if (o.output_type === 'error') out.errors.push(o.ename + ': ' + o.evalue);
      const html = o.data && o.data['text/html'];
      const text = html ? [].concat(html).join('') : '';
      out.views += text.split('class="tld-view"').length - 1;  // drawn by the runtime
      out.html += text.split('class="tld-html"').length - 1;   // tables, SVG plots, images
    }
  }
  return out;
}"""
VIEWS = "[...document.querySelectorAll('.jp-OutputArea .tld-view')]"
HTML = """() => [...document.querySelectorAll('.jp-OutputArea .tld-html')].map(d => ({
  text: d.innerText.length, svg: d.querySelectorAll('svg').length,
  images: [...d.querySelectorAll('img')].map(i => i.complete ? i.naturalWidth : 0)}))"""
PROBE = f"""() => {VIEWS}.map(d => ({{
  state: d.dataset.state, text: d.innerText.slice(0, 200), children: d.children.length,
  painted: [...d.querySelectorAll('canvas')].map(c => {{
    const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0; for (let i = 0; i < data.length; i += 4) if (data[i] < 250 || data[i + 1] < 250) n++;
    return n / Math.max(1, data.length / 4); }})}}))"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost serving a fresh folder; yields (url, token, folder)."""
    folder = tmp_path_factory.mktemp("lab")
    settings = folder / ".settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        JUPYTER_RUNTIME_DIR=str(folder / ".runtime"),
        HF_HUB_OFFLINE="1",
        JUPYTER_PLATFORM_DIRS="1",
        TL_DYNAMICS_SMOLLM2=str(SMOLLM2),  # real_model.ipynb runs in a copy, away from ../.models
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={folder}",
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={folder / '.workspaces'}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--LabApp.extension_manager=readonly",
            "--ServerApp.open_browser=False",
        ]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        env=env,
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=(folder / "server.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail((folder / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start in 120 s")
        yield url, token, folder
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield instance
        instance.close()


@pytest.mark.parametrize("path", notebook_params(NOTEBOOKS))
def test_notebook_views_draw_in_jupyterlab(lab, browser, path):
    url, token, folder = lab
    shutil.copy(path, folder / path.name)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors, outside = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on(
        "request",
        lambda r: (
            urlparse(r.url).hostname not in ("127.0.0.1", "localhost")
            and r.url.split(":")[0] not in ("data", "blob")
            and outside.append(r.url)
        ),
    )
    page.goto(f"{url}/lab/tree/{path.name}?token={token}&reset")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.content",
        timeout=120_000,
    )
    page.evaluate(RUN_ALL)
    page.wait_for_function(DONE, timeout=480_000, polling=1000)
    outputs = page.evaluate(OUTPUTS)
    assert outputs["errors"] == [] and outputs["views"] + outputs["html"] > 0, outputs
    count = page.evaluate(f"{VIEWS}.length")
    assert count == outputs["views"]  # every view output is in the page, its scripts ran
    html = page.evaluate(HTML)
    assert len(html) == outputs["html"]
    assert all(h["text"] or h["svg"] or h["images"] for h in html), html  # not empty
    assert all(w > 0 for h in html for w in h["images"]), html  # every image decoded
    for i in range(count):
        page.evaluate(f"{VIEWS}[{i}].scrollIntoView()")
        page.wait_for_function(
            f"() => ['done', 'error'].includes({VIEWS}[{i}].dataset.state)", timeout=60_000
        )
    page.wait_for_timeout(500)  # React commits asynchronously
    views = page.evaluate(PROBE)
    print(f"{path.stem}: {len(views)} views drawn, {len(html)} static views")
    page.close()
    assert [v["text"] for v in views if v["state"] != "done"] == []
    assert all(v["children"] >= 1 for v in views)
    assert all(min(v["painted"]) > 0 for v in views if v["painted"]), views
    assert errors == [] and outside == []
