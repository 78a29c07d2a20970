"""Shared test set-up: offline, quiet, one intra-op thread, and no Ray process left when the suite
ends. Helpers shared by test modules (tiny models per architecture, host markers) live in
``tests/helpers.py``."""

import os
import uuid

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models: one intra-op thread is fastest and deterministic (on a loaded machine, threads
# waiting for each other make small matmuls far slower).
torch.set_num_threads(1)

# Every process the suite starts carries this in its environment (and so does everything those
# start): when the suite ends, none of them that is Ray's may still run (issue 49: three Ray
# dashboards outlived their clusters under the pytest process).
SUITE_MARK = f"TL_DYNAMICS_SUITE_{uuid.uuid4().hex}"
os.environ[SUITE_MARK] = "1"


@pytest.fixture(scope="session", autouse=True)
def no_ray_process_outlives_the_suite():
    yield
    from helpers import processes_left

    left = processes_left(SUITE_MARK, ray_only=True)
    assert not left, f"Ray processes the suite started still run after it: {left}"


def _skipped(item) -> bool:
    """Marked to skip (a ``skip`` or a ``skipif`` whose condition holds)."""
    if item.get_closest_marker("skip"):
        return True
    return any(bool(m.args and m.args[0]) for m in item.iter_markers("skipif"))


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` have deselected what they leave out
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers (``--dist loadgroup``): the tests
    that start Ray share one group, so one worker runs them in turn, beside one module-scoped
    cluster, and two clusters never start at once.

    A notebook that ``test_jupyterlab`` runs in this session is not executed a second time by
    ``test_notebooks`` (nbclient): JupyterLab runs every cell from its UI and fails on any error
    output, and then also checks the views draw. Where the JupyterLab test cannot run (no
    chromium, or not selected), nbclient executes every notebook as before."""
    in_lab = {
        item.callspec.id
        for item in items
        if item.originalname == "test_notebook_views_draw_in_jupyterlab" and not _skipped(item)
    }
    for item in items:
        if item.path.name == "test_scale_ray.py" or item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        if item.originalname == "test_notebook_executes" and item.callspec.id in in_lab:
            item.add_marker(
                pytest.mark.skip(
                    reason="executed in JupyterLab in this session (test_jupyterlab runs every "
                    "cell and fails on any error output)"
                )
            )
