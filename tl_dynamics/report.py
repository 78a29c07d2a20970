"""The main job: one standalone offline HTML page about a model on a prompt.

The page opens with every layer's attention (per-head statistics as layer x head maps, a
thumbnail of every head, full patterns for the heads singled out), then one section per analysis
from the explicit registry ``SECTIONS``. A section that does not apply to a model raises
``TLDynamicsError``; this module writes the one "Not shown for this model: reason" message.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tl_dynamics import compat, viz
from tl_dynamics import atlas, circuits, contextual_mlp, odds_ratio, particles, qk_attribution
from tl_dynamics import regression
from tl_dynamics import trajectories
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.collect import Analysis, torch_threads
from tl_dynamics.errors import TLDynamicsError, UnknownTokenWarning
from tl_dynamics.models import CODE_PROMPT as DEFAULT_PROMPT  # the one spelling (models.py)

# the attention section's names stay importable from here (``X as X``: a re-export)
from tl_dynamics._attention_section import ATTENTION_INTRO as ATTENTION_INTRO
from tl_dynamics._attention_section import LEARNED_SINK_CAPTION as LEARNED_SINK_CAPTION
from tl_dynamics._attention_section import NAMED_SHARE as NAMED_SHARE
from tl_dynamics._attention_section import attention_section, checked_heads
from tl_dynamics._attention_section import top_heads_sentence as top_heads_sentence

log = logging.getLogger(__name__)

SectionFn = Callable[[viz.Page, ModelAdapter, Batch], None]


def _registered(package: Any, class_name: str, what: str, prompts: str) -> type[Analysis]:
    """The registry entry of an analysis package: its ``compute``, ``attach`` (None where it
    cannot stream) and ``report_section``, as an ``Analysis`` subclass defined here; ``prompts``:
    whether its report section reads ``"all"`` the report's prompts or the ``"first"``."""
    entries = {
        "__doc__": what,
        "__module__": __name__,
        "name": package.__name__.split(".")[-1],
        "prompts": prompts,
        "compute": staticmethod(package.compute),
        "report_section": staticmethod(package.report_section),
    }
    if hasattr(package, "attach"):
        entries["attach"] = staticmethod(package.attach)
    return type(class_name, (Analysis,), entries)


AtlasAnalysis = _registered(
    atlas,
    "AtlasAnalysis",
    "What each head does, with causal evidence (a whole-model measurement: no attach).",
    "all",
)
CircuitsAnalysis = _registered(
    circuits,
    "CircuitsAnalysis",
    "Factored QK/OV circuits, copying and composition scores (weights only: no attach).",
    "first",
)
OddsRatioAnalysis = _registered(
    odds_ratio, "OddsRatioAnalysis", "The odds-ratio split of every score.", "all"
)
QKAttributionAnalysis = _registered(
    qk_attribution,
    "QKAttributionAnalysis",
    "Every score split exactly over the components that wrote its query and key.",
    "all",
)
ContextualMLPAnalysis = _registered(
    contextual_mlp, "ContextualMLPAnalysis", "Attention as a contextual MLP.", "first"
)
RegressionAnalysis = _registered(
    regression,
    "RegressionAnalysis",
    "Attention as in-context regression (whole prefixes in float64 after the pass: no attach).",
    "all",
)
TrajectoriesAnalysis = _registered(
    trajectories, "TrajectoriesAnalysis", "Depth-wise trajectories and their statistics.", "all"
)
ParticlesAnalysis = _registered(
    particles,
    "ParticlesAnalysis",
    "The idealised particle system beside the model (simulated: no attach).",
    "first",
)


# The analyses, in page order: each a ``tl_dynamics.collect.Analysis`` subclass naming its
# ``compute``, ``attach`` and ``report_section``. Nothing is looked up at run time.
SECTIONS: tuple[type[Analysis], ...] = (
    AtlasAnalysis,  # "What each head does"
    CircuitsAnalysis,
    OddsRatioAnalysis,
    QKAttributionAnalysis,
    ContextualMLPAnalysis,
    RegressionAnalysis,
    TrajectoriesAnalysis,
    ParticlesAnalysis,
)
# Intra-op threads while the report is built (torch's setting is restored after). "auto": torch's
# own default (one per core) on a quiet machine, only the free cores (at least one) when other
# work keeps cores busy: under load, threads that wait for each other cost more than they save
# (benchmarks/README.md, "report").
REPORT_THREADS: int | str | None = "auto"


def unknown_token_warning(
    adapter: ModelAdapter, batch: Batch, details: Sequence[str] = ()
) -> str | None:
    """A warning when the prompt has tokens the tokenizer did not know (its ``unk`` token);
    ``details``: the tokenizer's own account (``UnknownTokenWarning``), which characters."""
    tok = adapter.tokenizer
    unk = getattr(tok, "unk_token_id", None)
    special = {getattr(tok, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    if unk is None or unk in special:
        return None
    count = int((batch.real_tokens() == unk).sum())
    if not count:
        return None
    head = (
        f"{count} of the prompt's {int(batch.key_valid[0].sum())} tokens are unknown to this "
        f"model's tokenizer (shown as {tok.unk_token!r})"
    )
    if details:  # the tokenizer's own account: which characters
        return f"{head}: {details[0].replace('the tokenizer maps', 'it maps', 1)}"
    return f"{head}: use characters it knows."


def busy_cores(sample_s: float = 0.25) -> float:
    """How many cores other work keeps busy now: the non-idle share of ``/proc/stat`` over
    ``sample_s`` seconds times the core count (the 1-minute load average where there is no
    ``/proc/stat``)."""

    def read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(x) for x in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle

    first = read()
    if first is None:
        return os.getloadavg()[0]
    time.sleep(sample_s)
    second = read()
    if second is None:
        return os.getloadavg()[0]
    total, idle = second[0] - first[0], second[1] - first[1]
    return (os.cpu_count() or 1) * (total - idle) / total if total > 0 else 0.0


def report_threads(setting: int | str | None = REPORT_THREADS) -> int | None:
    """The intra-op thread count the report builds with: an int as given (at least 1), None to
    leave torch's setting, ``"auto"`` for None (torch's one per core) when at most half a core
    is busy with other work (``busy_cores``), else the free cores (at least 1, at most torch's
    setting): threads that share a core with another process wait for each other.

    Example:
        >>> report_threads(3), report_threads(None)
        (3, None)
    """
    if setting is None:
        return None
    if setting == "auto":
        cores = os.cpu_count() or 1
        busy = busy_cores()
        free = max(1, min(torch.get_num_threads(), int(cores - busy)))  # never above torch's
        return None if cores > 1 and busy <= 0.5 else free
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise TLDynamicsError(f"threads {setting!r}: give a positive integer, 'auto' or None")
    return setting


def build_report(
    model: Any,
    prompt: Any = DEFAULT_PROMPT,
    label: str = "",
    sections: Sequence[type[Analysis]] = SECTIONS,
    progress: Callable[[str], None] | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
    threads: int | str | None = REPORT_THREADS,
) -> viz.Page:
    """Build the report page for ``model`` on ``prompt`` (a string or token ids; see
    ``write_report``); ``layers`` and ``heads`` focus the attention section; ``threads`` sets
    torch's intra-op threads while building (``report_threads``; None: leave torch's setting)."""
    with torch_threads(report_threads(threads)):
        if progress:
            progress(f"building with {torch.get_num_threads()} torch thread(s)")
        return _build(model, prompt, label, sections, progress, layers, heads)


def _build(
    model: Any,
    prompt: Any,
    label: str,
    sections: Sequence[type[Analysis]],
    progress: Callable[[str], None] | None,
    layers: Sequence[int] | None,
    heads: Sequence[tuple[int, int]] | None,
) -> viz.Page:
    adapter = ModelAdapter.of(model)
    checked_heads(heads, adapter)
    adapter.check_layers(layers)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(i, int) for i in prompt):
        prompt = torch.tensor([list(prompt)])  # token ids (a model without a tokenizer)
    texts = list(prompt) if isinstance(prompt, (list, tuple)) else None  # several prompts
    with warnings.catch_warnings(record=True) as caught:  # said once, below
        warnings.simplefilter("always", UnknownTokenWarning)
        batch = adapter.tokenize(texts if texts is not None else prompt)
    for other in (w for w in caught if not issubclass(w.category, UnknownTokenWarning)):
        warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    info = adapter.info
    n_prompts = int(batch.tokens.shape[0])
    if texts is not None:
        lengths = batch.key_valid.sum(-1).tolist()
        shown_prompts = "; ".join(f"{_clip(t, 200)!r} ({n} tokens)" for t, n in zip(texts, lengths))
        prompt_row = ("prompts", f"{n_prompts}: {_clip(shown_prompts, 2000)}")
    else:
        shown = (
            prompt if isinstance(prompt, str) else " ".join(str(int(i)) for i in batch.tokens[0])
        )
        prompt_row = ("prompt", f"{_clip(shown)!r} ({batch.tokens.shape[1]} tokens)")
    architecture = info.architecture + (
        " (a TransformerLens-native checkpoint, run by TransformerBridge.boot_native)"
        if info.family == "native"
        else ""
    )
    page = viz.Page(
        f"tl_dynamics report: {label or info.architecture}",
        meta=[
            ("model", label or info.architecture),
            ("architecture", architecture),
            (
                "host",
                f"{info.host} (TransformerLens {info.tl_version}"
                f"{', compatibility mode' if info.compat else ''})",
            ),
            (
                "shape",
                f"{adapter.n_layers} layers, {adapter.n_heads} heads "
                f"({adapter.n_kv_heads} key/value heads), d_model {adapter.d_model}",
            ),
            ("runs on", f"{batch.tokens.device}, {str(adapter.dtype).removeprefix('torch.')}"),
            prompt_row,
            ("versions", compat.versions_line()),
        ],
    )
    details = [str(w.message) for w in caught if issubclass(w.category, UnknownTokenWarning)]
    warning = unknown_token_warning(adapter, batch, details)
    if warning:  # one warning for one cause: on the page, and on the console or as a warning
        page.warnings.append(warning)
        if progress:
            progress(f"warning: {warning}")
        else:
            warnings.warn(warning, UnknownTokenWarning, stacklevel=3)
    steps: list[tuple[str, Callable[..., None], str]] = [
        ("attention", lambda p, a, b: attention_section(p, a, b, layers, heads), "first"),
        *((analysis.name, analysis.report_section, analysis.prompts) for analysis in sections),
    ]
    failed: list[str] = []
    for name, section, reads in steps:
        start = time.perf_counter()
        if progress:
            progress(f"section {name} ...")
        before = len(page.sections)
        try:
            section(page, adapter, batch)
            for added in page.sections[before:]:  # every section says which prompts it read
                added.intro = f"{added.intro} {prompts_read(reads, n_prompts)}".strip()
        except TLDynamicsError as exc:  # e.g. not applicable to this architecture
            page.add_section(name.replace("_", " "), [viz.text(f"Not shown for this model: {exc}")])
        except Exception as exc:  # a bug in one section must not cost the whole page
            log.exception("report section %s failed", name)
            failed.append(name)
            page.add_section(
                name.replace("_", " "),
                [viz.text(f"This section failed: {type(exc).__name__}: {exc}")],
            )
        if progress:
            progress(f"section {name} done in {time.perf_counter() - start:.1f} s")
    page.failed_sections = failed
    return page


def prompts_read(reads: str, n: int) -> str:
    """The sentence a section ends its introduction with: which of the ``n`` prompts it read.

    Example:
        >>> prompts_read("all", 2), prompts_read("first", 2), prompts_read("all", 1)
        ('It reads all 2 prompts.', 'It reads the first of the 2 prompts.', 'It reads the 1 prompt.')
    """
    if n == 1:
        return "It reads the 1 prompt."
    return (
        f"It reads all {n} prompts."
        if reads == "all"
        else f"It reads the first of the {n} prompts."
    )


def _clip(text: str, limit: int = 400) -> str:
    return (
        text if len(text) <= limit else text[:limit] + f" ... ({len(text) - limit} more characters)"
    )


def write_report(
    out: str | os.PathLike,
    model: Any,
    prompt: Any = DEFAULT_PROMPT,
    label: str = "",
    progress: Callable[[str], None] | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
    threads: int | str | None = REPORT_THREADS,
) -> Path:
    """Write the standalone offline report page; returns its path.

    Example:
        >>> import pathlib, tempfile
        >>> from tl_dynamics import testing, report
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "r.html"
        >>> report.write_report(out, testing.cached_model("gpt2"), "x = 1", threads=1) == out
        True
        >>> out.read_text().startswith("<!DOCTYPE html>")
        True
    """
    return build_report(
        model, prompt, label, progress=progress, layers=layers, heads=heads, threads=threads
    ).write(out)
