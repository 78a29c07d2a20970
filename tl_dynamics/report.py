"""The main job: one standalone offline HTML page about a model on a prompt.

Each analysis package that is installed adds its section through ``report_section(page,
adapter, batch)``; the page always starts with every layer's attention patterns.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.errors import TLDynamicsError

log = logging.getLogger(__name__)

# Analysis packages, in page order; each may define report_section(page, adapter, batch).
SECTIONS = ("tl_dynamics.circuits", "tl_dynamics.odds_ratio", "tl_dynamics.contextual_mlp",
            "tl_dynamics.trajectories", "tl_dynamics.particles")
DEFAULT_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"


def attention_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Every layer's attention patterns, heads side by side."""
    tokens = adapter.str_tokens(batch)
    items = []
    for layer, la in adapter.attention(batch).items():
        pattern = la.pattern()[0]
        names = [f"L{layer}H{h}" for h in range(adapter.n_heads)]
        items.append(viz.attention_heads(pattern, tokens, names, caption=f"Layer {layer}",
                                         mask_upper_tri=la.spec.causal))
    page.add_section("Attention patterns", items,
                     intro="Recomputed exactly from the model's own queries and keys "
                           "(scale, rotary, grouped heads, masks and soft-caps as the model scores).")


def build_report(model: Any, prompt: str = DEFAULT_PROMPT, label: str = "",
                 sections: tuple[str, ...] = SECTIONS,
                 progress: Callable[[str], None] | None = None) -> viz.Page:
    """Build the report page for ``model`` on ``prompt`` (see ``write_report``)."""
    adapter = ModelAdapter(model)
    batch = adapter.tokenize(prompt)
    info = adapter.info
    page = viz.Page(f"tl_dynamics report: {label or info.architecture}", meta=[
        ("model", label or info.architecture), ("architecture", info.architecture),
        ("host", f"{info.host} (TransformerLens {info.tl_version}"
                 f"{', compatibility mode' if info.compat else ''})"),
        ("shape", f"{adapter.n_layers} layers, {adapter.n_heads} heads "
                  f"({adapter.n_kv_heads} key/value heads), d_model {adapter.d_model}"),
        ("prompt", f"{prompt!r} ({batch.tokens.shape[1]} tokens)")])
    steps: list[tuple[str, Callable[..., None]]] = [("attention", attention_section)]
    for module_name in sections:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "report_section"):
            steps.append((module_name.rsplit(".", 1)[-1], module.report_section))
    failed: list[str] = []
    for name, section in steps:
        start = time.perf_counter()
        if progress:
            progress(f"section {name} ...")
        try:
            section(page, adapter, batch)
        except TLDynamicsError as exc:  # e.g. not applicable to this architecture
            page.add_section(name, [viz.text(f"Not shown for this model: {exc}")])
        except Exception as exc:  # a bug in one section must not cost the whole page
            log.exception("report section %s failed", name)
            failed.append(name)
            page.add_section(name, [viz.text(f"This section failed: {type(exc).__name__}: {exc}")])
        if progress:
            progress(f"section {name} done in {time.perf_counter() - start:.1f} s")
    page.failed_sections = failed
    return page


def write_report(out: str | os.PathLike, model: Any, prompt: str = DEFAULT_PROMPT,
                 label: str = "", progress: Callable[[str], None] | None = None) -> Path:
    """Write the standalone offline report page; returns its path.

    Example:
        >>> from tl_dynamics import testing, report
        >>> report.write_report("/tmp/r.html", testing.tiny_model("gpt2"), "x = 1")  # doctest: +SKIP
    """
    return build_report(model, prompt, label, progress=progress).write(out)
